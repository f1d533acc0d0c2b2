"""LOZO's low-rank noise: its ranges, its factors' keys, its expectation, and the engine
running it on every layout the noise source serves."""

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.version import Version
from torch import nn

from distzo import ZOConfig, ZOEngine
from distzo.engine.build import check_model_lozo_rank
from distzo.offload.bucket import BucketLayout
from distzo.zo import NoiseSource
from distzo.zo.lowrank import LowRankNoise
from tests.helpers.engines import BATCHINGS, engine_for, replayed_config, train
from tests.helpers.models import adapted, random_batch, tiny_opt
from tests.unit.test_engine import FLOAT64_TINY, assert_same_trajectory, buckets_of, run

CPU = torch.device("cpu")


def layout_of(*shapes):
    """A bucket of tensors of ``shapes`` (matrices first, padding between entries)."""
    params = [((f"p{i}",), nn.Parameter(torch.zeros(shape))) for i, shape in enumerate(shapes)]
    return BucketLayout.build(params, empty_dtype=torch.float32)[0]


# a matrix, a 1-D tensor, a matrix of three dimensions (its first by the rest), a wide one
LAYOUT = layout_of((7, 13), (13,), (5, 3, 4), (2, 150), (1,))


def source(chunk, dtype=torch.float64, rank=2, interval=5, layouts=(LAYOUT, LAYOUT)):
    return LowRankNoise(3, chunk, CPU, dtype, list(layouts), rank, interval)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [1, 17, 150, 1 << 16])
def test_any_range_of_a_bucket_equals_that_range_of_the_whole(dtype, chunk):
    """Chunks, slices and updates read ranges that cut matrices mid-row: each is the
    slice of the whole bucket's z, whatever the workspace size."""
    whole = source(1 << 16, dtype).full(LAYOUT.numel, 6, 1, query=1)
    src = source(chunk, dtype)
    assert torch.equal(src.full(LAYOUT.numel, 6, 1, query=1), whole)
    rng = random.Random(chunk)
    cuts = [(0, 0), (1, 12), (12, 27), (90, 92), (130, 131)]
    cuts += [tuple(sorted(rng.sample(range(LAYOUT.numel + 1), 2))) for _ in range(40)]
    for start, stop in cuts:
        drawn = src.chunks(start, stop, LAYOUT.numel, 6, 1, 1)
        pieces = [(lo, hi, z.clone()) for lo, hi, z in drawn]
        if start == stop:
            assert not pieces
            continue
        assert pieces[0][0] == start and pieces[-1][1] == stop
        assert torch.equal(torch.cat([z for _, _, z in pieces]), whole[start:stop])
    # a padded slot's elements past the layout are 0
    slot = LAYOUT.numel + 64
    tail = torch.cat([z.clone() for _, _, z in src.chunks(slot - 70, slot, slot, 6, 1, 1)])
    assert torch.equal(tail[:6], whole[-6:]) and not tail[6:].any()


def test_the_torch_draws_equal_the_c_kernels(monkeypatch):
    fast = source(40).full(LAYOUT.numel, 2, 0)
    monkeypatch.setattr("distzo.zo.fast_noise.available", lambda: False)
    slow = source(40)
    assert slow.backend == "torch" and torch.equal(slow.full(LAYOUT.numel, 2, 0), fast)


