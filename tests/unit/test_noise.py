import numpy as np
import pytest
import torch

from distzo.zo import NoiseSource, noise_seed


def test_seed_is_a_pure_function_of_its_coordinates():
    assert noise_seed(7, 3, 2, 1) == noise_seed(7, 3, 2, 1)
    seeds = {noise_seed(7, s, b, c) for s in range(4) for b in range(4) for c in range(4)}
    assert len(seeds) == 64
    assert all(0 <= s < 2**63 for s in seeds)
    # query 0 is the single-direction draw; every other query is a fresh coordinate
    assert noise_seed(7, 3, 2, 1, query=0) == noise_seed(7, 3, 2, 1)
    queries = {noise_seed(7, 3, 2, 1, query=q) for q in range(8)}
    assert len(queries | seeds) == 64 + 7


def _splitmix64_chain(parts):
    """splitmix64 (Steele et al.'s constants) over the run seed, then each coordinate."""
    mask = (1 << 64) - 1

    def mix(x):
        x = (x + 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    h = mix(parts[0])
    for part in parts[1:]:
        h = mix(h ^ part)
    return h >> 1


def test_query_zero_draws_the_noise_of_runs_before_queries_existed():
    """Query 0 chains no query coordinate: a MeZO run's noise, checkpoints and seed logs
    stay those of the single-query code (pinned by value, as those runs drew it)."""
    assert noise_seed(7, 3, 2, 1) == _splitmix64_chain([7, 3, 2, 1]) == 5962782553682375558
    assert noise_seed(7, 3, 2, 1, query=2) == _splitmix64_chain([7, 3, 2, 1, 2])
    assert noise_seed(7, 3, 2, 1, query=2) == 4425561553327678617


def test_a_portable_z_is_pinned_by_value_from_its_seed_to_the_table():
    """Every implementation takes the same key, so a change to the key's words (or to any
    later stage) would agree with itself and differ from what earlier runs drew: their
    checkpoints, seed logs and replays. Pinned as they drew it."""
    from distzo.zo import philox

    assert philox.noise_key(7, 3, 2, 1, philox.STREAM_NOISE) == (0xF768DD17, 0x6B45BA4B)
    z = NoiseSource(7, 1000, torch.device("cpu"), torch.float32).full(6, step=3, block_id=2)
    assert z.tolist() == [
        -0.39631006121635437,
        -0.09048540145158768,
        -0.20559050142765045,
        0.5352901220321655,
        0.4604203402996063,
        0.5236730575561523,
    ]


def test_the_keys_of_many_steps_are_each_steps_own_key():
    """``noise_keys`` (array ops: an exported step's ``keys.safetensors`` of 100,000 steps,
    once a Python loop of seconds) equals ``noise_key`` step by step: steps past 10**6,
    2**31 and 2**32, the step before the first (-1), a 64-bit seed, a query and a stream."""
    from distzo.zo import philox

    steps = [0, 1, 2, 10**6, 2**31 - 1, 2**31 + 5, 2**32 + 7, 2**62 + 3, -1]
    blocks = [0, 1, 2, 7]
    for seed, query, stream in [(7, 0, philox.STREAM_NOISE), (2**64 - 1, 3, 1), (-5, 1, 2)]:
        keys = philox.noise_keys(seed, steps, blocks, query, stream)
        assert keys.dtype == np.int64 and keys.shape == (len(steps), len(blocks), 2)
        assert keys.tolist() == [
            [list(philox.noise_key(seed, s, b, query, stream)) for b in blocks] for s in steps
        ]


def test_a_chunk_does_not_depend_on_the_range_asked_for():
    src = NoiseSource(run_seed=5, chunk=10, device=torch.device("cpu"), dtype=torch.float32)
    full = src.full(35, step=2, block_id=1)
    for start, stop in [(0, 35), (3, 17), (10, 20), (31, 35), (9, 11)]:
        pieces = [(lo, hi, z.clone()) for lo, hi, z in src.chunks(start, stop, 35, 2, 1)]
        assert pieces[0][0] == start and pieces[-1][1] == stop
        got = torch.cat([z for _, _, z in pieces])
        assert torch.equal(got, full[start:stop])
    assert not torch.equal(full, src.full(35, step=3, block_id=1))
    assert not torch.equal(full, src.full(35, step=2, block_id=2))


def test_noise_is_standard_normal():
    z = NoiseSource(0, 1 << 12, torch.device("cpu"), torch.float64).full(200_000, 0, 0)
    assert abs(z.mean().item()) < 0.01
    assert abs(z.std().item() - 1) < 0.01


def test_perturb_and_update_follow_the_mezo_formulas():
    src = NoiseSource(3, chunk=16, device=torch.device("cpu"), dtype=torch.float64)
    theta = torch.randn(50, dtype=torch.float64)
    z = src.full(50, step=4, block_id=9)
    out = torch.empty(64, dtype=torch.float64)
    src.perturb_into(out, theta, -1e-3, step=4, block_id=9)
    torch.testing.assert_close(out[:50], theta - 1e-3 * z, rtol=0, atol=1e-15)
    src.perturb_into(out, theta, 0.0, step=4, block_id=9)
    assert torch.equal(out[:50], theta)

    lr, g, wd, decay_end = 0.1, 2.5, 0.01, 20
    updated = theta.clone()
    src.apply_update(updated, decay_end, lr, (g,), wd, step=4, block_id=9)
    expected = theta - lr * g * z
    expected[:decay_end] -= lr * wd * theta[:decay_end]
    torch.testing.assert_close(updated, expected, rtol=1e-13, atol=1e-15)


def test_a_multi_query_update_averages_the_directions():
    src = NoiseSource(3, chunk=16, device=torch.device("cpu"), dtype=torch.float64)
    theta = torch.randn(50, dtype=torch.float64)
    zs = [src.full(50, step=4, block_id=9, query=q) for q in range(3)]
    assert not torch.equal(zs[0], zs[1]) and not torch.equal(zs[1], zs[2])
    assert torch.equal(zs[0], src.full(50, step=4, block_id=9))
    out = torch.empty(50, dtype=torch.float64)
    src.perturb_into(out, theta, 1e-3, step=4, block_id=9, query=2)
    torch.testing.assert_close(out, theta + 1e-3 * zs[2], rtol=0, atol=1e-15)

    lr, grads, wd, decay_end = 0.1, (2.5, -1.0, 0.25), 0.01, 20
    updated = theta.clone()
    src.apply_update(updated, decay_end, lr, grads, wd, step=4, block_id=9)
    expected = theta - lr * sum(g * z for g, z in zip(grads, zs)) / 3
    expected[:decay_end] -= lr * wd * theta[:decay_end]  # decay once, not once per query
    torch.testing.assert_close(updated, expected, rtol=1e-13, atol=1e-15)


def test_bad_ranges_and_chunks_are_refused():
    with pytest.raises(ValueError, match="chunk"):
        NoiseSource(0, 0, torch.device("cpu"), torch.float32)
    src = NoiseSource(0, 4, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="outside"):
        list(src.chunks(0, 9, 8, 0, 0))


def test_a_range_outside_its_bucket_is_refused_before_any_change_on_every_path():
    for fused in (False, True):  # the chunked ops; the fused kernels' wiring (none runs)
        src = NoiseSource(0, 4, torch.device("cpu"), torch.float32)
        src._triton = fused
        theta = torch.ones(8)
        with pytest.raises(ValueError, match=r"noise range \[5, 13\) is outside a bucket of 10"):
            src.apply_terms(theta, 13, 0.5, [(0, 0, 1e-3)], 0, 5, 10)
        assert torch.equal(theta, torch.ones(8))  # not decayed before the refusal
        with pytest.raises(ValueError, match=r"noise range \[-3, 5\) is outside"):
            src.perturb_into(torch.empty(8), theta, 1e-3, 0, 0, 0, -3)


def test_an_output_shorter_than_its_input_is_refused_before_any_write():
    from distzo.offload.low_bit import round_keyed_

    src = NoiseSource(0, 4, torch.device("cpu"), torch.float32)
    buffer = torch.zeros(8)
    with pytest.raises(ValueError, match="out holds 4 elements, fewer than the 8"):
        src.perturb_into(buffer[:4], torch.ones(8), 1e-3, 0, 0)
    assert not buffer[4:].any()  # nothing written past the out it was given
    rounding = NoiseSource(0, 4, torch.device("cpu"), torch.float32, "uniform")
    with pytest.raises(ValueError, match="destination holds 4 elements, fewer than the 8"):
        round_keyed_(torch.empty(4, dtype=torch.bfloat16), torch.ones(8), rounding, 0, 8, 0, 0)


def test_a_strided_out_keeps_the_chunked_path():
    # the fused kernels write out's elements in order: a view with gaps is not theirs
    src = NoiseSource(0, 4, torch.device("cpu"), torch.float32)
    src._triton = True  # as on CUDA with Triton (no kernel runs here)
    theta = torch.ones(8)
    assert src.fuses_master(theta, torch.empty(8))
    assert not src.fuses_master(theta, torch.empty(16)[::2])
    assert not src.fuses_master(theta.bfloat16(), torch.empty(16, dtype=torch.bfloat16)[::2])


# ---- the portable generator: one definition, several implementations, the same bits ----

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from packaging.version import Version  # noqa: E402

from distzo.zo import fast_noise, philox  # noqa: E402
from distzo.zo.gaussian_table import gaussian_table  # noqa: E402

TILE16 = philox.TILE_BLOCKS * philox.LANES16  # 4,096 elements of z per tile
# (start, stop) ranges: inside one tile, across tile edges, not multiples of anything
RANGES = [(0, 1), (0, 37), (5, 4096), (4090, 4100), (4095, 12289), (20_000, 20_003), (8191, 8193)]
# offsets where 32-bit arithmetic wraps (a bucket of a 70B model passes 2^31 elements)
RANGES += [(2**31 - 100, 2**31 + 100), (2**32 - 50, 2**32 + 50), (2**40 + 3, 2**40 + 9)]
KEYS = [(0, 0), (0xFFFFFFFF, 0xFFFFFFFF), philox.noise_key(7, 3, 2, 1, philox.STREAM_NOISE)]


def test_philox_matches_the_random123_known_answers():
    # Random123's kat_vectors for philox4x32_R(10, ctr, key)
    assert philox.philox4x32((0, 0, 0, 0), (0, 0)) == (
        0x6627E8D5,
        0xE169C58D,
        0xBC57AC4C,
        0x9B00DBD8,
    )
    assert philox.philox4x32((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2) == (
        0x408F276D,
        0x41C83B0E,
        0xA20BC7C6,
        0x6D5451FD,
    )
    assert philox.philox4x32(
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)
    ) == (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


@pytest.mark.parametrize("lanes", [philox.LANES16, philox.LANES32])
def test_torch_lanes_equal_the_reference_bit_for_bit(lanes):
    for key in KEYS:
        for start, stop in RANGES[:5]:
            got = philox.torch_lanes(key, start, stop, lanes).tolist()
            assert got == philox.reference_lanes(key, start, stop, lanes), (key, start, stop)


@pytest.mark.parametrize("lanes", [philox.LANES16, philox.LANES32])
def test_many_keys_drawn_at_once_give_each_keys_own_bits(lanes):
    # the exported training step draws every block's noise as one grid of keys x elements
    keys = torch.tensor(KEYS, dtype=torch.int64)
    for start, stop in RANGES[:5]:
        grid = philox.torch_lanes((keys[:, :1], keys[:, 1:]), start, stop, lanes)
        assert grid.shape == (len(KEYS), stop - start)
        for row, key in zip(grid.tolist(), KEYS):
            assert row == philox.torch_lanes(key, start, stop, lanes).tolist(), (key, start, stop)


def test_each_element_of_a_tile_has_its_own_counter_and_lane():
    pairs = philox.counters_and_lanes(0, 2 * TILE16, philox.LANES16)[1]
    assert len(set(pairs)) == 2 * TILE16
    assert pairs[1] == (1, 0) and pairs[512] == (0, 1) and pairs[TILE16] == (512, 0)


def sources(kind, distribution="normal", chunk=1000):
    """The same draws from the C kernel and from the torch implementation."""
    fast = NoiseSource(3, chunk, torch.device("cpu"), torch.float32, distribution, kind=kind)
    slow = NoiseSource(3, chunk, torch.device("cpu"), torch.float32, distribution, kind=kind)
    slow._c = False
    return fast, slow


@pytest.mark.skipif(not fast_noise.available(), reason="the C noise kernel was not built")
@pytest.mark.parametrize(
    "kind,distribution", [("gaussian", "normal"), ("rademacher", "normal"), ("gaussian", "uniform")]
)
def test_the_c_kernel_equals_the_torch_implementation_bit_for_bit(kind, distribution):
    fast, slow = sources(kind, distribution)
    assert (fast.backend, slow.backend) == ("c", "torch")
    for step, block in [(0, 0), (5, 3), (123456, 77)]:
        key = fast.key(step, block)
        for start, stop in RANGES:
            out = torch.empty(stop - start)
            fast._fill(out, start, key)
            assert torch.equal(
                out.view(torch.int32), slow.reference(start, stop, key).view(torch.int32)
            ), (start, stop)


@pytest.mark.skipif(not fast_noise.available(), reason="the C noise kernel was not built")
def test_the_c_kernel_refuses_a_gaussian_fill_without_the_table():
    # C reads the table through a bare pointer: a short one read past its end, None crashed
    out = torch.empty(8)
    for table in (torch.zeros(4), gaussian_table().double(), None):
        with pytest.raises(ValueError, match="gaussian draws read the Gaussian table"):
            fast_noise.fill(out, 0, (1, 2), "gaussian", table)
    with pytest.raises(ValueError, match="noise draw must be one of"):
        fast_noise.fill(out, 0, (1, 2), "normal", gaussian_table())
    with pytest.raises(ValueError, match="fills contiguous float32 CPU tensors"):
        # C writes numel floats on from the first element: a strided view's neighbours
        fast_noise.fill(torch.zeros(16)[::2], 0, (1, 2), "rademacher", None)
    fast_noise.fill(out, 0, (1, 2), "rademacher", None)  # +-1 and uniforms need no table
    assert set(out.tolist()) <= {-1.0, 1.0}


def test_the_definition_of_z_is_the_table_at_the_reference_bits():
    src = NoiseSource(3, 333, torch.device("cpu"), torch.float32)
    key = src.key(2, 5)
    bits = philox.reference_lanes(key, 4000, 4200, philox.LANES16)
    table = gaussian_table()
    assert torch.equal(src.full(4200, 2, 5)[4000:], table[torch.tensor(bits)])
    rademacher = NoiseSource(3, 333, torch.device("cpu"), torch.float32, kind="rademacher").full(
        4200, 2, 5
    )[4000:]
    assert rademacher.tolist() == [1.0 if b & 0x8000 else -1.0 for b in bits]


@pytest.mark.parametrize("kind", ["gaussian", "rademacher"])
def test_chunking_never_changes_a_portable_draw(kind):
    whole = NoiseSource(9, 1 << 16, torch.device("cpu"), torch.float32, kind=kind).full(
        10_007, 4, 1
    )
    for chunk in (1, 511, 4096, 4097):
        assert torch.equal(
            NoiseSource(9, chunk, torch.device("cpu"), torch.float32, kind=kind).full(10_007, 4, 1),
            whole,
        )


def test_float64_masters_take_the_exact_float32_values():
    single = NoiseSource(9, 4000, torch.device("cpu"), torch.float32).full(9000, 1, 1)
    double = NoiseSource(9, 4000, torch.device("cpu"), torch.float64).full(9000, 1, 1)
    assert double.dtype == torch.float64 and torch.equal(double, single.double())


def test_the_gaussian_table_is_symmetric_with_unit_variance():
    table = gaussian_table().double()
    assert torch.equal(table, -table.flip(0))  # mean exactly 0
    assert abs(table.pow(2).mean().item() - 1) < 1e-9
    assert table.min().item() == pytest.approx(-4.325, abs=1e-3)
    assert bool((table[1:] > table[:-1]).all())  # quantiles: increasing, no repeated value


def test_a_table_other_than_the_pinned_one_is_refused(monkeypatch):
    """A platform whose inverse normal CDF rounds one value differently would draw other z
    than every other machine: it refuses to build the table instead."""
    from distzo.zo import gaussian_table as module

    monkeypatch.setattr(module, "TABLE_SHA256", "0" * 64)
    gaussian_table.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="inverse normal CDF rounds differently"):
            gaussian_table()
    finally:
        gaussian_table.cache_clear()


def moments_sample(kind, n, step=0, block=0, query=0):
    return (
        NoiseSource(1234, 1 << 20, torch.device("cpu"), torch.float32, kind=kind)
        .full(n, step, block, query)
        .double()
    )


def correlation(a, b):
    a, b = a - a.mean(), b - b.mean()
    return ((a * b).mean() / (a.std() * b.std())).item()


@pytest.mark.parametrize("kind", ["gaussian", "rademacher"])
def test_moments_and_independence_over_ten_million_draws(kind):
    n = 10_000_000
    z = moments_sample(kind, n)
    assert abs(z.mean().item()) < 4 / n**0.5  # four standard errors
    if kind == "gaussian":
        assert abs(z.pow(2).mean().item() - 1) < 4 * (2 / n) ** 0.5
    else:
        assert bool((z.abs() == 1).all())  # z^2 = 1 exactly
    assert abs(correlation(z[1:], z[:-1])) < 1e-3  # neighbours
    assert abs(correlation(z[512:], z[:-512])) < 1e-3  # same counter, next lane
    assert abs(correlation(z, moments_sample(kind, n, query=1))) < 1e-3  # queries
    assert abs(correlation(z, moments_sample(kind, n, step=1))) < 1e-3  # consecutive steps
    assert abs(correlation(z, moments_sample(kind, n, block=1))) < 1e-3  # blocks


def test_rademacher_is_balanced_by_construction():
    # the sign is one bit of a 16-bit lane: exactly half of the lane values give +1
    values = torch.arange(1 << 16)
    assert int(((values & 0x8000) != 0).sum()) == 1 << 15
    z = moments_sample("rademacher", 1_000_000)
    assert set(z.unique().tolist()) == {-1.0, 1.0}


def test_rounding_uniforms_are_a_separate_stream_in_zero_one():
    normal = NoiseSource(5, 4096, torch.device("cpu"), torch.float32).full(50_000, 3, 2)
    uniform = NoiseSource(5, 4096, torch.device("cpu"), torch.float32, "uniform").full(50_000, 3, 2)
    assert float(uniform.min()) >= 0 and float(uniform.max()) < 1
    assert abs(uniform.mean().item() - 0.5) < 4 * (1 / 12 / 50_000) ** 0.5
    assert abs(correlation(uniform.double(), normal.double())) < 0.02


def test_legacy_noise_is_still_the_torch_generator_chunk_by_chunk():
    src = NoiseSource(5, 10, torch.device("cpu"), torch.float32, kind="legacy")
    generator = torch.Generator().manual_seed(noise_seed(5, 2, 1, 1))
    assert torch.equal(src.full(25, 2, 1)[10:20], torch.empty(10).normal_(generator=generator))


TRITON_PROBE = Path(__file__).parents[1] / "helpers" / "triton_noise_probe.py"
# the first Triton whose interpreter rounds tl.fma once, as a GPU does; before it the
# interpreter multiplies, then adds, and an update of several terms is a bit off
FUSED_FMA_INTERPRETER = Version("3.9")


def test_the_triton_kernels_interpreted_equal_the_reference():
    """The CUDA kernels, run by Triton's interpreter on the CPU: fill bit for bit, the
    fused perturb and update within an ulp of torch's arithmetic on the reference z."""
    triton = pytest.importorskip("triton")
    if Version(triton.__version__) < FUSED_FMA_INTERPRETER:
        pytest.skip(f"Triton {triton.__version__}'s interpreter rounds tl.fma twice (3.9's once)")
    env = os.environ | {"TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(TRITON_PROBE)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "triton kernels == reference" in done.stdout


def test_the_triton_kernels_compile_for_a_hopper_gpu():
    """The interpreter accepts code the compiler refuses (a global that is not a
    constexpr, say): compile each kernel to a cubin for sm_90 (Hopper), without a GPU."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = Path(__file__).parents[1] / "helpers" / "triton_compile_probe.py"
    done = subprocess.run(
        [sys.executable, str(probe), "90"], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "triton kernels compile" in done.stdout


def test_the_plan_counts_the_float32_staging_of_another_master_dtype():
    """The C kernel (CPU) and the Triton kernel (CUDA) draw float32; a 16-bit or float64
    master's source keeps a float32 staging piece beside its workspace, and the plan
    counts it (for CUDA, from this machine)."""
    from distzo.zo.noise import TABLE_BYTES, planned_noise_bytes

    for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.float32):
        source = NoiseSource(3, 5000, torch.device("cpu"), dtype)
        assert planned_noise_bytes(5000, dtype.itemsize, "cpu", "gaussian") == source.device_bytes
        staging = 0 if dtype == torch.float32 else (1 << 20) * 4
        planned = (1 << 20) * dtype.itemsize + staging + TABLE_BYTES
        assert planned_noise_bytes(1 << 20, dtype.itemsize, "cuda", "gaussian") == planned


def test_the_engines_log_line_says_the_noise_comes_from_torch_ops(monkeypatch, caplog):
    """An install without a C compiler skips the kernel (pip hides setuptools' warning)
    and the default job ran about 3x slower (400 steps: 16.1 s against 5.5 s) with not
    a word in its log; the engine's line now says so and how to get the kernel."""
    from tests.helpers.engines import engine_for
    from tests.helpers.models import tiny_opt

    monkeypatch.setattr(fast_noise, "available", lambda: False)
    with caplog.at_level("INFO", logger="distzo.engine.engine"):
        engine = engine_for(tiny_opt())
    assert engine.noise.backend == "torch"
    assert "noise from torch ops (the C kernel was not built: reinstall distzo" in caplog.text
    from distzo.engine.parts import noise_note

    monkeypatch.setattr(engine.noise, "_c", True)  # the kernel's engine says nothing more
    assert noise_note(engine) == ""


def test_only_the_draws_the_perturbation_and_bf16s_rounding_compile_with_fp_fusion():
    """The kernels that spell out each fma round like torch only unfused, and the
    perturbation like torch's CPU add(alpha=) only fused: the interpreter's probes round
    alike either way, and the compile probe checks the unfused ones alone, so a kernel
    moved to the other side passed both."""
    from distzo.zo import triton_noise

    fused = {
        name
        for name in triton_noise.KERNEL_NAMES
        if triton_noise.compile_options(name)["enable_fp_fusion"]
    }
    assert fused == {"fill", "perturb", "round_bf16"}
    assert triton_noise.compile_options("update")["enable_fp_fusion"] is False
