"""Streaming load and random-init shapes: the model is never materialised whole."""

import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from distzo import ZOConfig, ZOEngine
from distzo.job.checkpoint import Checkpointer
from distzo.job.memory_plan import plan_memory
from distzo.models.shapes import SHAPES, shape_config
from distzo.models.weights import RandomWeights, TorchBinWeights, open_checkpoint, skeleton
from tests.helpers.launch import child_env, train_in_process
from tests.helpers.models import build, random_batch, tiny_opt


def save(model, path: Path, fmt: str) -> None:
    """``model`` as a checkpoint of format ``fmt``: safetensors, sharded, bin (written by
    hand: transformers 5 writes safetensors whatever it is asked), or base: the keys a base
    model saves, without ``model.``/``transformer.`` and the tied head (facebook/opt-*,
    openai-community/gpt2 on the hub)."""
    model.save_pretrained(path, max_shard_size="20KB" if fmt == "sharded" else "5GB")
    if fmt in ("bin", "base"):
        state = load_file(str(path / "model.safetensors"))
        (path / "model.safetensors").unlink()
        if fmt == "base":
            prefix = model.base_model_prefix + "."
            state = {k.removeprefix(prefix): v for k, v in state.items() if k != "lm_head.weight"}
            save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        else:
            torch.save(state, path / "pytorch_model.bin")


@pytest.mark.parametrize(
    "name",
    [
        "llama_tied",
        "qwen2",
        "mistral",
        "gpt2",
        "opt",
        "gemma3",
        "granite",
        "phi3",
        "qwen3_moe",
        "mixtral",
        "qwen2_moe",
    ],
)
@pytest.mark.parametrize("fmt", ["safetensors", "sharded", "bin", "base"])
def test_streamed_parameters_equal_from_pretrained(tmp_path, name, fmt):
    original = tiny_opt(seed=5) if name == "opt" else build(name, seed=5)
    if fmt == "base" and not original.config.tie_word_embeddings:
        pytest.skip("a base model's checkpoint holds no head: only a tied one is in it")
    save(original, tmp_path, fmt)
    if fmt == "sharded":
        assert (tmp_path / "model.safetensors.index.json").exists()
    if fmt == "bin":
        assert isinstance(open_checkpoint(tmp_path), TorchBinWeights)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    model = skeleton(reference.config, torch.float32)
    assert all(p.device.type == "meta" for p in model.parameters())
    engine = ZOEngine(model, ZOConfig(device="cpu", seed=0), weights=open_checkpoint(tmp_path))
    params = engine.named_parameters()
    for key, value in reference.state_dict().items():
        if key in params:
            assert torch.equal(params[key], value), key
    batch = random_batch(64, pad="left", seed=1)
    with torch.no_grad():
        expected = reference(**batch).logits
    logits, _ = engine.forward(batch)
    keep = batch["attention_mask"].bool()
    assert (logits - expected)[keep].abs().max().item() <= 1e-5


def test_a_quantized_checkpoint_is_refused_not_trained_on_its_codes(tmp_path):
    build("qwen3").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"its weights are quantized \(fp8\)"):
        open_checkpoint(tmp_path)
    proc = train_in_process(["--model", str(tmp_path), "--output-dir", str(tmp_path / "run")])
    assert proc.returncode == 2 and "its weights are quantized (fp8)" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_shard_the_index_names_but_lacks_is_one_line(tmp_path):
    build("llama").save_pretrained(tmp_path, max_shard_size="20KB")
    last = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    last.unlink()
    proc = train_in_process(["--model", str(tmp_path), "--output-dir", str(tmp_path / "run")])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[-1] == (
        f"error: {tmp_path}: model.safetensors.index.json names {last.name}, which is missing; "
        "download or copy the model again"
    ), proc.stderr[-1500:]


@pytest.mark.parametrize(
    ("index", "says"),
    [
        ('{"metadata": {}, "weight_map": {"model.embed', "not a model index (not JSON: "),
        ('{"metadata": {}}', "holds no weight_map of tensor names to files"),
        ("[]", "holds no weight_map of tensor names to files"),
    ],
    ids=["torn", "no-weight-map", "a-list"],
)
def test_a_damaged_shard_index_is_one_line_naming_it(tmp_path, index, says):
    """Once a bare "Expecting value: line 1 column 1" or a KeyError traceback."""
    build("llama").save_pretrained(tmp_path, max_shard_size="20KB")
    path = tmp_path / "model.safetensors.index.json"
    path.write_text(index)
    proc = train_in_process(["--model", str(tmp_path), "--output-dir", str(tmp_path / "run")])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[-1].startswith(f"error: {path}: {says}"), proc.stderr[
        -1500:
    ]
    assert lines[-1].endswith("; download or copy the model again")