def test_a_matrix_takes_u_v_transposed_and_a_vector_the_gaussian_z():
    src = source(1 << 16, rank=3)
    z = src.full(LAYOUT.numel, 4, 1)
    gaussian = NoiseSource(3, 1 << 16, CPU, torch.float64).full(LAYOUT.numel, 4, 1)
    covered = torch.zeros(LAYOUT.numel, dtype=torch.bool)
    for e in LAYOUT.entries:
        part = z[e.offset : e.offset + e.numel]
        covered[e.offset : e.offset + e.numel] = True
        if len(e.shape) >= 2:
            u, v = src.factors(4, 1, e.offset)
            assert u.shape == (e.shape[0], 3) and v.shape == (e.numel // e.shape[0], 3)
            torch.testing.assert_close(part.view(e.shape[0], -1), u @ v.T, rtol=1e-15, atol=0)
            assert torch.linalg.matrix_rank(part.view(e.shape[0], -1)) == min(3, *u.shape[:1])
        else:
            assert torch.equal(part, gaussian[e.offset : e.offset + e.numel])
    assert not z[~covered].any()  # padding
    with pytest.raises(ValueError, match="no matrix entry at offset 91"):
        src.factors(4, 1, 91)


def test_v_is_kept_for_an_interval_and_u_is_redrawn_every_step():
    src, offset = source(1 << 16, interval=5), LAYOUT.entries[0].offset
    factors = {step: src.factors(step, 1, offset) for step in range(12)}
    for step in range(12):
        u, v = factors[step]
        window = step - step % 5
        assert torch.equal(v, factors[window][1])  # V: its window's first step's
        assert step == 0 or not torch.equal(u, factors[step - 1][0])  # U: every step's own
        if step % 5 == 0 and step:
            assert not torch.equal(v, factors[step - 1][1])  # a new V at the boundary
    # seen in z alone: two steps of one window share the row space of V (rank 2, not 4)
    z = {step: src.full(LAYOUT.numel, step, 1)[: 7 * 13].view(7, 13) for step in (5, 9, 10)}
    assert torch.linalg.matrix_rank(torch.cat([z[5], z[9]])) == 2
    assert torch.linalg.matrix_rank(torch.cat([z[9], z[10]])) == 4


def test_queries_blocks_and_run_seeds_draw_their_own_factors():
    src, offset = source(1 << 16), LAYOUT.entries[0].offset
    u, v = src.factors(3, 1, offset)
    for other in (src.factors(3, 1, offset, query=1), src.factors(3, 0, offset)):
        assert not torch.equal(u, other[0]) and not torch.equal(v, other[1])
    seeded = LowRankNoise(4, 1 << 16, CPU, torch.float64, [LAYOUT, LAYOUT], 2, 5)
    assert not torch.equal(v, seeded.factors(3, 1, offset)[1])


def test_perturb_and_update_use_the_low_rank_z():
    src = source(33)
    theta = torch.randn(LAYOUT.numel, dtype=torch.float64)
    z = [src.full(LAYOUT.numel, 7, 1, query=q) for q in range(2)]
    out = torch.empty_like(theta)
    src.perturb_into(out, theta, -1e-3, 7, 1, query=1)
    torch.testing.assert_close(out, theta - 1e-3 * z[1], rtol=0, atol=1e-15)
    updated = theta.clone()
    src.apply_update(updated, LAYOUT.decay_end, 0.1, (2.0, -1.0), 0.01, 7, 1)
    expected = theta - 0.1 * (2.0 * z[0] - 1.0 * z[1]) / 2
    expected[: LAYOUT.decay_end] -= 0.1 * 0.01 * theta[: LAYOUT.decay_end]
    torch.testing.assert_close(updated, expected, rtol=1e-13, atol=1e-15)


def test_bad_sources_are_refused_in_one_line():
    with pytest.raises(ValueError, match="lozo_rank must be >= 1, got 0"):
        source(16, rank=0)
    with pytest.raises(ValueError, match="lozo_interval must be >= 1 step, got 0"):
        source(16, interval=0)
    with pytest.raises(ValueError, match="lowrank noise is distzo.zo.lowrank.LowRankNoise"):
        NoiseSource(3, 16, CPU, torch.float32, kind="lowrank")
    with pytest.raises(ValueError, match="block id 2 has no layout"):
        source(16).full(LAYOUT.numel, 0, 2)
    # an empty bucket (a LoRA run's resident modules) has nothing to draw; a padded one zeros
    empty = LowRankNoise(3, 16, CPU, torch.float32, [layout_of()], 2, 5)
    assert not empty.full(0, 0, 0).numel() and not empty.full(70, 0, 0).any()


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(noise="lowrank", lozo_rank=0), "lozo_rank must be >= 1, got 0"),
        (dict(noise="lowrank", lozo_interval=0), "lozo_interval must be >= 1 step, got 0"),
        (dict(lozo_rank=1), "lozo_rank 1 only applies to noise lowrank"),
        (
            dict(noise="rademacher", lozo_rank=4, lozo_interval=100),
            "lozo_rank 4 and lozo_interval 100 only apply to noise lowrank",
        ),
        (dict(noise="legacy", lozo_interval=10), "the run draws legacy; set noise lowrank"),
    ],
)
def test_lozo_options_it_cannot_honour_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        ZOConfig(device="cpu", **options)


