"""GPU behaviour: run with `python -m pytest -m cuda` on a CUDA machine (skipped without one)."""

import gc

import pytest
import torch

from distzo import ZOConfig, ZOEngine
from distzo.offload import Timeline
from tests.helpers.models import random_batch, tiny_opt

pytestmark = pytest.mark.cuda


def trajectory(mode, steps=10):
    model = tiny_opt(seed=0, num_hidden_layers=4, word_embed_proj_dim=16)
    engine = ZOEngine(
        model, ZOConfig(mode=mode, device="cuda", lr=1e-3, eps=1e-3, weight_decay=0.1, seed=3)
    )
    results = [engine.step(random_batch(64, pad="left", seed=i)) for i in range(steps)]
    return [
        (r.loss_plus, r.loss_minus, r.projected_grad) for r in results
    ], engine.named_parameters()


def test_offload_equals_resident_on_gpu():
    offload_results, offload_params = trajectory("offload")
    resident_results, resident_params = trajectory("resident")
    assert offload_results == resident_results
    for name, value in resident_params.items():
        assert torch.equal(offload_params[name], value), name  # both are host copies


def test_host_buckets_are_pinned_and_masters_live_on_the_host():
    engine = ZOEngine(tiny_opt(), ZOConfig(mode="offload", device="cuda", seed=0))
    assert engine.store.host_pinned and engine.store.host_storage.is_pinned()
    assert engine.store.master(0).device.type == "cpu"
    assert engine.block_scratch.device.type == "cuda"


def test_steady_state_step_allocates_no_new_device_memory():
    model = tiny_opt(
        seed=0, num_hidden_layers=4, hidden_size=128, ffn_dim=512, word_embed_proj_dim=128
    )
    engine = ZOEngine(model, ZOConfig(mode="offload", device="cuda", num_slots=2, seed=0))
    batch = random_batch(64, batch=8, seq=32, seed=0)
    for _ in range(2):  # the first step warms the caching allocator
        engine.step(batch)
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    reserved, segments = torch.cuda.memory_reserved(), stats["segment.all.allocated"]
    allocated = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(5):
        engine.step(batch)
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() == reserved
    assert torch.cuda.memory_stats()["segment.all.allocated"] == segments  # no new cudaMalloc
    assert torch.cuda.memory_allocated() == allocated  # nothing accumulates across steps


def test_upload_of_the_next_block_overlaps_the_current_compute():
    # Compute-heavy blocks (a long batch) so each compute outlasts the next block's upload.
    model = tiny_opt(
        seed=0,
        num_hidden_layers=6,
        hidden_size=512,
        ffn_dim=2048,
        num_attention_heads=8,
        word_embed_proj_dim=512,
        max_position_embeddings=512,
    )
    engine = ZOEngine(model, ZOConfig(mode="offload", device="cuda", num_slots=3, seed=0))
    batch = random_batch(64, batch=16, seq=512, seed=0)
    engine.step(batch)  # warm-up
    engine.scheduler.timeline = Timeline(engine.streams)
    engine.step(batch)
    spans = {(s.phase, s.block): s for s in engine.scheduler.timeline.spans()}
    overlapped = [
        i for i in range(5) if spans[("upload", i + 1)].start_ms < spans[("compute", i)].end_ms
    ]
    assert overlapped, sorted(spans.values(), key=lambda s: s.start_ms)
    # the host's time queueing each phase, beside the device's span of it
    assert all(s.host_ms > 0 for s in spans.values())
    # and the ordering rules held on the device timeline
    for i in range(6):
        assert spans[("upload", i)].end_ms <= spans[("compute", i)].start_ms + 1e-3
        assert spans[("compute", i)].end_ms <= spans[("offload", i)].start_ms + 1e-3


def test_a_profiled_step_names_the_engines_streams_and_their_kernels(tmp_path):
    """The markers name the three streams: the blocks' copies to the device on upload, the
    forwards' matrix products on compute, the copies back on offload; the upload of the
    next block runs beside the compute; the trace is kept."""
    from distzo.bench.kernel_profile import profile_step

    model = tiny_opt(seed=0, num_hidden_layers=4, hidden_size=256, ffn_dim=1024)
    engine = ZOEngine(model, ZOConfig(mode="offload", device="cuda", num_slots=3, seed=0))
    batch = random_batch(64, batch=8, seq=256, seed=0)
    engine.step(batch)  # warm-up
    record = profile_step(engine, batch, tmp_path / "trace.json")
    assert {"upload", "compute", "offload"} <= set(record["streams"]), record["streams"]
    on = {}
    for row in record["kernels"]:
        on.setdefault(row["stream"], []).append(row["name"])
    assert any("HtoD" in name for name in on["upload"]), on["upload"]
    assert any("DtoH" in name for name in on["offload"]), on["offload"]
    assert any("gemm" in name.lower() for name in on["compute"]), on["compute"]
    assert record["streams"]["compute"]["beside_ms"] > 0
    assert (tmp_path / "trace.json").stat().st_size > 0


