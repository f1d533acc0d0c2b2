"""Memory the plan did not count (issue 29, item 5): the resident bucket built whole on
the host by every rank, ``.bin`` shards kept mapped, the attention masks kept per
micro-batch and group size, and NCCL's buffers. Each is either no longer done or
planned, and a refusal names the term that does not fit."""

import gc
import json
import weakref

import pytest
import torch

from distzo import ZOConfig, ZOEngine
from distzo.engine import layouts
from distzo.job import memory_plan
from distzo.job.memory_plan import (
    PlannedExport,
    RankPlace,
    check_fits,
    nccl_buffer_bytes,
    plan_memory,
)
from distzo.models.shapes import shape_config
from distzo.models.weights import RandomWeights, open_checkpoint, skeleton
from distzo.offload.low_bit import TRANSFER_DTYPES
from tests.helpers.models import adapted, base_model, build, random_batch


def test_the_resident_bucket_reaches_the_device_a_chunk_at_a_time(monkeypatch):
    monkeypatch.setattr(layouts, "LOAD_CHUNK", 1 << 20, raising=False)
    reads = []
    whole = layouts.bucket_range

    def spied(layout, weights, lo, hi):
        reads.append((layout, hi - lo))
        return whole(layout, weights, lo, hi)

    monkeypatch.setattr(layouts, "bucket_range", spied)
    model = skeleton(shape_config("opt-125m", layers=1), torch.float32)
    engine = ZOEngine(model, ZOConfig(device="cpu", seed=0), weights=RandomWeights(3))
    resident = engine.resident_layout
    sizes = [n for layout, n in reads if layout is resident]
    assert resident.numel > 30 << 20 and max(sizes) == 1 << 20
    assert sum(sizes) == resident.numel
    # the same values as one read of the whole bucket
    assert torch.equal(engine.resident_master, whole(resident, RandomWeights(3), 0, resident.numel))


def test_a_bin_checkpoint_keeps_one_shard_mapped(tmp_path):
    shards = {
        "pytorch_model-00001-of-00002.bin": {"a": torch.arange(6.0).reshape(2, 3)},
        "pytorch_model-00002-of-00002.bin": {"b": torch.ones(4)},
    }
    for file, state in shards.items():
        torch.save(state, tmp_path / file)
    weight_map = {name: file for file, state in shards.items() for name in state}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    source = open_checkpoint(tmp_path)
    first = source.tensor(("a",), (2, 3), torch.float32)  # the mapped tensor itself
    assert torch.equal(first, torch.arange(6.0).reshape(2, 3))
    mapped = weakref.ref(first)
    del first
    assert torch.equal(source.tensor(("b",), (4,), torch.float32), torch.ones(4))
    gc.collect()
    assert mapped() is None, "the first shard is still mapped after the second was opened"
    # and it maps again when read again
    assert torch.equal(source.tensor(("a",), (2, 3), torch.float32)[1], torch.tensor([3.0, 4, 5]))


def mask_bytes(ctx):
    masks = ctx.attention_mask
    masks = masks.values() if isinstance(masks, dict) else [masks]
    return sum(m.nbytes for m in masks if isinstance(m, torch.Tensor))


@pytest.mark.parametrize(
    "name, overrides, flags",
    [
        ("llama", {}, {}),
        ("llama", {"attn_implementation": "eager"}, {}),
        ("qwen2_sliding", {}, {}),  # two kinds of mask: full and sliding
        ("lora", {}, dict(dual_forward=True, batch_queries=True, num_queries=2)),
    ],
)
def test_the_plan_counts_the_attention_masks_a_step_builds(monkeypatch, name, overrides, flags):
    if name == "lora":
        model = adapted("llama", "lora")
    elif name == "llama":
        model = base_model("llama", **overrides)
    else:
        model = build(name)
    config = ZOConfig(device="cpu", seed=0, grad_accum=2, **flags)
    rows, length = 4, 12
    plan = plan_memory(model, config, 1, False, batch=rows, seq=length)
    engine = ZOEngine(model, config)
    built = []
    context = engine.family.context

    def spied(*args, **kwargs):
        ctx = context(*args, **kwargs)
        built.append(mask_bytes(ctx))
        return ctx

    monkeypatch.setattr(engine.family, "context", spied)
    batch = random_batch(64, rows, length, pad="left")
    engine.step(batch)
    assert plan.device_masks == sum(built) > 0, (plan.device_masks, built)


def test_the_plan_counts_a_layers_attention_scores_as_its_implementation_keeps_them():
    """Eager attention holds a (L, L) plane of scores per head; sdpa's kernels keep them in
    tiles and hold one plane (its boolean mask made a float bias); flash attention none.
    The plan had counted eager's planes under sdpa: 0.26 GB above every peak an H100
    measured at OPT-6.7B (1 x 2048 in fp16, 32 heads: 32 x 2048^2 x 2 bytes)."""
    rows, length = 2, 512
    planned = {}
    for implementation in ("eager", "sdpa", "flash_attention_2"):
        model = base_model("llama")
        model.config._attn_implementation = implementation
        plan = plan_memory(model, ZOConfig(device="cpu", seed=0), 1, False, rows, length)
        planned[implementation] = plan.activations
    heads, plane = model.config.num_attention_heads, rows * length * length * 4
    assert heads > 1
    assert planned["eager"] - planned["sdpa"] == (heads - 1) * plane
    assert planned["sdpa"] - planned["flash_attention_2"] == plane