def test_a_directory_without_weights_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="holds no model.safetensors"):
        open_checkpoint(tmp_path)


def test_random_weights_are_the_same_on_every_rank_and_shaped_by_role():
    a, b = RandomWeights(3), RandomWeights(3)
    w = a.tensor(("model.layers.0.mlp.up_proj.weight",), (8, 4), torch.float32)
    assert torch.equal(w, b.tensor(("model.layers.0.mlp.up_proj.weight",), (8, 4), torch.float32))
    assert not torch.equal(
        w, a.tensor(("model.layers.1.mlp.up_proj.weight",), (8, 4), torch.float32)
    )
    assert torch.equal(a.tensor(("x.bias",), (3,), torch.float32), torch.zeros(3))
    assert torch.equal(a.tensor(("x.norm.weight",), (3,), torch.float32), torch.ones(3))


@pytest.mark.parametrize("name", SHAPES)
def test_every_named_shape_builds_as_a_skeleton(name):
    model = skeleton(shape_config(name, layers=1), torch.float32)
    plan = plan_memory(model, ZOConfig(device="cpu"), 1, False, batch=1, seq=8)
    assert plan.parameters > 1e7 and plan.host_bytes > 0


def test_the_plan_counts_what_the_engine_allocates(tmp_path):
    model = build("llama", seed=0)
    configs = (
        ZOConfig(device="cpu", num_slots=3),
        ZOConfig(device="cpu", transfer_dtype="bf16"),
        ZOConfig(device="cpu", transfer_dtype="bf16", low_bit_master="recompute", noise_chunk=999),
        ZOConfig(device="cpu", transfer_dtype="bf16", low_bit_master="double"),
        ZOConfig(device="cpu", noise="legacy"),
    )
    for config in configs:
        plan = plan_memory(model, config, 1, False, batch=2, seq=8)
        engine = ZOEngine(build("llama", seed=0), config)
        # an untied head's sides take turns in the block scratch: counted once
        assert engine.resident.shares_blocks
        assert engine.resident_scratch.data_ptr() == engine.block_scratch.data_ptr()
        allocated = (
            engine.resident_master.nbytes
            + engine.block_scratch.nbytes
            + engine.store.device_bytes
            + engine.noise.device_bytes
            + (engine.rounding_noise.device_bytes if engine.rounding_noise else 0)
            + (engine.rebuilt.device_bytes if engine.rebuilt else 0)
        )
        assert plan.device_bytes == allocated
        assert plan.host_bytes == engine.store.host_bytes
        # A checkpoint save copies exactly what the plan reserves for it: everything when
        # asynchronous, nothing when synchronous (the blocks' host copy is written as it is).
        live = [engine.resident_master, engine.store.host_storage]
        for async_save in (True, False):
            state = Checkpointer(tmp_path, engine)._state(private=async_save)
            copied = [v for k, v in state.items() if not k.startswith("meta/")]
            copied = [v for v in copied if not any(inside(v, w) for w in live)]
            planned = plan_memory(model, config, 1, False, batch=2, seq=8, async_save=async_save)
            assert (
                planned.checkpoint_bytes
                == sum(v.nbytes for v in copied)
                == (plan.checkpoint_bytes if async_save else 0)
            )