def test_a_rank_above_a_trained_matrixs_smaller_side_is_refused_from_its_shapes():
    # U V^T of a 64 x 32 matrix has rank 32 at most, but its entries' variance is the rank:
    # rank 1000 on the tiny model diverged at step 15
    with torch.device("meta"):  # the shapes alone, no weights
        skeleton = tiny_opt()
    with pytest.raises(ValueError) as refused:
        check_model_lozo_rank(skeleton, ZOConfig(noise="lowrank", lozo_rank=33))
    assert str(refused.value) == (
        "lozo_rank 33 exceeds the smaller side of model.decoder.embed_tokens.weight (64 x 32): "
        "its U V^T has rank 32 at most, while the step grows with lozo_rank; "
        "set lozo_rank 32 or less"
    )
    check_model_lozo_rank(skeleton, ZOConfig(noise="lowrank", lozo_rank=32))
    check_model_lozo_rank(skeleton, ZOConfig(noise="gaussian"))  # no low-rank noise
    # an adapter's trained matrices are LoRA's A and B (r 4), and the engine refuses it too
    with pytest.raises(ValueError, match=r"lozo_rank 5 exceeds .*lora_A.default.weight \(4 x 32\)"):
        engine_for(adapted("opt"), noise="lowrank", lozo_rank=5)


def test_a_job_refuses_the_rank_before_it_builds_its_data(tmp_path, capsys, monkeypatch):
    from distzo.job import run_build
    from distzo.train import main

    def no_data(*args, **kwargs):
        raise AssertionError("the data was built before the refusal")

    monkeypatch.setattr(run_build, "build_task_data", no_data)
    argv = ["--estimator", "lozo", "--lozo-rank", "1000", "--output-dir", str(tmp_path / "run")]
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: --lozo-rank 1000 exceeds the smaller side of model.decoder.embed_tokens.weight "
        "(64 x 32): its U V^T has rank 32 at most, while the step grows with --lozo-rank; "
        "set --lozo-rank 32 or less"
    ]


# -- the estimate


def test_the_estimate_averages_to_r_times_the_gradient_on_matrices():
    """fp64: g of each query is the directional derivative along its z, and the mean of
    g z over many keys is r G on the matrices (E[Z <Z, G>] = r G for iid Gaussian U, V)
    and G on the 1-D tensors. Checked along G on each part, with the samples' own
    standard error: r = 2 and 1 lie many standard errors apart."""
    queries, rank = 1000, 2
    model = tiny_opt(seed=2, **FLOAT64_TINY)
    reference = tiny_opt(seed=2, **FLOAT64_TINY).eval()
    batch = random_batch(model.config.vocab_size, pad="right", seed=2)
    config = ZOConfig(
        eps=1e-5,
        lr=0.0,
        seed=2,
        device="cpu",
        noise_chunk=1 << 16,
        num_queries=queries,
        noise="lowrank",
        lozo_rank=rank,
    )
    engine = ZOEngine(model, config)
    grads = torch.tensor(engine.step(batch).projected_grads, dtype=torch.float64)
    reference(**batch).loss.backward()
    autograd = {name: p.grad for name, p in reference.named_parameters(remove_duplicate=False)}
    # each query's <z_M, G_M> and <z_v, G_v> (matrices, 1-D tensors); |G_M|^2 and |G_v|^2
    along = torch.zeros(queries, 2, dtype=torch.float64)
    norms = torch.zeros(2, dtype=torch.float64)
    for layout, block_id in buckets_of(engine):
        gradient, part = torch.zeros(layout.numel, dtype=torch.float64), torch.zeros(layout.numel)
        for entry in layout.entries:
            gradient[entry.offset : entry.offset + entry.numel] = autograd[entry.names[0]].flatten()
            part[entry.offset : entry.offset + entry.numel] = len(entry.shape) < 2
        masks = [gradient * (part == 0), gradient * (part == 1)]
        norms += torch.stack([m.square().sum() for m in masks])
        for q in range(queries):
            z = engine.noise.full(layout.numel, 0, block_id, q)
            along[q] += torch.stack([z @ m for m in masks])
    directional = along.sum(1)
    torch.testing.assert_close(grads, directional, rtol=1e-4, atol=1e-5)
    samples = grads[:, None] * along / norms  # mean -> (r, 1)
    mean, error = samples.mean(0), samples.std(0) / queries**0.5
    assert (error < 0.12 * torch.tensor([rank, 1.0])).all(), error
    assert (mean - torch.tensor([rank, 1.0])).abs().le(4 * error).all(), (mean, error)


# -- the engine on every layout


