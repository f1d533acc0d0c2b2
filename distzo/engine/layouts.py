"""Which parameters go into which flat bucket, and their initial values.

A model is cut into one bucket per transformer block and one resident bucket (every
parameter outside the blocks: embeddings, head, final norm). Under an adapter the
trained parameters and the frozen base get buckets of their own, so the step perturbs
and updates only what it trains and streams the rest read-only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import cast

import torch
from torch import nn

from distzo.adapters.peft_adapters import check_adapter_name
from distzo.models.weights import WeightSource, parameter_names
from distzo.offload import BucketLayout

RESIDENT_BLOCK_ID = 0  # noise id of the resident bucket; block i has id i + 1

# A bucket's layout with its parameters in layout order (what ``pack`` and ``bind`` take).
LaidOut = tuple[BucketLayout, list[nn.Parameter]]
# Each block's bucket, then the resident bucket: what ``bucket_layouts`` returns.
ModelLayouts = tuple[list[LaidOut], LaidOut]


def bucket_layouts(
    model: nn.Module, blocks: list[nn.Module], select: Callable[[nn.Parameter], bool] | None = None
) -> ModelLayouts:
    """Each block's bucket and the resident bucket (every parameter outside the blocks),
    with their parameters in layout order. Works on a meta-device skeleton (shapes only).

    ``select`` keeps only some parameters (an adapter's trainable ones, or the frozen
    base); a bucket may then be empty."""
    names = parameter_names(model)  # a tied weight: one bucket entry with all its names
    keep: Callable[[nn.Parameter], bool] = select if select is not None else _everything
    dtype = next(model.parameters()).dtype
    block_params = [_unique(b.parameters()) for b in blocks]
    in_blocks = {id(p) for ps in block_params for p in ps}
    resident_params = [p for p in _unique(model.parameters()) if id(p) not in in_blocks and keep(p)]
    empty = dtype if select is not None else None
    built = [
        BucketLayout.build([(names[id(p)], p) for p in ps if keep(p)], empty) for ps in block_params
    ]
    return built, BucketLayout.build([(names[id(p)], p) for p in resident_params], empty)


def unwrap_peft(model: nn.Module) -> tuple[nn.Module, nn.Module | None]:
    """(the transformers model, the ``peft.PeftModel`` around it or None). The engine runs
    the model's own modules, into which peft injected its adapter layers; a peft model of
    another adapter than one named ``default`` is refused (``check_adapter_name``)."""
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        check_adapter_name(model)
        # nn.Module types an attribute it does not declare as a tensor or a submodule
        get_base_model = cast(Callable[[], nn.Module], model.get_base_model)
        return get_base_model(), model
    return model, None


def split_layouts(
    model: nn.Module, blocks: list[nn.Module]
) -> tuple[ModelLayouts, ModelLayouts | None]:
    """``(trained, frozen)``: the bucket layouts of what a step trains and, for a partly
    frozen model (an adapter), of its frozen base (None for full tuning); each as
    ``bucket_layouts`` returns them. Read before the engine freezes every parameter."""
    select = trainable_selector(model)
    trained = bucket_layouts(model, blocks, select)
    frozen = (
        bucket_layouts(model, blocks, functools.partial(_not, select))
        if select is not None
        else None
    )
    return trained, frozen


def trainable_selector(model: nn.Module) -> Callable[[nn.Parameter], bool] | None:
    """Which parameters a step perturbs and updates: those with ``requires_grad`` when the
    model is partly frozen (a peft adapter on a frozen base); None: all of them."""
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    if 0 < len(trainable) < len({id(p) for p in model.parameters()}):
        return lambda p: id(p) in trainable
    return None


def bucket_values(layout: BucketLayout, ordered: list[nn.Parameter]) -> torch.Tensor:
    """One bucket's initial values on the host, from a model with values of its own (one
    still on the meta device is read from its source: ``bucket_range``)."""
    flat = torch.zeros(layout.numel, dtype=layout.dtype)
    params: list[torch.Tensor] = list(ordered)
    layout.pack(params, flat)
    return flat


# elements a start-up read brings to the host at once: 16 MiB in fp32, small enough for the
# host's allocator to reuse (a larger piece is fresh pages each time)
LOAD_CHUNK = 1 << 22


def device_bucket(
    layout: BucketLayout,
    ordered: list[nn.Parameter],
    weights: WeightSource | None,
    device: torch.device,
) -> torch.Tensor:
    """A resident bucket's initial values, written on ``device`` ``LOAD_CHUNK`` elements
    at a time: the host holds one chunk, never the bucket (the embedding and the head:
    8.4 GB in fp32 for a 128k vocabulary at width 8192, on every rank of a node). A model
    with values of its own is already in memory whole."""
    if weights is None:
        return bucket_values(layout, ordered).to(device)
    out = torch.empty(layout.numel, dtype=layout.dtype, device=device)
    copy_in_chunks(out, functools.partial(bucket_range, layout, weights))
    return out


def copy_in_chunks(out: torch.Tensor, read: Callable[[int, int], torch.Tensor]) -> None:
    """``out[lo:hi] = read(lo, hi)``, ``LOAD_CHUNK`` elements at a time: a resident
    bucket (or a resident block) filled with one chunk on the host at once."""
    for lo in range(0, out.numel(), LOAD_CHUNK):
        hi = min(lo + LOAD_CHUNK, out.numel())
        out[lo:hi].copy_(read(lo, hi))


def bucket_range(layout: BucketLayout, weights: WeightSource, lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of a bucket, read from the source tensor by tensor (alignment gaps
    0): a sliced rank reads only its share of a block from the checkpoint. Each element
    is written once (the gaps zeroed, not the whole range first)."""
    out = torch.empty(hi - lo, dtype=layout.dtype)
    written = lo  # elements before this one are written (entries are in offset order)
    for e in layout.entries:
        a, b = max(lo, e.offset), min(hi, e.offset + e.numel)
        if a < b:
            out[written - lo : a - lo].zero_()
            out[a - lo : b - lo] = weights.tensor_range(
                e.names, e.shape, layout.dtype, a - e.offset, b - e.offset
            )
            written = b
    out[written - lo :].zero_()
    return out


def _everything(p: nn.Parameter) -> bool:
    return True


def _not(select: Callable[[nn.Parameter], bool], p: nn.Parameter) -> bool:
    return not select(p)


def _unique(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    seen: set[int] = set()
    out: list[nn.Parameter] = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