MIB = 1 << 20


def test_nccl_buffers_follow_nccls_variables():
    ring, nvls = 2 * 32 * 4 * MIB, 8 * 16 * 2 * 4 * MIB  # per communicator of 8 local ranks
    assert nccl_buffer_bytes([8, 8], {}) == 2 * (ring + nvls) == 2560 * MIB
    assert nccl_buffer_bytes([8], {"NCCL_NVLS_ENABLE": "0"}) == ring
    assert nccl_buffer_bytes([8], {"NCCL_BUFFSIZE": str(MIB), "NCCL_NVLS_ENABLE": "0"}) == ring // 4
    assert nccl_buffer_bytes([1], {"NCCL_MAX_NCHANNELS": "4"}) == 2 * 4 * 4 * MIB  # no NVLS alone
    assert nccl_buffer_bytes([], {}) == 0


def test_the_plan_counts_nccl_buffers_for_the_job_and_the_shard_group(monkeypatch):
    monkeypatch.delenv("NCCL_BUFFSIZE", raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    model = build("llama")

    def comm(device, sliced, world=8):
        plan = plan_memory(
            model,
            ZOConfig(device="cpu"),
            8,
            sliced,
            2,
            8,
            place=RankPlace(pert=2, world=world, local_ranks=8),
            device_type=device,
        )
        return plan.device_comm

    assert comm("cuda", True) == 2 * 256 * MIB and comm("cuda", False) == 256 * MIB
    assert comm("cpu", True) == 0 and comm("cuda", False, world=1) == 0
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    assert comm("cuda", False) == 256 * MIB + 1024 * MIB


def test_a_refusal_names_the_largest_term(monkeypatch):
    monkeypatch.setenv("NCCL_BUFFSIZE", str(64 * MIB))
    model, config = build("llama"), ZOConfig(device="cpu")
    plan = plan_memory(
        model,
        config,
        8,
        True,
        2,
        8,
        place=RankPlace(pert=2, world=8, local_ranks=8),
        device_type="cuda",
    )
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (MIB, 80 << 30))
    monkeypatch.setattr(memory_plan, "available_host_bytes", lambda: 1 << 40)
    with pytest.raises(ValueError) as refused:
        check_fits(plan, torch.device("cuda", 0), 8, force=False)
    message = str(refused.value)
    assert "free on cuda:0 (largest: NCCL buffers " in message and "host memory" not in message
    monkeypatch.setattr(memory_plan, "available_host_bytes", lambda: 1000)
    cpu_plan = plan_memory(build("llama"), ZOConfig(device="cpu"), 1, False, 2, 8)
    with pytest.raises(ValueError, match=r"1\.00 KB available \(largest: scratch "):
        check_fits(cpu_plan, torch.device("cpu"), 1, force=False)


def test_the_plan_counts_a_batched_groups_block_activations():
    # --dual-forward --batch-queries run the 2q passes' rows through a block in one forward:
    # the MLP's gate, activation and up outputs of every pass's rows live together
    model = adapted("llama", "lora")
    config = ZOConfig(device="cpu", seed=0, dual_forward=True, batch_queries=True, num_queries=4)
    rows, length = 2, 12
    plan = plan_memory(model, config, 1, False, batch=rows, seq=length)
    engine = ZOEngine(model, config)
    widest = []
    mlp = engine.blocks[0].mlp
    mlp.up_proj.register_forward_hook(lambda module, args, out: widest.append(out.nbytes))
    engine.step(random_batch(64, rows, length))
    hiddens = 2 * config.num_queries * rows * length * model.config.hidden_size * 4
    assert plan.activations >= hiddens + 3 * max(widest), (plan.activations, max(widest))


def test_the_plan_counts_a_head_chunks_logits_and_their_log_softmax():
    # the LM head runs on a chunk of positions at a time; beside its logits, a float32
    # log-softmax of the same shape lives while the chunk is scored
    model = base_model("llama", vocab_size=8192, num_hidden_layers=1)
    config = ZOConfig(device="cpu", seed=0, mode="resident")
    rows, length = 2, 8
    plan = plan_memory(model, config, 1, False, batch=rows, seq=length)
    engine = ZOEngine(model, config)
    logits = []
    model.lm_head.register_forward_hook(lambda module, args, out: logits.append(out.nbytes))
    engine.step(random_batch(8192, rows, length))
    hiddens = 2 * rows * length * model.config.hidden_size * 4
    assert plan.activations >= hiddens + 2 * max(logits), (plan.activations, max(logits))