def test_offload_equals_resident_whatever_the_chunk_and_the_draws(monkeypatch):
    lowrank = dict(noise="lowrank", lozo_interval=3)
    resident = run("resident", steps=6, **lowrank)
    assert_same_trajectory(run("offload", steps=6, noise_chunk=333, **lowrank), resident)
    assert_same_trajectory(run("offload", steps=6, flush_at=(1, 3), **lowrank), resident)
    monkeypatch.setattr("distzo.zo.fast_noise.available", lambda: False)
    assert_same_trajectory(run("resident", steps=6, noise_chunk=4097, **lowrank), resident)
    # and it is another z than the Gaussian one, and another rank another z again
    for other in (run("resident", steps=6), run("resident", steps=6, lozo_rank=1, **lowrank)):
        with pytest.raises(AssertionError):
            assert_same_trajectory(other, resident)


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_momentum_and_adam_offload_equal_resident(optimizer):
    options = dict(noise="lowrank", lozo_interval=2, optimizer=optimizer, steps=5)
    assert_same_trajectory(run("offload", **options), run("resident", **options))


def test_a_low_bit_transfer_rounds_with_its_own_uniforms():
    """bf16 at rest: the rounding draws uniforms from its own source, whatever the
    perturbation's kind, so low-rank noise runs there too, reproducibly, near fp32's."""
    options = dict(noise="lowrank", lozo_interval=2, steps=4)
    bf16 = run("offload", transfer_dtype="bf16", **options)
    assert_same_trajectory(run("offload", transfer_dtype="bf16", **options), bf16)
    fp32 = run("offload", **options)
    for a, b in zip(bf16[0], fp32[0], strict=True):
        assert a.loss_plus == pytest.approx(b.loss_plus, rel=1e-2)
    engine = engine_for(tiny_opt(), noise="lowrank", mode="offload", transfer_dtype="bf16")
    assert engine.rounding_noise is not None and engine.rounding_noise.distribution == "uniform"


@pytest.mark.parametrize("method", ["lora", "lora-fa"])
def test_an_adapter_trains_with_low_rank_noise_offload_equal_resident(method):
    def adapter_run(mode, **flags):
        model = adapted("opt", method)
        engine = engine_for(model, mode=mode, noise="lowrank", lozo_interval=2, **flags)
        results = train(engine, model.config.vocab_size, steps=4)
        return results, engine.named_parameters()

    resident = adapter_run("resident")
    assert_same_trajectory(adapter_run("offload"), resident)
    # the adapter's matrices (LoRA's A and B) are perturbed by rank-2 z
    engine = engine_for(adapted("opt", method), noise="lowrank")
    layout = engine.block_layouts[0]
    z = engine.noise.full(layout.numel, 0, 1)
    for e in layout.entries:
        assert len(e.shape) == 2
        matrix = z[e.offset : e.offset + e.numel].view(e.shape)
        assert torch.linalg.matrix_rank(matrix) == min(2, *e.shape)


@pytest.mark.parametrize("batching", ["dual", "both"])
def test_batched_passes_equal_the_sequential_passes(batching):
    """P-RGE's batched forward: each pass's adapter perturbed by its own low-rank z (fp64)."""
    runs = []
    for flags in ({}, BATCHINGS[batching]):
        model = adapted("opt", "lora", dtype=torch.float64)
        engine = engine_for(model, mode="offload", noise="lowrank", num_queries=2, **flags)
        assert (engine.pass_scratch is not None) == bool(flags)
        runs.append((train(engine, model.config.vocab_size, steps=3), engine.named_parameters()))
    (sequential, params_a), (batched, params_b) = runs
    for a, b in zip(sequential, batched, strict=True):
        assert a.projected_grads == pytest.approx(b.projected_grads, rel=1e-8, abs=1e-8)
    for name in params_a:
        torch.testing.assert_close(params_a[name], params_b[name], rtol=1e-8, atol=1e-8)


def test_a_state_dict_resumes_onto_the_uninterrupted_trajectory_across_a_window():
    """fp64, V's window 3: cut at step 4, mid-window, resumed through steps 5 and 6
    (a new V) onto the uninterrupted run's weights, bit for bit."""
    options = dict(noise="lowrank", lozo_interval=3, weight_decay=0.1)

    def engine():
        model = tiny_opt(seed=0, dtype=torch.float64, num_hidden_layers=2)
        return ZOEngine(model, ZOConfig(seed=11, device="cpu", lr=1e-3, **options)), model

    batches = [random_batch(64, pad="left", seed=i) for i in range(8)]
    uninterrupted, _ = engine()
    expected = [uninterrupted.step(b).projected_grads for b in batches]
    first, _ = engine()
    for b in batches[:4]:
        first.step(b)
    saved = first.state_dict()
    assert saved["lowrank"] == {"rank": 2, "interval": 3}
    resumed, _ = engine()
    resumed.load_state_dict(saved)
    assert [resumed.step(b).projected_grads for b in batches[4:]] == expected[4:]
    ours, theirs = resumed.named_parameters(), uninterrupted.named_parameters()
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    # a state drawn with another rank or interval is refused
    other = ZOEngine(
        tiny_opt(seed=0, dtype=torch.float64, num_hidden_layers=2),
        ZOConfig(seed=11, device="cpu", noise="lowrank", lozo_interval=4),
    )
    with pytest.raises(ValueError, match="lowrank noise of rank 2, interval 3, the engine draws"):
        other.load_state_dict(saved)