def test_single_rank_nccl_launch_runs(tmp_path):
    from tests.helpers.launch import Run, torchrun

    proc = torchrun(
        1,
        [
            "--max-steps",
            "20",
            "--device",
            "cuda",
            "--backend",
            "nccl",
            "--output-dir",
            str(tmp_path),
        ],
        preload=False,  # a CUDA launch: ranks in fresh interpreters, as users launch them
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = Run(tmp_path)
    assert run.ranks[0]["eval_after"]["eval_loss"] < run.ranks[0]["eval_before"]["eval_loss"]


def test_sliced_transfer_with_two_ranks_sharing_one_gpu(tmp_path):
    # NCCL refuses two ranks on one GPU; gloo moves CUDA tensors (through the host).
    from tests.helpers.launch import Run, torchrun

    runs = {}
    for transfer in ("naive", "sliced"):
        out = tmp_path / transfer
        proc = torchrun(
            2,
            [
                "--max-steps",
                "10",
                "--device",
                "cuda:0",
                "--backend",
                "gloo",
                "--pert",
                "2",
                "--transfer",
                transfer,
                "--output-dir",
                str(out),
            ],
            preload=False,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[transfer] = Run(out)
    assert runs["sliced"].grads == runs["naive"].grads
    assert runs["sliced"].ranks[0]["host_bytes"] < 0.55 * runs["naive"].ranks[0]["host_bytes"]


def test_low_bit_transfer_with_amp_compute_on_gpu():
    model = tiny_opt(seed=0, num_hidden_layers=4)
    engine = ZOEngine(
        model,
        ZOConfig(
            mode="offload",
            device="cuda",
            transfer_dtype="bf16",
            compute_dtype="bf16",
            eps=1e-2,
            seed=0,
        ),
    )
    assert (
        engine.store.host_storage.dtype == torch.bfloat16 and engine.store.host_storage.is_pinned()
    )
    results = [engine.step(random_batch(64, seed=i)) for i in range(5)]
    assert all(torch.isfinite(torch.tensor(r.loss)) for r in results)


@pytest.mark.parametrize("wire", ["bf16", "fp16", "fp8"])
def test_recomputed_block_masters_follow_the_buffered_ones_on_gpu(wire):
    """Masters rebuilt per pass, bit for bit the buffered steps: bf16 and fp16 through the
    fused rebuild_perturb and rebuild_round kernels, fp8 through the update, perturbation
    and rounding kernels a chunk at a time (chunks of 1,000: pieces start off every tile);
    evaluations (unperturbed passes) through the pieces for all three. And masters in two
    buffers, each block upcast on the upload stream and rounded on the offload stream
    while another computes: the same bits, so no stream read a buffer another was still
    writing."""
    runs = {}
    for master in ("buffer", "recompute", "double"):
        model = tiny_opt(seed=0, num_hidden_layers=4)
        config = ZOConfig(
            device="cuda",
            transfer_dtype=wire,
            low_bit_master=master,
            weight_decay=0.1,
            noise_chunk=1000,
            eps=1e-2,
            lr=1e-3,
            seed=0,
        )
        engine = ZOEngine(model, config)
        losses = [engine.step(random_batch(64, seed=i)).loss for i in range(4)]
        losses.append(engine.forward(random_batch(64, seed=9))[1].item())
        losses.append(engine.step(random_batch(64, seed=10)).loss)
        engine.flush()
        runs[master] = (losses, engine.store.host_storage.view(torch.uint8).clone())
    for master in ("recompute", "double"):
        assert runs[master][0] == runs["buffer"][0], master
        assert torch.equal(runs[master][1], runs["buffer"][1]), master


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_model_held_in_16_bits_steps_alike_fused_or_chunked_on_gpu(dtype, monkeypatch):
    """A model held in fp16 or bf16 (ZO2's precision, the peers' distzo-offload-half):
    its perturbations and updates in one kernel each take the chunked path's steps bit for
    bit (the draws' staging, then torch's ops under the same rounding rule), resident
    bucket and blocks, with weight decay and two queries (the tiled update) or one."""
    from distzo.zo import NoiseSource

    runs = {}
    for path in ("fused", "chunked"):
        if path == "chunked":
            # the 16-bit kernels off (a float32 tensor, if any, keeps its kernels)
            monkeypatch.setattr(
                NoiseSource, "fuses_master", lambda self, theta, out=None: self.fuses(theta)
            )
        for queries in (1, 2):
            model = tiny_opt(seed=0, dtype=dtype, num_hidden_layers=4)
            config = ZOConfig(
                device="cuda",
                transfer_dtype="fp32",  # no conversion: blocks travel in their dtype
                compute_dtype="fp16" if dtype == torch.float16 else "bf16",
                weight_decay=0.1,
                num_queries=queries,
                noise_chunk=1000,
                eps=1e-2,
                lr=1e-3,
                seed=0,
            )
            engine = ZOEngine(model, config)
            losses = [engine.step(random_batch(64, seed=i)).loss for i in range(4)]
            engine.flush()
            weights = {k: v.view(torch.int16).clone() for k, v in engine.named_parameters().items()}
            runs[path, queries] = (losses, weights)
    for queries in (1, 2):
        fused, chunked = runs["fused", queries], runs["chunked", queries]
        assert fused[0] == chunked[0], queries
        for name, value in fused[1].items():
            assert torch.equal(value, chunked[1][name]), (queries, name)


def test_memory_plan_matches_what_cuda_allocates():
    from distzo.job.memory_plan import plan_memory
    from distzo.models.shapes import shape_config
    from distzo.models.weights import RandomWeights, skeleton

    rebuilt = dict(transfer_dtype="bf16", compute_dtype="bf16", low_bit_master="recompute")
    for config in (
        ZOConfig(device="cuda", seed=0),
        ZOConfig(device="cuda", seed=0, transfer_dtype="bf16", compute_dtype="bf16"),
        ZOConfig(device="cuda", seed=0, **rebuilt),
        ZOConfig(device="cuda", seed=0, **(rebuilt | {"low_bit_master": "double"})),
        ZOConfig(device="cuda", seed=0, optimizer="adam", state_dtype="bf16"),
        ZOConfig(device="cuda", seed=0, perturb_scope="module", **rebuilt),
    ):
        model = skeleton(shape_config("opt-1.3b", layers=2), torch.float32)
        plan = plan_memory(model, config, 1, False, batch=1, seq=8)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        engine = ZOEngine(model, config, weights=RandomWeights(0))
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated() - before
        assert abs(allocated - plan.device_bytes) <= 0.1 * plan.device_bytes, (
            allocated,
            plan.device_bytes,
        )
        del engine, model


MODULE_LAYOUTS = {
    "fp32": ({}, torch.float32),
    "bf16-link": ({"transfer_dtype": "bf16", "compute_dtype": "bf16"}, torch.float32),
    "fp16-recompute": (
        {"transfer_dtype": "fp16", "compute_dtype": "fp16", "low_bit_master": "recompute"},
        torch.float32,
    ),
    "fp16-model": ({"compute_dtype": "fp16"}, torch.float16),
    "resident-q2": ({"mode": "resident", "num_queries": 2}, torch.float32),
}


@pytest.mark.parametrize("layout", list(MODULE_LAYOUTS))
def test_a_block_perturbed_module_by_module_steps_alike_on_gpu(layout):
    """``perturb_scope="module"`` on CUDA: each module's runs through the fused kernels
    (their offsets into the block), the hooks queued on the compute stream, take the whole
    block's steps bit for bit; and the steady-state step still reads the device once."""
    options, dtype = MODULE_LAYOUTS[layout]
    runs = {}
    for scope in ("block", "module"):
        model = tiny_opt(seed=0, dtype=dtype, num_hidden_layers=4)
        config = ZOConfig(
            device="cuda",
            weight_decay=0.1,
            eps=1e-2,
            lr=1e-3,
            seed=0,
            perturb_scope=scope,
            **options,
        )
        engine = ZOEngine(model, config)
        losses = [engine.step(random_batch(64, seed=i)).loss for i in range(4)]
        if scope == "module":
            engine._finish_step(*queued_without_a_sync(engine, random_batch(64, seed=4)))
        else:
            engine.step(random_batch(64, seed=4))
        engine.flush()
        runs[scope] = (losses, engine.named_parameters(), engine.block_scratch.numel())
    assert runs["module"][0] == runs["block"][0]
    for name, value in runs["block"][1].items():
        assert torch.equal(runs["module"][1][name].view(torch.uint8), value.view(torch.uint8)), name
    assert runs["module"][2] < runs["block"][2] / 2


@pytest.mark.parametrize("name", ["opt", "llama-bias"])
def test_a_vocabulary_read_in_slices_steps_alike_on_gpu(name):
    """The resident sides in the module scratch, their vocabulary in slices, on CUDA: the
    embedding's rows are copies and a slice's logits the whole head's dot products, so the
    steps are the block scope's (bit for bit on CPU; here to the GEMM's rounding, which a
    cuBLAS kernel chosen for a slice's shape may sum in another order)."""
    from tests.unit.test_vocab_slices import VOCAB, batches, model_of

    runs = {}
    for scope in ("block", "module"):
        model = model_of(name)
        config = ZOConfig(device="cuda", eps=1e-2, lr=1e-2, seed=0, perturb_scope=scope)
        engine = ZOEngine(model, config)
        losses = [engine.step(batch).loss for batch in batches()]
        last = batches()[1]
        if scope == "module":  # the slices' lookups and logits queue without a host wait
            losses.append(engine._finish_step(*queued_without_a_sync(engine, last)).loss)
        else:
            losses.append(engine.step(last).loss)
        logits, _ = engine.forward(random_batch(VOCAB, seed=9))
        engine.flush()
        runs[scope] = (losses, logits.cpu(), engine.named_parameters(), engine.resident)
    assert runs["module"][3].num_slices > 2
    assert runs["module"][0] == pytest.approx(runs["block"][0], rel=1e-5)
    torch.testing.assert_close(runs["module"][1], runs["block"][1], rtol=1e-5, atol=1e-5)
    for key, value in runs["block"][2].items():
        torch.testing.assert_close(runs["module"][2][key], value, rtol=1e-4, atol=1e-6)


def resident_bytes() -> int:
    """This process's resident memory (VmRSS). Pinned pages are resident by definition;
    VmLck and VmPin stay 0 for CUDA-pinned memory on the lent H100 (driver 580, measured
    2026-11-23), so the resident rise of a fresh allocation is what shows its pinned size."""
    from distzo.runtime.host_memory import rss_bytes

    rss = rss_bytes()
    assert rss is not None, "no VmRSS in /proc/self/status"
    return rss


def queued_without_a_sync(engine, batch):
    """A step queued under the sync debug mode "error": any host wait before its one read raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return engine._queue_step(batch, None)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_steady_state_step_never_waits_for_the_device_before_its_one_read():
    # Padded rows (the model's mask builder would read the padding mask on the device),
    # a pending update (every block offloaded) and the classification objective (index
    # tensors): everything up to the loss read is queued without a host sync.
    from distzo.objectives import ChoiceEncoding, Classification, collate_choices

    model = tiny_opt(seed=0, num_hidden_layers=4)
    for objective, batch in (
        (None, random_batch(64, batch=4, seq=16, pad="right", seed=0)),
        (
            Classification(),
            collate_choices(
                [
                    ChoiceEncoding(((5, 6, 7, 8), (5, 6, 9)), ((0, 2, 8, 0), (1, 1, 9, 1)), 1),
                    ChoiceEncoding(((5, 7),), ((0, 1, 3, 0), (0, 1, 4, 1)), 0),
                ],
                pad_id=0,
            ),
        ),
    ):
        engine = ZOEngine(
            model, ZOConfig(mode="offload", device="cuda", seed=0), objective=objective
        )
        for _ in range(2):  # warm-up: allocator, first uploads, a pending update
            engine.step(batch)
        # the one host sync: the losses
        result = engine._finish_step(*queued_without_a_sync(engine, batch))
        assert torch.isfinite(torch.tensor([result.loss_plus, result.loss_minus])).all()


def test_host_blocks_are_pinned_at_exactly_the_planned_size():
    from distzo.engine import bucket_layouts
    from distzo.job.memory_plan import plan_memory
    from distzo.models import family_for
    from distzo.models.shapes import shape_config
    from distzo.models.weights import skeleton
    from distzo.offload import StreamedBlocks

    # 4 OPT-1.3B layers: 805.7 MB, which the caching host allocator would round to 1073.7 MB (2^30)
    model = skeleton(shape_config("opt-1.3b", layers=4), torch.float32)
    plan = plan_memory(model, ZOConfig(device="cuda", seed=0), 1, False, batch=1, seq=8)
    layouts = [layout for layout, _ in bucket_layouts(model, family_for(model).blocks())[0]]
    torch.cuda.synchronize()
    gc.collect()
    before = resident_bytes()
    store = StreamedBlocks(layouts, torch.device("cuda"), 1)
    grown = resident_bytes() - before
    assert store.host_storage.is_pinned() and store.host_bytes == plan.host_bytes
    assert abs(grown - plan.host_bytes) <= 0.02 * plan.host_bytes, (grown, plan.host_bytes)
    host = store.host_storage
    # an asynchronous copy from it works
    store.slots.buffers[0][:4].copy_(host[:4], non_blocking=True)
    torch.cuda.synchronize()


@pytest.mark.parametrize(
    "kind,distribution", [("gaussian", "normal"), ("rademacher", "normal"), ("gaussian", "uniform")]
)
def test_cuda_noise_equals_cpu_noise_bit_for_bit(kind, distribution):
    """The portable noise: the Triton kernels on the GPU draw exactly the CPU's z."""
    from distzo.zo import NoiseSource

    gpu = NoiseSource(11, 1 << 20, torch.device("cuda"), torch.float32, distribution, kind=kind)
    cpu = NoiseSource(11, 1 << 20, torch.device("cpu"), torch.float32, distribution, kind=kind)
    assert gpu.backend == "triton"
    for n, step, block in [(1, 0, 0), (4097, 3, 2), (3_000_001, 123456, 77)]:
        on_gpu, on_cpu = gpu.full(n, step, block), cpu.full(n, step, block)
        assert torch.equal(on_gpu.cpu().view(torch.int32), on_cpu.view(torch.int32)), n


def test_a_16_bit_master_draws_through_the_kernel_on_cuda():
    """A master of another dtype draws z with the Triton kernel into float32 staging (not
    torch's lanes, element by element): the CPU's draws in its dtype, and a resident side's
    run at an offset takes the z of its places. A model held in fp16 or bf16 perturbs and
    updates in one kernel each, bit for bit the CPU path (each op rounded to its dtype)."""
    from distzo.zo import NoiseSource

    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        gpu = NoiseSource(11, 1 << 20, torch.device("cuda"), dtype)
        cpu = NoiseSource(11, 1 << 20, torch.device("cpu"), dtype)
        assert gpu.backend == "triton" and gpu.device_bytes > (1 << 20) * (dtype.itemsize + 4)
        on_gpu, on_cpu = gpu.full(3_000_001, 5, 7), cpu.full(3_000_001, 5, 7)
        assert torch.equal(on_gpu.cpu(), on_cpu), dtype
        theta = torch.randn(1000, dtype=dtype, generator=torch.Generator().manual_seed(0))
        out_gpu, out_cpu = torch.empty_like(theta, device="cuda"), torch.empty_like(theta)
        gpu.perturb_into(out_gpu, theta.cuda(), 1e-2, 5, 7, start=2_999_000, total=3_000_001)
        cpu.perturb_into(out_cpu, theta, 1e-2, 5, 7, start=2_999_000, total=3_000_001)
        if dtype == torch.float64:
            torch.testing.assert_close(out_gpu.cpu(), out_cpu)
            continue
        assert gpu.fuses_master(theta.cuda(), out_gpu)
        assert torch.equal(out_gpu.cpu().view(torch.int16), out_cpu.view(torch.int16)), dtype
        held = torch.randn(1_000_003, generator=torch.Generator().manual_seed(1)).to(dtype)
        for grads in ((0.7,), (0.5, -1.5)):  # update_one; the tiled kernel
            updated_gpu, updated_cpu = held.cuda(), held.clone()
            gpu.apply_update(updated_gpu, 500_000, 1e-2, grads, 0.1, 4, 9)
            cpu.apply_update(updated_cpu, 500_000, 1e-2, grads, 0.1, 4, 9)
            assert torch.equal(
                updated_gpu.cpu().view(torch.int16), updated_cpu.view(torch.int16)
            ), (dtype, grads)


def test_cuda_fused_noise_ops_follow_the_cpu_ops():
    """perturb and update in one kernel each: the same z; perturb within an ulp of the CPU's
    arithmetic, the update (two queries: the tiled kernel; one: update_one) and
    bf16/fp16/fp8 stochastic rounding bit for bit."""
    from distzo.offload.low_bit import round_keyed_
    from distzo.zo import NoiseSource

    gpu = NoiseSource(11, 1 << 20, torch.device("cuda"), torch.float32)
    cpu = NoiseSource(11, 1 << 20, torch.device("cpu"), torch.float32)
    theta = torch.randn(1_000_003, generator=torch.Generator().manual_seed(0))
    out_gpu, out_cpu = torch.empty_like(theta, device="cuda"), torch.empty_like(theta)
    gpu.perturb_into(out_gpu, theta.cuda(), 1e-3, 4, 9)
    cpu.perturb_into(out_cpu, theta, 1e-3, 4, 9)
    ulps = (out_gpu.cpu().view(torch.int32).long() - out_cpu.view(torch.int32).long()).abs().max()
    assert int(ulps) <= 1
    updated_gpu, updated_cpu = theta.cuda(), theta.clone()
    gpu.apply_update(updated_gpu, 500_000, 1e-2, (0.5, -1.5), 0.1, 4, 9)
    cpu.apply_update(updated_cpu, 500_000, 1e-2, (0.5, -1.5), 0.1, 4, 9)
    # both queries in one kernel, each a fused multiply-add as torch's add_(z, alpha=a)
    assert torch.equal(updated_gpu.cpu().view(torch.int32), updated_cpu.view(torch.int32))
    updated_gpu, updated_cpu = theta.cuda(), theta.clone()  # ZO-SGD's one term: update_one
    gpu.apply_update(updated_gpu, 500_000, 1e-2, (0.7,), 0.1, 5, 9)
    cpu.apply_update(updated_cpu, 500_000, 1e-2, (0.7,), 0.1, 5, 9)
    assert torch.equal(updated_gpu.cpu().view(torch.int32), updated_cpu.view(torch.int32))
    rounding_gpu = NoiseSource(11, 1 << 20, torch.device("cuda"), torch.float32, "uniform")
    rounding_cpu = NoiseSource(11, 1 << 20, torch.device("cpu"), torch.float32, "uniform")
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):  # one kernel each
        values = theta * (300.0 if dtype == torch.float8_e4m3fn else 1.0)  # into saturation
        wire_gpu = torch.empty(theta.numel(), dtype=dtype, device="cuda")
        wire_cpu = torch.empty(theta.numel(), dtype=dtype)
        round_keyed_(wire_gpu, values.cuda(), rounding_gpu, 100, theta.numel() + 100, 4, 1 << 40)
        round_keyed_(wire_cpu, values, rounding_cpu, 100, theta.numel() + 100, 4, 1 << 40)
        as_int = torch.int8 if dtype == torch.float8_e4m3fn else torch.int16
        assert torch.equal(wire_gpu.cpu().view(as_int), wire_cpu.view(as_int)), dtype


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
@pytest.mark.parametrize("grads", [(0.5, -1.5, 2.0), (0.7,)])
def test_cuda_fused_moment_kernels_follow_the_cpu_noise_ops(optimizer, grads, monkeypatch):
    """Stored momentum and Adam in one kernel per bucket: the CPU's MomentUpdater bit for
    bit (Adam's square root correctly rounded on the CPU too, as CUDA's is), 3 queries
    (the tiled kernels) and 1 (momentum's lane-by-lane kernel)."""
    import numpy as np

    from distzo.zo import NoiseSource
    from distzo.zo.moments import MomentRule, MomentUpdater

    rule = MomentRule(optimizer, 0.9)
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(1_000_003, generator=g)
    moments = [torch.randn(theta.numel(), generator=g) * 1e-2, torch.rand(theta.numel()) * 1e-4]
    state_cpu = [t.clone() for t in (theta, *moments[: rule.num_moments])]
    state_gpu = [t.cuda() for t in state_cpu]

    def correctly_rounded(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(torch.from_numpy(np.sqrt(x.numpy())))  # the CPU's (MKL's) is not

    monkeypatch.setattr(torch, "sqrt", correctly_rounded)
    for state, device in ((state_cpu, "cpu"), (state_gpu, "cuda")):
        noise = NoiseSource(11, 1 << 18, torch.device(device), torch.float32)
        assert device == "cpu" or noise.backend == "triton"
        for step in (4, 5):
            MomentUpdater(rule, noise).apply(
                noise, state[0], state[1:], 500_000, 1e-2, 0.1, step, grads, 9
            )
    for on_gpu, on_cpu in zip(state_gpu, state_cpu):
        assert torch.equal(on_gpu.cpu().view(torch.int32), on_cpu.view(torch.int32))


@pytest.mark.parametrize("method", ["lora-fa", "prefix"])
def test_adapters_micro_batches_and_momentum_follow_the_cpu_and_never_sync_early(method):
    # The read-only streamed base, batched passes, a prefix's one-layer caches, micro-batches
    # and the momentum's multi-step update on CUDA: the CPU's trajectory (fp32, 1e-4), and a
    # steady-state step queued without a host sync.
    from distzo.adapters.peft_adapters import AdapterSpec, attach_adapter

    def build(device):
        model = attach_adapter(
            tiny_opt(seed=0, num_hidden_layers=3), AdapterSpec(method, r=4, alpha=8), seed=5
        )
        return ZOEngine(
            model,
            ZOConfig(
                mode="offload",
                device=device,
                lr=1e-3,
                eps=1e-2,
                seed=3,
                num_queries=2,
                dual_forward=True,
                grad_accum=2,
                optimizer="momentum",
                momentum_window=4,
            ),
        )

    follows_the_cpu_and_never_syncs_early(build, steps=4)


def follows_the_cpu_and_never_syncs_early(build, steps):
    """``build(device)``'s engine on CUDA takes the CPU's trajectory (fp32: g to 1e-3, weights
    to 1e-4) and queues a steady-state step without a host sync; returns the CUDA engine."""

    def run(device):
        engine = build(device)
        results = [engine.step(random_batch(64, pad="left", seed=i)) for i in range(steps)]
        return engine, [r.projected_grads for r in results], engine.named_parameters()

    gpu, gpu_grads, gpu_params = run("cuda")
    _, cpu_grads, cpu_params = run("cpu")
    for a, b in zip(gpu_grads, cpu_grads):
        assert a == pytest.approx(b, rel=1e-3, abs=1e-4)
    for name, value in cpu_params.items():
        assert torch.allclose(gpu_params[name], value, rtol=1e-4, atol=1e-5), name
    batch = random_batch(64, pad="right", seed=9)
    gpu.step(batch)
    gpu._finish_step(*queued_without_a_sync(gpu, batch))
    return gpu


def test_double_buffered_masters_race_with_nothing_on_gpu():
    """Blocks wide enough for an upcast and a rounding to overlap another block's compute
    (6 layers of width 1024: 12.6 M elements a block), fp16 on the wire, Adam with bf16
    moments, an evaluation between steps: the double-buffered masters' losses and bits at
    rest are the one buffer's, weights and moments alike, so no buffer was rewritten while
    a pass or a pack still read it."""
    runs = {}
    for master in ("buffer", "double"):
        model = tiny_opt(
            seed=0, num_hidden_layers=6, hidden_size=1024, ffn_dim=4096, word_embed_proj_dim=1024
        )
        config = ZOConfig(
            device="cuda",
            transfer_dtype="fp16",
            compute_dtype="fp16",
            low_bit_master=master,
            optimizer="adam",
            state_dtype="bf16",
            lr=1e-4,
            eps=1e-3,
            seed=0,
        )
        engine = ZOEngine(model, config)
        losses = [engine.step(random_batch(64, batch=8, seq=64, seed=i)).loss for i in range(3)]
        # an evaluation reads every block with the update pending (the buffers freed by the
        # compute alone, no pack), then the steps go on
        losses.append(engine.forward(random_batch(64, batch=8, seq=64, seed=9))[1].item())
        losses += [engine.step(random_batch(64, batch=8, seq=64, seed=i)).loss for i in (3, 4)]
        engine.flush()
        stores = [engine.store, *engine.moments.blocks]
        runs[master] = (losses, [s.host_storage.view(torch.uint8).clone() for s in stores])
        del engine, model
    assert runs["double"][0] == runs["buffer"][0]
    assert all(torch.equal(a, b) for a, b in zip(runs["double"][1], runs["buffer"][1]))


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_adam_moments_stream_with_their_blocks_on_the_gpu_as_on_the_cpu(state_dtype):
    # Adam's moments in pinned host shards, uploaded and offloaded with each block on the
    # upload/offload streams and updated on the compute stream: the CPU's trajectory
    # (fp32 state: 1e-4; bf16 state rounds with the same keyed draws on both), and a
    # steady-state step queued without a host sync.
    def build(device):
        return ZOEngine(
            tiny_opt(seed=0, num_hidden_layers=4),
            ZOConfig(
                mode="offload",
                device=device,
                lr=1e-3,
                eps=1e-2,
                seed=3,
                num_slots=2,
                optimizer="adam",
                state_dtype=state_dtype,
                weight_decay=0.1,
            ),
        )

    gpu = follows_the_cpu_and_never_syncs_early(build, steps=5)
    assert all(store.host_storage.is_pinned() for store in gpu.moments.blocks)


def test_each_triton_noise_kernel_compiles_once_over_fifty_steps():
    """Keys change every step and offsets every block: each kernel the steps launch holds one
    compiled binary after 50 steps (its scalar arguments are never specialized)."""
    from distzo.zo import triton_kernels, triton_noise

    if not triton_noise.available():
        pytest.skip("Triton is not installed")
    device = torch.cuda.current_device()
    # ZO-SGD's one query: its update is update_one_kernel's one term
    kernels = (triton_kernels.perturb_kernel, triton_kernels.update_one_kernel)
    for kernel in kernels:  # forget the variants earlier tests in this process compiled
        kernel.device_caches.pop(device, None)
    model = tiny_opt(seed=0, num_hidden_layers=4, word_embed_proj_dim=16)
    engine = ZOEngine(model, ZOConfig(mode="offload", device="cuda", lr=1e-3, seed=0))
    for i in range(50):
        engine.step(random_batch(64, seed=i))
    torch.cuda.synchronize()
    for kernel in kernels:
        binaries = kernel.device_caches[device][0]  # (kernel cache, key cache, target, ...)
        assert len(binaries) == 1, (kernel.fn.__name__, list(binaries))


def test_an_asynchronous_save_right_after_a_step_holds_every_block_whole(tmp_path):
    # Naive offload: the step returns after its loss read with the last blocks' offloads
    # still landing in pinned host memory; the save's private copies must wait for them.
    import torch.distributed.checkpoint as dcp

    from distzo.job.checkpoint import Checkpointer, latest_checkpoint

    model = tiny_opt(
        seed=0, num_hidden_layers=6, hidden_size=512, ffn_dim=2048, word_embed_proj_dim=512
    )
    engine = ZOEngine(model, ZOConfig(mode="offload", device="cuda", num_slots=2, seed=0))
    for step in range(3):
        engine.step(random_batch(64, batch=8, seq=64, seed=step))
    checkpointer = Checkpointer(tmp_path, engine)
    checkpointer.save(asynchronous=True)
    checkpointer.wait()
    torch.cuda.synchronize()
    saved = {
        f"block/{i}": torch.empty(layout.numel, dtype=engine.store.rest_dtype)
        for i, layout in enumerate(engine.block_layouts)
    }
    dcp.load(saved, checkpoint_id=str(latest_checkpoint(tmp_path)), no_dist=True)
    for i in range(len(engine.block_layouts)):
        assert torch.equal(saved[f"block/{i}"], engine.store.block_at_rest(i)), i


DEVICE_ONE_SAVE = """
import os, sys, torch
from distzo import ZOConfig, ZOEngine
from distzo.job.checkpoint import Checkpointer
from tests.helpers.models import random_batch, tiny_opt
torch.cuda.set_device(1)  # as the trainer does for the rank on GPU 1
engine = ZOEngine(tiny_opt(seed=0), ZOConfig(device="cuda:1", seed=0))
engine.step(random_batch(64, seed=0))
checkpointer = Checkpointer(__import__("pathlib").Path(sys.argv[1]), engine)
checkpointer.save(asynchronous=True)
checkpointer.wait()
print(torch.cuda.list_gpu_processes(0))
print("pid", os.getpid())
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_an_asynchronous_save_of_the_rank_on_gpu_1_opens_no_context_on_gpu_0(tmp_path):
    # DCP's writer thread starts on device 0: unset, it would open a context there.
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", DEVICE_ONE_SAVE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    *listing, pid = proc.stdout.strip().splitlines()
    assert f"process {pid.split()[1]:>10s}" not in "\n".join(listing), proc.stdout


def test_an_adapters_frozen_resident_base_is_on_the_device_once():
    """bf16 passes over an fp32 base: the device holds the passes' bf16 copy of the frozen
    embeddings and head, the fp32 master (read by an export) waits on the host; a bf16
    wire leaves the base's slots in bf16 (no float32 slots beside them)."""
    from tests.helpers.models import adapted

    config = ZOConfig(
        device="cuda", mode="offload", transfer_dtype="bf16", compute_dtype="bf16", seed=0
    )
    engine = ZOEngine(adapted("llama", "lora-fa"), config)
    assert engine._resident_base_compute.device.type == "cuda"
    assert engine._resident_base_compute.dtype == torch.bfloat16
    assert engine.resident_base.device.type == "cpu" and engine.resident_base.dtype == torch.float32
    assert engine.base_store.slots.buffers[0].dtype == torch.bfloat16
    assert engine.base_store.unpacked is None
    engine.step(random_batch(64, seed=0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_low_rank_noise_equals_cpu_noise_bit_for_bit(dtype):
    """LOZO's U V^T: the factors' draws (Triton) and the separate multiplies and adds give
    the CPU's z exactly, and an engine's offload and resident runs agree on the GPU."""
    from torch import nn

    from distzo.offload.bucket import BucketLayout
    from distzo.zo.lowrank import LowRankNoise

    shapes = [(3000, 1000), (4096,), (7, 30001), (2, 3, 5)]
    params = [
        ((f"p{i}",), nn.Parameter(torch.empty(s, device="meta"))) for i, s in enumerate(shapes)
    ]
    layout = BucketLayout.build(params)[0]
    sources = [
        LowRankNoise(11, 1 << 20, torch.device(d), dtype, [layout, layout], 2, 50)
        for d in ("cuda", "cpu")
    ]
    for step, block in [(0, 0), (49, 1), (50, 1)]:
        on_gpu, on_cpu = (src.full(layout.numel, step, block) for src in sources)
        assert torch.equal(on_gpu.cpu(), on_cpu), (step, block)

    def lowrank(mode):
        model = tiny_opt(seed=0, num_hidden_layers=4, word_embed_proj_dim=16)
        config = ZOConfig(
            mode=mode, device="cuda", lr=1e-3, seed=3, noise="lowrank", lozo_interval=3
        )
        engine = ZOEngine(model, config)
        results = [
            engine.step(random_batch(64, pad="left", seed=i)).projected_grad for i in range(6)
        ]
        return results, engine.named_parameters()

    (g_offload, offload), (g_resident, resident) = lowrank("offload"), lowrank("resident")
    assert g_offload == g_resident
    assert all(torch.equal(offload[name], value) for name, value in resident.items())


@pytest.mark.parametrize(
    "dtype,held", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]
)
@pytest.mark.parametrize("rank", [1, 2, 4])
def test_cuda_low_rank_kernels_equal_the_cpu_generic_path_bit_for_bit(dtype, held, rank):
    """LOZO's perturbation and update as one kernel each on the GPU (``triton_lowrank``):
    bit for bit the CPU's generic path (torch ops on the same U and V), on runs that cut
    rows, 1-D entries between matrices, a small workspace (runs of a few rows), one and
    two terms, the decay ending inside a matrix."""
    from distzo.zo.lowrank import LowRankNoise
    from tests.helpers.lowrank_layouts import LAYOUT, Entry, Layout

    big = Layout((*LAYOUT.entries, Entry(("w",), 2048, (1000, 1000))), 1_002_048)
    gen = torch.Generator().manual_seed(rank)
    for chunk in (40, 1 << 20):
        gpu, cpu = (
            LowRankNoise(11, chunk, torch.device(d), dtype, [big], rank, 5) for d in ("cuda", "cpu")
        )
        theta = (torch.randn(big.numel, generator=gen) * 0.1).to(held)
        for start, stop in ((0, big.numel), (5, 300), (530, 900_017)):
            if chunk == 40 and stop - start > 10_000:
                continue  # one launch a row: the small workspace on small ranges
            piece = theta[start:stop]
            assert gpu.fuses_master(piece.cuda(), piece.cuda())
            out_gpu, out_cpu = torch.empty_like(piece, device="cuda"), torch.empty_like(piece)
            gpu.perturb_into(out_gpu, piece.cuda(), -1e-3, 7, 0, 1, start, big.numel)
            cpu.perturb_into(out_cpu, piece, -1e-3, 7, 0, 1, start, big.numel)
            assert torch.equal(out_gpu.cpu().view(torch.uint8), out_cpu.view(torch.uint8))
            for terms in ([(7, 0, -0.3)], [(7, 0, -0.3), (9, 1, 0.2)]):
                updated_gpu, updated_cpu = piece.cuda(), piece.clone()
                gpu.apply_terms(updated_gpu, 1_000_000, 0.99, terms, 0, start, big.numel)
                cpu.apply_terms(updated_cpu, 1_000_000, 0.99, terms, 0, start, big.numel)
                assert torch.equal(
                    updated_gpu.cpu().view(torch.uint8), updated_cpu.view(torch.uint8)
                ), (chunk, start, len(terms))


def test_benchmark_weights_drawn_on_the_gpu_land_whole_on_the_host():
    """The peers' and throughput's random models draw their Gaussians on the GPU: every
    element of the host tensor written (a chunk edge inside it), N(0, std), rounded to
    its dtype, and nothing left allocated on the device."""
    from distzo.models import weights
    from tests.helpers.scripts import benchmark_script

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    shape = (weights.DEVICE_DRAW_CHUNK // 1024 + 3, 1024)  # one chunk and 3 rows
    source = weights.RandomWeights(5, draw_dtype=torch.float32, draw_device="cuda")
    drawn = source.tensor(("model.layers.0.fc1.weight",), shape, torch.float16)
    assert drawn.device.type == "cpu" and drawn.dtype == torch.float16
    assert torch.isfinite(drawn).all() and abs(drawn.float().std().item() - 0.02) < 1e-3
    tail = drawn.view(-1)[weights.DEVICE_DRAW_CHUNK :]
    assert abs(tail.float().std().item() - 0.02) < 2e-3
    # read by ranges (a build's reads), the draw stays on the device until its last one
    name, numel = ("model.layers.0.fc1.weight",), drawn.numel()
    bounds = [0, numel // 3, numel - 5, numel]
    ranges = [
        source.tensor_range(name, shape, torch.float16, a, b) for a, b in zip(bounds, bounds[1:])
    ]
    assert all(r.device.type == "cuda" for r in ranges)
    assert torch.equal(torch.cat(ranges).cpu(), drawn.view(-1))
    del ranges
    with benchmark_script("peer_zo2") as peer:
        for where in ("cpu", "cuda"):
            layer = torch.nn.Linear(4096, 4100, dtype=torch.float16, device=where)
            layer.weight.data.fill_(float("nan"))
            peer.fill_random(layer, seed=1, device="cuda")
            assert torch.isfinite(layer.weight).all() and not layer.bias.any()
            assert abs(layer.weight.float().std().item() - 0.02) < 1e-3
    del drawn, tail, layer
    assert torch.cuda.memory_allocated() == before