def test_the_host_check_adds_up_its_terms(monkeypatch):
    # a job needs every term at once: each one fitting alone is not enough
    plan = plan_memory(build("llama"), ZOConfig(device="cpu", optimizer="adam"), 1, False, 2, 8)
    terms = memory_plan.host_terms(plan, False, 1)
    assert len(terms) > 1
    monkeypatch.setattr(memory_plan, "available_host_bytes", lambda: sum(terms.values()) - 1)
    with pytest.raises(ValueError, match="of host memory for 1 local ranks"):
        check_fits(plan, torch.device("cpu"), 1, force=False)
    monkeypatch.setattr(memory_plan, "available_host_bytes", lambda: sum(terms.values()))
    check_fits(plan, torch.device("cpu"), 1, force=False)


@pytest.mark.parametrize("shard", ["2KB", "5GB"])
def test_the_plan_counts_the_shard_the_export_holds(tmp_path, monkeypatch, shard):
    # rank 0 collects each safetensors file's tensors before writing it: the whole model
    # under the default 5GB, at the end of the run
    from tests.helpers.engines import export_shard_bytes

    model = build("llama")
    config = ZOConfig(device="cpu", seed=0)
    plan = plan_memory(model, config, 1, False, 2, 8, async_save=False, export=PlannedExport(shard))
    engine = ZOEngine(build("llama"), config)
    held = export_shard_bytes(monkeypatch, engine, tmp_path / "export", shard)
    block = max(layout.numel for layout in engine.block_layouts) * 4
    assert max(held) <= plan.export_bytes - block <= max(held) + 4 * block
    assert (len(held) > 1) == (shard == "2KB")
    terms = memory_plan.host_terms(plan, False, 1)
    assert terms["the export"] == plan.export_bytes and "a checkpoint save" not in terms
    monkeypatch.setattr(memory_plan, "available_host_bytes", lambda: 1000)
    with pytest.raises(ValueError, match="--export-shard-size"):
        check_fits(plan, torch.device("cpu"), 1, force=False)


def test_a_cpu_plan_counts_the_moments_host_shards_and_their_device_side():
    # on CPU the "device" is host memory too: both sides of an offloaded Adam's moments
    model = build("llama")
    plan = plan_memory(model, ZOConfig(device="cpu", optimizer="adam"), 1, False, 2, 8)
    assert plan.state_host_bytes > 0 and plan.state_device_bytes > 0
    for ranks in (1, 3):
        terms = memory_plan.host_terms(plan, False, ranks)
        assert terms["optimizer state"] == (plan.state_host_bytes + plan.state_device_bytes) * ranks
        everything = plan.host_bytes + plan.state_host_bytes + plan.device_need
        assert sum(terms.values()) == everything * ranks + plan.checkpoint_bytes


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize(
    "nodes, local_ranks, sliced",
    [(2, 1, False), (2, 2, False), (3, 2, False), (2, 2, True)],
)
def test_each_node_plans_the_checkpoint_copies_its_own_ranks_make(
    optimizer, nodes, local_ranks, sliced
):
    # Block i is saved by one rank (rank i % world, or node i % nodes when sliced) and the
    # resident bucket by rank 0 alone: the nodes' copies add up to one model, as one
    # process's do, and a node whose ranks save nothing plans nothing.
    model = build("llama")  # 3 blocks
    config = ZOConfig(device="cpu", optimizer=optimizer)
    world = nodes * local_ranks

    def copies(node: int, world: int, local: int) -> int:
        shard = local if sliced else 1
        plan = plan_memory(
            model,
            config,
            shard,
            sliced,
            2,
            8,
            place=RankPlace(world=world, local_ranks=local, node=node),
        )
        return plan.checkpoint_bytes

    per_node = [copies(node, world, local_ranks) for node in range(nodes)]
    assert sum(per_node) == copies(0, 1, 1)
    if nodes == 3:  # 6 ranks, 3 blocks: node 2's ranks 4 and 5 save none
        assert per_node[2] == 0


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_a_save_plans_the_moments_at_rest_in_their_own_dtype(state_dtype):
    """A checkpoint copies each moment as it rests (bf16 host shards stay bf16): the plan's
    copies beyond SGD's are the engine's moments, block by block and beside the resident
    bucket, at their own size."""
    options = dict(device="cpu", mode="offload", num_slots=2)
    adam = ZOConfig(**options, optimizer="adam", state_dtype=state_dtype)

    def copies(config: ZOConfig) -> int:
        return plan_memory(build("llama"), config, 1, False, 2, 8).checkpoint_bytes

    engine = ZOEngine(build("llama"), adam)
    moments = engine.moments
    at_rest = sum(
        store.block_at_rest(i).nbytes
        for store in moments.blocks
        for i in range(len(engine.block_layouts))
    )
    assert moments.blocks[0].block_at_rest(0).dtype == TRANSFER_DTYPES[state_dtype]
    resident = sum(t.nbytes for t in moments.resident)
    assert copies(adam) - copies(ZOConfig(**options)) == at_rest + resident