def test_the_memory_plan_counts_what_the_low_rank_source_allocates():
    from distzo.job.memory_plan import plan_memory

    for chunk in (1000, 1 << 22):
        config = ZOConfig(device="cpu", mode="offload", noise="lowrank", noise_chunk=chunk)
        gaussian = ZOConfig(device="cpu", mode="offload", noise_chunk=chunk)
        model = tiny_opt(seed=0, num_hidden_layers=2)
        engine = ZOEngine(model, config)
        planned = plan_memory(model, config, 1, False, batch=2, seq=8)
        plain = plan_memory(model, gaussian, 1, False, batch=2, seq=8)
        extra = engine.noise.device_bytes - NoiseSource(0, chunk, CPU, torch.float32).device_bytes
        assert extra > 0 and planned.device_scratch - plain.device_scratch == extra


def test_a_replay_draws_the_runs_low_rank_noise_rank_and_interval():
    config = ZOConfig(noise="lowrank", lozo_rank=3, lozo_interval=7)
    again = replayed_config(config)
    assert (again.noise, again.lozo_rank, again.lozo_interval) == ("lowrank", 3, 7)


def test_the_low_rank_kernels_interpreted_equal_the_generic_path():
    """The CUDA kernels of the perturbation and the update (``triton_lowrank``), run by
    Triton's interpreter on the CPU: bit for bit the generic path's results over ranks,
    dtypes, runs of rows, 1-D entries and padding, and offsets past 2^31 (the probe)."""
    from tests.unit.test_noise import FUSED_FMA_INTERPRETER

    triton = pytest.importorskip("triton")
    if Version(triton.__version__) < FUSED_FMA_INTERPRETER:
        pytest.skip(f"Triton {triton.__version__}'s interpreter rounds tl.fma twice (3.9's once)")
    env = os.environ | {"TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.helpers.triton_lowrank_probe"],
        cwd=Path(__file__).parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "low-rank kernels == generic path" in done.stdout


def test_the_low_rank_source_fuses_only_on_cuda_with_triton():
    """On the CPU (or without Triton) the perturbation and the update keep the generic
    path, and the kernels gated by ``fuses`` (moments, rebuilt masters) are never LOZO's."""
    src = source(150, dtype=torch.float32)
    assert not src.fuses_master(torch.zeros(4)) and not src.fuses(torch.zeros(4))


def test_the_fused_dispatch_sends_what_no_kernel_takes_to_the_generic_path(monkeypatch):
    """A source that fuses (forced on the CPU; the kernels made to raise): a zero
    perturbation, an update of no terms (the decay alone, matrices too) and an out the
    kernel cannot write (strided, float64) never reach a kernel and give the generic bits."""
    from distzo.zo import triton_lowrank, triton_noise

    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    for module, name in ((triton_lowrank, "perturb"), (triton_lowrank, "update")):
        monkeypatch.setattr(module, name, no_kernel)
    monkeypatch.setattr(triton_noise, "update", no_kernel)
    fused, generic = source(150, torch.float32), source(150, torch.float32)
    fused._triton = True
    theta = torch.randn(LAYOUT.numel, generator=torch.Generator().manual_seed(1))
    assert fused.fuses_master(theta, torch.empty(0, dtype=torch.bfloat16))
    assert not fused.fuses_master(theta, torch.empty(0, dtype=torch.float64))
    assert not fused.fuses_master(theta, torch.empty(2 * LAYOUT.numel)[::2])
    out = torch.full_like(theta, float("nan"))
    fused.perturb_into(out, theta, 0.0, 7, 0)
    assert torch.equal(out, theta)
    decayed, expected = theta.clone(), theta.clone()
    fused.apply_terms(decayed, 200, 0.5, [], 0)
    generic.apply_terms(expected, 200, 0.5, [], 0)
    assert torch.equal(decayed, expected) and torch.equal(decayed[:200], theta[:200] * 0.5)
