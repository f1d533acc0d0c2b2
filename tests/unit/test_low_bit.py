import pytest
import torch

from distzo import ZOConfig, ZOEngine
from distzo.data import CountingTask
from distzo.offload.low_bit import TRANSFER_DTYPES, round_nearest_, round_stochastic_
from tests.helpers.models import tiny_opt

LOW_BIT = {name: dtype for name, dtype in TRANSFER_DTYPES.items() if name != "fp32"}
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float8_e4m3fn: 3}


def normal_range_values(dtype, n=100_000):
    """Magnitudes inside the format's normal range, both signs."""
    g = torch.Generator().manual_seed(0)
    low = torch.finfo(dtype).smallest_normal
    high = min(torch.finfo(dtype).max / 4, 1e4)
    magnitude = torch.exp(
        torch.empty(n).uniform_(
            torch.tensor(low * 4).log().item(), torch.tensor(high).log().item(), generator=g
        )
    )
    return magnitude * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)


@pytest.mark.parametrize("name", LOW_BIT)
def test_round_trip_error_bounds(name):
    dtype = LOW_BIT[name]
    x = normal_range_values(dtype)
    ulp = 2.0 ** -MANTISSA_BITS[dtype]  # spacing relative to the value's binade
    nearest = torch.empty_like(x, dtype=dtype)
    round_nearest_(nearest, x)
    assert ((nearest.float() - x).abs() / x.abs()).max() <= ulp / 2
    stochastic = torch.empty_like(x, dtype=dtype)
    round_stochastic_(
        stochastic, x, torch.rand(x.shape, generator=torch.Generator().manual_seed(1))
    )
    assert ((stochastic.float() - x).abs() / x.abs()).max() < ulp
    # stochastic rounding only ever picks one of the two representable neighbours of x,
    # checked against a table of every finite value of the format
    table = all_finite_values(dtype)
    above = torch.searchsorted(table, x, right=False)
    floor = table[(torch.searchsorted(table, x, right=True) - 1).clamp(min=0)]
    ceil = table[above.clamp(max=table.numel() - 1)]
    value = stochastic.float()
    assert ((value == floor) | (value == ceil)).all()
    assert (value == floor).any() and (value == ceil).any()


def all_finite_values(dtype):
    bits = 8 * torch.empty((), dtype=dtype).element_size()
    codes = torch.arange(-(2 ** (bits - 1)), 2 ** (bits - 1), dtype=torch.int32)
    values = codes.to({8: torch.int8, 16: torch.int16}[bits]).view(dtype).float()
    return values[torch.isfinite(values)].unique()  # sorted; +0 and -0 collapse


@pytest.mark.parametrize("name", LOW_BIT)
def test_representable_values_and_out_of_range_values(name):
    dtype = LOW_BIT[name]
    exact = torch.tensor([0.0, 1.0, -2.0, 0.5]).to(dtype)
    out = torch.empty_like(exact)
    round_stochastic_(out, exact.float(), torch.full((4,), 0.999))
    assert torch.equal(out.float(), exact.float())
    limit = torch.finfo(dtype).max
    round_stochastic_(out, torch.tensor([float("inf"), -float("inf"), limit, 0.0]), torch.rand(4))
    assert out.float().tolist() == [limit, -limit, limit, 0.0]  # saturated, never inf or nan


@pytest.mark.parametrize("name", LOW_BIT)
def test_two_hundred_tiny_updates_survive_only_stochastic_rounding(name):
    dtype = LOW_BIT[name]
    n, updates = 20_000, 200
    start = torch.full((n,), 1.0)
    delta = 2.0 ** -MANTISSA_BITS[dtype] / 40  # far below half an ulp at 1.0
    g = torch.Generator().manual_seed(0)
    stochastic = start.to(dtype)
    nearest = start.to(dtype)
    for _ in range(updates):
        nxt = torch.empty_like(stochastic)
        round_stochastic_(nxt, stochastic.float() + delta, torch.rand(n, generator=g))
        stochastic = nxt
        round_nearest_(nearest, nearest.float() + delta)
    expected = 1.0 + updates * delta
    assert torch.equal(nearest.float(), start)  # round-to-nearest lost every update
    drift = stochastic.float().mean().item() - expected
    assert abs(drift) < 0.02 * updates * delta, (drift, updates * delta)  # mean drift ~0