def inside(tensor: torch.Tensor, whole: torch.Tensor) -> bool:
    """Whether ``tensor``'s bytes lie in ``whole``'s storage (the same memory)."""
    start, storage = tensor.data_ptr(), whole.untyped_storage()
    return storage.data_ptr() <= start and start + tensor.nbytes <= (
        storage.data_ptr() + storage.nbytes()
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_resident_engines_masters_are_counted_in_bytes_of_their_dtype(dtype):
    """rankN.json's device_bytes and the plan agree on resident (MeZO) masters, in bytes not
    elements; a resume reads each block into a buffer of the dtype it rests in."""
    config = ZOConfig(device="cpu", mode="resident")
    plan = plan_memory(build("llama", seed=0).to(dtype), config, 1, False, batch=2, seq=8)
    engine = ZOEngine(build("llama", seed=0).to(dtype), config)
    store = engine.store
    padded = sum(layout.numel for layout in engine.block_layouts)  # each block's padded bucket
    assert store.device_bytes == plan.device_blocks == padded * dtype.itemsize
    assert store.rest_dtype == store.block_at_rest(0).dtype == dtype


@pytest.mark.parametrize("optimizer, wire", [("sgd", "fp32"), ("adam", "bf16")])
def test_a_synchronous_save_writes_the_blocks_host_copy_itself(
    tmp_path, monkeypatch, optimizer, wire
):
    # DCP's writer clones a tensor whose storage is larger than it (a block's view of the
    # padded host copy) and holds every clone until the file is written: the blocks twice
    # in host memory, where the plan counts no copy.
    from torch.distributed.checkpoint import filesystem

    config = ZOConfig(device="cpu", optimizer=optimizer, transfer_dtype=wire)
    engine = ZOEngine(build("llama", seed=0), config)
    written = {}
    write_item = filesystem._write_item

    def spied(transforms, stream, data, item, *args, **kwargs):
        written[item.index.fqn] = data
        return write_item(transforms, stream, data, item, *args, **kwargs)

    monkeypatch.setattr(filesystem, "_write_item", spied)
    Checkpointer(tmp_path, engine).save(asynchronous=False)
    host = [engine.store.host_storage, *(m.host_storage for m in engine.moments.blocks)]
    blocks = {k: v for k, v in written.items() if "block/" in k}
    assert len(blocks) == len(engine.blocks) * (1 + config.num_moments)
    assert all(any(inside(v, h) for h in host) for v in blocks.values()), "blocks were copied"
    # and it reads back as the blocks it wrote
    (saved,) = tmp_path.glob("step-*")
    fresh = ZOEngine(build("llama", seed=1), config)
    Checkpointer(tmp_path, fresh).load(saved)
    for k in range(1 + config.num_moments):
        moment = None if k == 0 else k - 1
        ours = dict(engine.blocks_at_rest(lambda i: True, True, moment=moment))
        theirs = dict(fresh.blocks_at_rest(lambda i: True, True, moment=moment))
        assert all(torch.equal(ours[i], theirs[i]) for i in ours)


def test_opt_13b_shape_with_one_layer_builds_and_steps():
    model = skeleton(shape_config("opt-13b", layers=1), torch.float32)
    engine = ZOEngine(model, ZOConfig(device="cpu", seed=0, lr=1e-7), weights=RandomWeights(0))
    # 50272 x 5120 tied embedding (257.4M) + 2050 x 5120 positions (10.5M)
    # + one 12 d^2 layer (314.6M)
    assert 0.58e9 < engine.num_parameters < 0.59e9
    result = engine.step({"input_ids": torch.randint(3, 50272, (1, 4))})
    assert torch.isfinite(torch.tensor([result.loss_plus, result.loss_minus])).all()


def test_a_plan_that_does_not_fit_is_refused_before_anything_is_allocated():
    proc = train_in_process(["--model-config", "opt-175b", "--max-steps", "1"])
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: the run does not fit: it needs") and "--force" in line


@pytest.mark.slow
def test_streaming_a_large_checkpoint_stays_within_its_memory_bound(tmp_path):
    # ~0.83 GB of fp32 weights in 300 MB shards; a small vocabulary keeps the resident part small.
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 0.5e9 < model_bytes < 1e9
    model.save_pretrained(tmp_path / "ckpt", max_shard_size="300MB")
    del model
    assert len(list((tmp_path / "ckpt").glob("model-*.safetensors"))) >= 3
    from tests.helpers.launch import free_port

    cache = fake_hub_cache(tmp_path / "hub", "org/large", tmp_path / "ckpt")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").state_dict()
    sums = {
        key: (value.double().sum().item(), value.double().square().sum().item())
        for key, value in reference.items()
    }
    del reference
    for n, source in (
        (1, str(tmp_path / "ckpt")),
        (2, str(tmp_path / "ckpt")),
        (2, "hub:org/large"),
    ):
        out = tmp_path / f"probe{n}"
        probe = [source, str(out)]
        command = (
            [sys.executable, "tests/helpers/stream_probe.py", *probe]
            if n == 1
            else [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc_per_node={n}",
                "--master_addr=127.0.0.1",
                f"--master_port={free_port()}",
                "tests/helpers/stream_probe.py",
                *probe,
            ]
        )
        proc = subprocess.run(
            command, capture_output=True, text=True, timeout=600, env=child_env(hub_env(cache))
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        records = [json.loads((tmp_path / f"probe{n}.rank{r}.json").read_text()) for r in range(n)]
        bound = 1.3 * model_bytes / n + 1e9
        print(
            f"n={n} {source}: model {model_bytes / 1e9:.3f} GB, peak RSS per rank "
            f"{[round(r['peak_rss'] / 1e9, 3) for r in records]} GB, bound {bound / 1e9:.3f} GB"
        )
        for record in records:
            assert record["peak_rss"] < bound, (n, record["peak_rss"] / 1e9, bound / 1e9)
        for key, (total, squares) in records[0]["checksums"].items():
            assert total == pytest.approx(sums[key][0], rel=1e-12, abs=1e-9), key
            assert squares == pytest.approx(sums[key][1], rel=1e-12), key


def fake_hub_cache(cache: Path, repo: str, files: Path) -> Path:
    """A Hugging Face cache holding ``repo`` as a downloaded snapshot of ``files`` (linked,
    not copied): what snapshot_download finds offline."""
    commit = "0" * 40
    home = cache / ("models--" + repo.replace("/", "--"))
    snapshot = home / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in files.iterdir():
        (snapshot / file.name).symlink_to(file)
    (home / "refs").mkdir()
    (home / "refs" / "main").write_text(commit)
    return cache


def hub_env(cache: Path) -> dict[str, str]:
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def test_a_hub_name_streams_its_snapshot_like_a_local_directory(tmp_path):
    from tests.helpers.launch import Run, torchrun

    build("llama_tied", seed=3).save_pretrained(tmp_path / "local", max_shard_size="20KB")
    cache = fake_hub_cache(tmp_path / "hub", "org/tiny-llama", tmp_path / "local")
    runs = {}
    for name, model in (("hub", "org/tiny-llama"), ("local", str(tmp_path / "local"))):
        args = [
            "--model",
            model,
            "--max-steps",
            "3",
            "--log-every",
            "0",
            "--batch-size",
            "4",
            "--seq-len",
            "8",
            "--eval-batch-size",
            "4",
            "--dtype",
            "fp64",
            "--output-dir",
            str(tmp_path / name),
        ]
        proc = torchrun(2, args, env=hub_env(cache))
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = Run(tmp_path / name)
    assert runs["hub"].grads == runs["local"].grads
    assert all(
        torch.equal(runs["hub"].params[k], runs["local"].params[k]) for k in runs["local"].params
    )


def test_a_hub_snapshot_missing_a_shard_is_named_before_anything_is_built(tmp_path):
    """An interrupted download: the index lists a shard whose blob the cache never got
    (its link dangles). Checked as a local folder is, not read at its first bucket and
    said as "cannot write" the shard."""
    from tests.helpers.launch import run_python

    build("llama_tied").save_pretrained(tmp_path / "files", max_shard_size="20KB")
    cache = fake_hub_cache(tmp_path / "hub", "org/tiny", tmp_path / "files")
    shard = sorted((tmp_path / "files").glob("model-*.safetensors"))[1]
    shard.unlink()  # the snapshot's link to it dangles
    run = tmp_path / "run"
    command = [sys.executable, "-m", "distzo.train", "--model", "org/tiny"]
    proc = run_python(command + ["--output-dir", str(run)], child_env(hub_env(cache)), 120)
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and f"names {shard.name}, which is missing" in line, line
    assert line.endswith("download or copy the model again") and not run.exists()


def test_a_missing_hub_model_is_one_line(tmp_path):
    from huggingface_hub import constants

    from distzo.models.hub import snapshot

    with pytest.MonkeyPatch.context() as patch:
        # huggingface_hub reads both variables once, when it is imported (already, here):
        # its constants too, or the call goes to the network and retries for 20 s
        patch.setenv("HF_HUB_CACHE", str(tmp_path))
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
        patch.setattr(constants, "HF_HUB_OFFLINE", True)
        with pytest.raises(ValueError, match="cannot download --model 'org/none'") as info:
            snapshot("org/none", download=True)
    assert "\n" not in str(info.value)


def test_only_safetensors_are_fetched_when_the_repository_has_them():
    from distzo.models.hub import weight_patterns

    both = weight_patterns(["config.json", "model.safetensors", "pytorch_model.bin", "modeling.py"])
    assert (
        "*.safetensors" in both and "*.bin" not in both and not any(p.endswith(".py") for p in both)
    )
    assert "*.bin" in weight_patterns(["config.json", "pytorch_model.bin"])


def test_a_sliced_rank_reads_only_the_pieces_it_owns(tmp_path):
    from distzo.engine import bucket_layouts, bucket_range
    from distzo.models import family_for
    from distzo.offload import Shard, StreamedBlocks

    original = build("llama", seed=2)
    original.save_pretrained(tmp_path, max_shard_size="20KB")
    source = open_checkpoint(tmp_path)
    model = skeleton(original.config, torch.float32)
    built, _ = bucket_layouts(model, family_for(model).blocks())
    layouts = [layout for layout, _ in built]
    naive = StreamedBlocks(layouts, torch.device("cpu"), 1)
    for i, (layout, _) in enumerate(built):
        full = torch.zeros(layout.numel)
        for e in layout.entries:
            full[e.offset : e.offset + e.numel] = source.tensor(
                e.names, e.shape, torch.float32
            ).reshape(-1)
        naive.load_block(i, full)
    for rank in range(2):
        sliced = StreamedBlocks(
            layouts, torch.device("cpu"), 1, shard=Shard(None, rank, 2), chunks=3
        )
        asked = []

        def read(layout, lo, hi):
            asked.append((lo, hi))
            return bucket_range(layout, source, lo, hi)

        for i, layout in enumerate(layouts):
            asked.clear()
            sliced.load_block_ranges(i, lambda lo, hi, layout=layout: read(layout, lo, hi))
            owned = [s for _, s in sliced._pieces(i)]
            # never more than its share
            assert sum(hi - lo for lo, hi in asked) <= sum(hi - lo for lo, hi in owned)
            assert all(any(o_lo <= lo and hi <= o_hi for o_lo, o_hi in owned) for lo, hi in asked)
            # and what it holds equals the owner's pieces of the whole block
            sliced_full = torch.zeros(sliced.padded[i])
            naive_full = torch.zeros(sliced.padded[i])
            naive_full[: layout.numel] = naive.master(i)[: layout.numel]
            for (h_lo, h_hi), (s_lo, s_hi) in sliced._pieces(i):
                sliced_full[s_lo:s_hi] = sliced.master(i)[h_lo:h_hi]
                assert torch.equal(sliced_full[s_lo:s_hi], naive_full[s_lo:s_hi])


def test_random_weights_drawn_in_float32_are_its_draws_rounded():
    """A benchmark's 16-bit model draws in float32 (the vectorised path); by default a
    tensor's draws stay in its own dtype, as a recorded run's replay expects."""
    name, shape = ("model.layers.0.mlp.up_proj.weight",), (8, 40)
    wide = RandomWeights(3).tensor(name, shape, torch.float32)
    fast = RandomWeights(3, draw_dtype=torch.float32).tensor(name, shape, torch.float16)
    assert fast.dtype == torch.float16 and torch.equal(fast, wide.to(torch.float16))
    g = torch.Generator().manual_seed(3 * 1_000_003 + zlib.crc32(name[0].encode()))
    own = torch.empty(shape, dtype=torch.float16).normal_(0.0, 0.02, generator=g)
    assert torch.equal(RandomWeights(3).tensor(name, shape, torch.float16), own)


def test_random_weights_drawn_on_a_device_fill_every_element_chunk_by_chunk(monkeypatch):
    """A device draw (the CPU standing in for a GPU) fills the host tensor a chunk at a
    time from one generator: every element written, each chunk its own draws, the
    tensor's dtype, N(0, std), the same tensor again for the same name."""
    from distzo.models import weights

    monkeypatch.setattr(weights, "DEVICE_DRAW_CHUNK", 1000)
    monkeypatch.setattr(weights.torch, "empty", _nan_filled(torch.empty))
    name, shape = ("model.layers.0.mlp.up_proj.weight",), (50, 90)  # 4.5 chunks
    source = RandomWeights(3, std=0.5, draw_dtype=torch.float32, draw_device="cpu")
    drawn = source.tensor(name, shape, torch.float16)
    assert drawn.dtype == torch.float16 and drawn.shape == shape and drawn.device.type == "cpu"
    flat = drawn.float().view(-1)
    assert torch.isfinite(flat).all()
    chunks = flat.split(1000)
    assert len(chunks) == 5 and all(
        not torch.equal(chunks[i][:500], chunks[j][:500]) for i in range(5) for j in range(i + 1, 5)
    )
    assert abs(flat.std().item() - 0.5) < 0.03 and abs(flat.mean().item()) < 0.03
    assert torch.equal(
        drawn, RandomWeights(3, 0.5, torch.float32, "cpu").tensor(name, shape, torch.float16)
    )
    other = ("model.layers.1.mlp.up_proj.weight",)
    assert not torch.equal(drawn, source.tensor(other, shape, torch.float16))


def _nan_filled(empty):
    """torch.empty whose floating tensors start as NaN: an element left unwritten shows."""

    def filled(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    return filled


@pytest.mark.parametrize("ranks,chunks", [(1, 1), (2, 3)])
def test_a_block_read_in_chunks_is_the_block_read_whole(tmp_path, ranks, chunks):
    """A start-up read asks for ``chunk`` elements at a time (never a block of float32
    on the host at once): each ask at most ``chunk`` long and inside a piece the rank
    owns, the asks covering its share exactly once, and what the rank holds, padding
    (0) included, is what one read of its whole share gives."""
    from distzo.engine import bucket_layouts, bucket_range
    from distzo.models import family_for
    from distzo.offload import Shard, StreamedBlocks

    original = build("llama", seed=2)
    original.save_pretrained(tmp_path)
    source = open_checkpoint(tmp_path)
    model = skeleton(original.config, torch.float32)
    built, _ = bucket_layouts(model, family_for(model).blocks())
    layouts = [layout for layout, _ in built]
    for rank in range(ranks):

        def store() -> StreamedBlocks:
            made = StreamedBlocks(
                layouts,
                torch.device("cpu"),
                1,
                torch.float16,
                Shard(None, rank, ranks),
                chunks=chunks,
                read_only=True,
            )
            made.host_storage.fill_(7.0)  # padding left unwritten shows
            return made

        whole, pieces = store(), store()
        for i, layout in enumerate(layouts):
            asked: list[tuple[int, int]] = []

            def read(lo, hi, layout=layout):
                asked.append((lo, hi))
                return bucket_range(layout, source, lo, hi)

            whole.load_block_ranges(i, read)
            assert asked == whole.share_ranges(i)
            asked.clear()
            pieces.load_block_ranges(i, read, chunk=37)
            assert all(hi - lo <= 37 for lo, hi in asked)
            covered = sorted(k for lo, hi in asked for k in range(lo, hi))
            share = sorted(k for lo, hi in whole.share_ranges(i) for k in range(lo, hi))
            assert covered == share
        assert torch.equal(pieces.host_storage, whole.host_storage)
        assert (pieces.host_storage == 7.0).sum() == 0


def test_a_bucket_range_zeroes_its_gaps_and_writes_every_element(monkeypatch):
    """``bucket_range`` writes each element once, starting from torch.empty: the
    alignment gaps come out 0 and every element its tensor's, for ranges that start and
    end inside entries and gaps."""
    from distzo.engine import bucket_layouts, bucket_range
    from distzo.models import family_for

    model = skeleton(build("llama", seed=2).config, torch.float32)
    built, (resident, _) = bucket_layouts(model, family_for(model).blocks())
    source = RandomWeights(5)
    for layout in [resident, *(layout for layout, _ in built)]:
        expected = torch.zeros(layout.numel)
        for e in layout.entries:
            expected[e.offset : e.offset + e.numel] = source.tensor(
                e.names, e.shape, torch.float32
            ).reshape(-1)
        gaps = layout.numel - sum(e.numel for e in layout.entries)
        edges = sorted({0, layout.numel, *(e.offset + e.numel + 1 for e in layout.entries)})
        with monkeypatch.context() as m:
            m.setattr(torch, "empty", _nan_filled(torch.empty))
            got = [bucket_range(layout, source, lo, hi) for lo, hi in zip(edges, edges[1:])]
        assert torch.equal(torch.cat(got), expected), f"gaps: {gaps}"


def test_a_device_draw_read_by_ranges_is_its_tensor_and_is_let_go_at_the_end():
    """A range read of a device draw (the CPU standing in) keeps the tensor where it was
    drawn only while its ranges are read: the ranges are the tensor's, and once the last
    element is read the source holds nothing (on a GPU: no device memory after a build)."""
    name, shape = ("model.layers.0.mlp.up_proj.weight",), (50, 90)
    source = RandomWeights(3, std=0.5, draw_dtype=torch.float32, draw_device="cpu")
    whole = source.tensor(name, shape, torch.float16)
    ranges = [
        source.tensor_range(name, shape, torch.float16, lo, lo + 1000)
        for lo in range(0, 4000, 1000)
    ]
    assert source._last is not None  # 500 elements left to read
    ranges.append(source.tensor_range(name, shape, torch.float16, 4000, 4500))
    assert source._last is None
    assert torch.equal(torch.cat(ranges), whole.view(-1))


@pytest.mark.parametrize("mode", ["offload", "resident"])
def test_an_engine_built_from_a_source_reads_it_a_chunk_at_a_time(monkeypatch, mode):
    """The engine fills every block (host copy or device master) ``LOAD_CHUNK`` elements
    at a time, never a block of float32 on the host at once: each read at most a chunk,
    and the built weights those of a build that read each block whole."""
    from distzo.engine import build as engine_build
    from distzo.engine import layouts

    config = build("llama", seed=2).config
    low_bit = "bf16" if mode == "offload" else "fp32"  # a bf16 host copy, rounded on load
    zo = ZOConfig(device="cpu", seed=0, mode=mode, transfer_dtype=low_bit)

    def weights() -> dict[str, torch.Tensor]:
        model = skeleton(config, torch.float32)
        return ZOEngine(model, zo, weights=RandomWeights(4)).named_parameters()

    monkeypatch.setattr(layouts, "LOAD_CHUNK", 1 << 30)  # the stores' and the sides' reads
    whole = weights()
    asked: list[int] = []

    read = layouts.bucket_range

    def spy(layout, source, lo, hi):
        asked.append(hi - lo)
        return read(layout, source, lo, hi)

    monkeypatch.setattr(engine_build, "bucket_range", spy)
    monkeypatch.setattr(layouts, "bucket_range", spy)
    monkeypatch.setattr(layouts, "LOAD_CHUNK", 1000)
    chunked = weights()
    assert asked and max(asked) <= 1000 and sum(asked) > 10_000
    assert whole.keys() == chunked.keys()
    assert all(torch.equal(whole[k], chunked[k]) for k in whole)


class ThreadGather:
    """The node's all-gather for ranks run as threads of one process: each rank posts its
    piece, and every rank copies every piece, in rank order, into its output (what a
    process group's gather does), so the sliced stores' gathers can be checked in seconds."""

    def __init__(self, ranks: int) -> None:
        import threading

        self.barrier = threading.Barrier(ranks, timeout=30)
        self.posted: dict[int, torch.Tensor] = {}

    def of(self, rank: int):
        gather = self

        class Comm:
            def all_gather_into(self, output, own, group):
                gather.posted[rank] = own.clone()
                gather.barrier.wait()
                pieces = [gather.posted[m] for m in range(len(gather.posted))]
                gather.barrier.wait()  # every rank has read the pieces before the next posts
                output.copy_(torch.cat(pieces))

            def wait(self, work):
                pass

        return Comm()


@pytest.mark.parametrize("chunks", [1, 3])
def test_a_sliced_upload_gathers_each_rank_s_pieces_back_into_the_whole_block(chunks):
    """Every rank holds only its pieces of a block; after the upload's gathers each holds
    the whole block in order, and a changed block offloaded and uploaded again is the
    changed block: the pieces a rank stores are the pieces the gather puts in its place."""
    import threading

    from distzo.offload import BucketLayout, Shard, StreamedBlocks

    layout, _ = BucketLayout.build([(("w",), torch.nn.Parameter(torch.zeros(10, 100)))])
    block = torch.randn(layout.numel, generator=torch.Generator().manual_seed(0))
    gather = ThreadGather(2)
    stores = [
        StreamedBlocks(
            [layout],
            torch.device("cpu"),
            1,
            shard=Shard(None, rank, 2, gather.of(rank)),
            chunks=chunks,
        )
        for rank in range(2)
    ]

    def on_every_rank(work) -> None:
        threads = [threading.Thread(target=work, args=(s,)) for s in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    for store in stores:
        store.load_block(0, block)
    on_every_rank(lambda s: s.upload(0))
    for store in stores:
        assert torch.equal(store.device_bucket(0), block)
    for store in stores:
        store.device_bucket(0).mul_(2)  # every rank applies the same update
        store.offload(0)
        store.slots.buffers[0].zero_()
    on_every_rank(lambda s: s.upload(0))
    for store in stores:
        assert torch.equal(store.device_bucket(0), 2 * block)


@pytest.mark.parametrize("ranks, chunks", [(1, 1), (2, 3), (4, 2)])
def test_a_rank_s_link_bytes_are_the_bytes_its_upload_copies_from_the_host(ranks, chunks):
    """``link_bytes`` (the metrics' link rate, the benchmarks' bytes per step) counts what
    this rank copies over the host link: its own pieces, so the ranks of a sliced node
    add up to the padded block once, not once each."""
    from distzo.offload import BucketLayout, Shard, StreamedBlocks

    layout, _ = BucketLayout.build([(("w",), torch.nn.Parameter(torch.zeros(7, 100)))])
    copied = []
    for rank in range(ranks):
        store = StreamedBlocks(
            [layout],
            torch.device("cpu"),
            1,
            transfer_dtype=torch.bfloat16,
            shard=Shard(None, rank, ranks),
            chunks=chunks,
            read_only=True,
        )
        host_bytes = sum(h_hi - h_lo for (h_lo, h_hi), _ in store._pieces(0)) * 2  # bf16
        assert store.link_bytes(0) == host_bytes
        copied.append(host_bytes)
    assert sum(copied) == store.padded[0] * 2


@pytest.mark.parametrize("start, stop", [(0, 35), (3, 17), (7, 8), (20, 35), (5, 5)])
def test_a_safetensors_range_read_mid_row_is_that_range_of_the_tensor(tmp_path, start, stop):
    # a sliced rank's share starts and ends wherever the block's pieces fall, mid-row too
    full = torch.arange(35, dtype=torch.float32).reshape(5, 7)
    save_file({"w": full}, str(tmp_path / "model.safetensors"))
    source = open_checkpoint(tmp_path)
    got = source.tensor_range(("w",), (5, 7), torch.float32, start, stop)
    assert torch.equal(got, full.reshape(-1)[start:stop])


def test_a_bin_range_read_converts_only_that_range(tmp_path):
    # a rank reads fp16 weights into float32 masters a chunk at a time: converting the whole
    # tensor for each chunk cost a float32 copy of it per chunk (OPT-30B's fc1: 0.8 GB, ~50x)
    full = torch.randn(64, 48).half()
    torch.save({"w": full}, tmp_path / "pytorch_model.bin")
    source = open_checkpoint(tmp_path)
    for start, stop in ((0, 100), (1000, 1537), (3000, 3072)):
        got = source.tensor_range(("w",), (64, 48), torch.float32, start, stop)
        assert torch.equal(got, full.reshape(-1)[start:stop].float())
        assert got.untyped_storage().nbytes() == (stop - start) * 4


def test_a_bin_range_read_in_its_own_dtype_is_a_view_of_the_mapped_file(tmp_path):
    # fp16 weights into fp16 host blocks: the range is copied once, into its block; a copy
    # here as well would allocate every chunk twice
    full = torch.randn(64, 48).half()
    torch.save({"w": full}, tmp_path / "pytorch_model.bin")
    source = open_checkpoint(tmp_path)
    got = source.tensor_range(("w",), (64, 48), torch.float16, 1000, 1537)
    assert torch.equal(got, full.reshape(-1)[1000:1537])
    assert got.untyped_storage().nbytes() == full.numel() * 2  # the mapped tensor's storage
