import pytest
import torch
from torch import nn

from distzo.offload.bucket import ALIGN_ELEMENTS, BucketLayout, bind


def test_layout_puts_decayed_parameters_first_and_aligns_offsets():
    lin = nn.Linear(5, 3)
    norm = nn.LayerNorm(3)
    params = [(("bias",), lin.bias), (("w",), lin.weight), (("ln.w", "tied.w"), norm.weight)]
    layout, ordered = BucketLayout.build(params)
    assert [e.names[0] for e in layout.entries] == ["w", "bias", "ln.w"]
    assert ordered == [lin.weight, lin.bias, norm.weight]
    assert all(e.offset % ALIGN_ELEMENTS == 0 for e in layout.entries)
    assert layout.decay_end == ALIGN_ELEMENTS  # only the matrix decays
    assert layout.numel % ALIGN_ELEMENTS == 0
    assert layout.num_parameters == 15 + 3 + 3

    flat = torch.full((layout.numel,), float("nan"))
    layout.pack(ordered, flat)
    views = layout.views(flat)
    assert torch.equal(views["w"], lin.weight.detach())
    assert views["tied.w"] is views["ln.w"]
    assert torch.count_nonzero(torch.isnan(flat)) == 0  # padding is zeroed, not garbage

    model = nn.Module()
    model.lin, model.ln = lin, norm
    named, _ = BucketLayout.build(
        [(("lin.weight",), lin.weight), (("lin.bias",), lin.bias), (("ln.weight",), norm.weight)]
    )
    named_flat = torch.zeros(named.numel)
    bind(model, named, named_flat)
    named_flat[named.entries[0].offset] = 42.0
    assert model.lin.weight[0, 0].item() == 42.0  # the module now computes with the bucket
    assert model.lin.weight.data_ptr() == named_flat.data_ptr()


def test_mixed_dtypes_are_refused():
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="one dtype"):
        BucketLayout.build([(("a",), a), (("b",), b)])


def test_an_aligned_parameter_takes_exactly_its_own_elements():
    """A parameter whose size is a multiple of the alignment is followed by no padding: the
    next one starts right after it (the layout, its noise and a checkpoint's flat blocks
    depend on these offsets), and padding never exceeds one alignment short."""
    lin = nn.Linear(ALIGN_ELEMENTS, 2)  # weight: 2 x 64, a multiple of the alignment
    norm = nn.LayerNorm(ALIGN_ELEMENTS)
    layout, _ = BucketLayout.build(
        [(("w",), lin.weight), (("b",), lin.bias), (("ln",), norm.weight), (("lnb",), norm.bias)]
    )
    assert [(e.names[0], e.offset) for e in layout.entries] == [
        ("w", 0),
        ("b", 2 * ALIGN_ELEMENTS),
        ("ln", 3 * ALIGN_ELEMENTS),
        ("lnb", 4 * ALIGN_ELEMENTS),
    ]
    assert layout.decay_end == 2 * ALIGN_ELEMENTS
    assert layout.numel == 5 * ALIGN_ELEMENTS