@pytest.mark.parametrize("name", LOW_BIT)
def test_a_float64_master_rounds_unbiased_below_a_float32_ulp(name):
    """An fp64 master's update a quarter of a float32 ulp above 1.0 (lost to round-to-
    nearest into float32) keeps its expected value: over uniforms spread evenly on [0, 1),
    the mean of the roundings is the float64 value exactly, on either sign."""
    dtype, n = LOW_BIT[name], 1 << 22
    uniform = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    for x in (1.0 + 2.0**-25, -(1.0 + 2.0**-25)):
        out = torch.empty(n, dtype=dtype)
        round_stochastic_(out, torch.full((n,), x, dtype=torch.float64), uniform)
        assert out.double().mean().item() == x, name


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp8"])
def test_low_bit_transfer_trains_and_halves_or_quarters_the_host_copy(name):
    model, reference = tiny_opt(seed=0), tiny_opt(seed=0)
    task = CountingTask(model.config.vocab_size, seed=0)
    evaluation = task.batch(64)
    evaluation["labels"] = evaluation["input_ids"]
    compute = "fp32" if name == "fp8" else name
    # eps 1e-2: with bf16/fp16 activations, L+ - L- at eps 1e-3 is noisier (measured on the
    # first step: bf16 compute moves g by a median 2% at eps 1e-3, 0.5% at 1e-2).
    engine = ZOEngine(
        model,
        ZOConfig(
            lr=1e-2, eps=1e-2, seed=0, device="cpu", transfer_dtype=name, compute_dtype=compute
        ),
    )
    full = ZOEngine(reference, ZOConfig(lr=1e-2, eps=1e-2, seed=0, device="cpu"))
    assert engine.store.host_storage.dtype == TRANSFER_DTYPES[name]
    ratio = engine.store.host_bytes / full.store.host_bytes
    assert ratio == TRANSFER_DTYPES[name].itemsize / 4
    assert (
        engine.block_scratch.dtype
        == {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float32}[name]
    )
    before = engine.forward(evaluation)[1].item()
    for _ in range(100):
        engine.step(task.batch(32))
    after = engine.forward(evaluation)[1].item()
    assert after < before - 0.3, (before, after)


@pytest.mark.parametrize("master, wire", [(torch.float16, "bf16"), (torch.bfloat16, "fp16")])
def test_a_transfer_as_wide_as_a_16_bit_model_is_refused_in_one_line(master, wire):
    """A 16-bit model's blocks would rest in another 16-bit format: no byte saved (fp16
    masters did not even fit bf16's range: a torch overflow error at the load)."""
    with pytest.raises(ValueError, match=f"transfer_dtype {wire} is as wide as") as refused:
        ZOEngine(tiny_opt(dtype=master), ZOConfig(seed=0, device="cpu", transfer_dtype=wire))
    assert "\n" not in str(refused.value) and str(refused.value).endswith("or fp8")
    # fp8 is narrower: half the bytes of the blocks in their own dtype
    hosts = [
        ZOEngine(
            tiny_opt(dtype=master), ZOConfig(seed=0, device="cpu", transfer_dtype=name)
        ).store.host_bytes
        for name in ("fp8", "fp32")
    ]
    assert hosts[0] * 2 == hosts[1]


def test_low_bit_needs_offload_mode():
    with pytest.raises(ValueError, match="transfer_dtype bf16 only applies to mode offload"):
        ZOConfig(mode="resident", transfer_dtype="bf16")


@pytest.mark.parametrize("name", ["bf16", "fp8"])
def test_one_master_buffer_serves_every_low_bit_slot(name):
    """K slots in the wire format and one float32 master, rebuilt per block while it
    computes: the trajectory is the same for any K, and only one block takes fp32 bytes."""
    runs = {}
    for slots in (1, 3):
        model = tiny_opt(seed=0)
        task = CountingTask(model.config.vocab_size, seed=0)
        config = ZOConfig(
            lr=1e-2, eps=1e-2, seed=0, device="cpu", transfer_dtype=name, num_slots=slots
        )
        engine = ZOEngine(model, config)
        losses = [engine.step(task.batch(8)).loss for _ in range(4)]
        store = engine.store
        biggest = max(store.padded)
        assert store.device_bytes == biggest * (slots * TRANSFER_DTYPES[name].itemsize + 4)
        runs[slots] = (losses, store.host_storage.clone())
    assert runs[1][0] == runs[3][0]
    assert torch.equal(runs[1][1].view(torch.uint8), runs[3][1].view(torch.uint8))


@pytest.mark.parametrize("name", LOW_BIT)
def test_rounding_to_nearest_on_the_host_a_piece_at_a_time_is_the_whole_clamp(monkeypatch, name):
    """The host rounds a block's load a piece at a time (a small scratch the allocator
    reuses): the same bits as clamping the whole tensor at once, saturation included,
    over pieces that end inside the tensor and at its last element."""
    from distzo.offload import low_bit

    dtype = LOW_BIT[name]
    limit = torch.finfo(dtype).max
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1003, generator=g) * limit * 0.6  # about a tenth beyond the range
    x[[0, 500, 1002]] = torch.tensor([3 * limit, -3 * limit, 2 * limit])
    whole = torch.empty(1003, dtype=dtype)
    whole.copy_(x.clamp(-limit, limit))
    monkeypatch.setattr(low_bit, "HOST_ROUND_CHUNK", 100)
    pieces = torch.empty(1003, dtype=dtype)
    round_nearest_(pieces, x)
    assert torch.equal(pieces.view(torch.uint8), whole.view(torch.uint8))
    assert pieces.float().abs().max().item() == limit
