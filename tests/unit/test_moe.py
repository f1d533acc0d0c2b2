"""Mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE): their checkpoints store the
experts one a key, which the streamed read builds into the model's fused parameters as
transformers does; the memory plan counts them; LoRA goes on their linear layers only.
(Blockwise forward and offload == resident: ``test_model_families``; a per-expert checkpoint
streamed as from_pretrained loads it: ``test_streaming_load``; the export loading back:
``test_export``, under save_pretrained's keys: ``test_export_original_format``; two sliced
ranks: ``test_dist_launch``.)"""

import pytest
import torch
from safetensors.torch import load_file, save_file

from distzo import ZOConfig, ZOEngine
from distzo.adapters.peft_adapters import AdapterSpec, attach_adapter
from distzo.export.hf_model import export_model
from distzo.job.memory_plan import plan_memory
from distzo.models.config_file import model_size
from distzo.models.shapes import shape_config
from distzo.models.weights import open_checkpoint, skeleton
from tests.helpers.launch import train_in_process
from tests.helpers.models import CONFIGS, build, random_batch

GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"


def test_experts_stored_fused_stream_as_stored(tmp_path):
    """A checkpoint whose keys are the model's own names (the fused experts, as
    ``save_pretrained(save_original_format=False)`` writes them) is read as it is."""
    original = build("qwen3_moe", seed=3)
    original.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in original.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    source = open_checkpoint(tmp_path)
    engine = ZOEngine(
        skeleton(original.config, torch.float32), ZOConfig(device="cpu"), weights=source
    )
    assert not source.converted
    params = engine.named_parameters()
    assert all(torch.equal(params[k], v) for k, v in state.items() if k in params)


@pytest.mark.parametrize("start, stop", [(0, 40), (100, 1100), (4000, 4096)])
def test_a_range_of_experts_stored_one_a_key_is_that_range_of_the_fused_tensor(
    tmp_path, start, stop
):
    """A sliced rank reads its piece of a fused parameter built from per-expert keys."""
    original = build("mixtral", seed=4)
    original.save_pretrained(tmp_path)
    source = open_checkpoint(tmp_path)
    source.convert_keys(skeleton(original.config, torch.float32))
    whole = original.state_dict()[GATE_UP]
    piece = source.tensor_range((GATE_UP,), tuple(whole.shape), torch.float32, start, stop)
    assert torch.equal(piece, whole.reshape(-1)[start:stop])


def test_experts_ten_and_up_stack_after_expert_nine_as_from_pretrained_loads_them(tmp_path):
    """Per-expert keys sort as text with expert 10 before expert 2: the fused parameters
    stack them in the experts' order (transformers' natural sort), as from_pretrained does."""
    from transformers import AutoModelForCausalLM

    config = CONFIGS["mixtral"]()
    config.num_local_experts = 12
    torch.manual_seed(5)
    original = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    original.save_pretrained(tmp_path)
    source = open_checkpoint(tmp_path)
    source.convert_keys(skeleton(original.config, torch.float32))
    state = original.state_dict()
    assert {name.rsplit(".", 1)[-1] for name in source.converted} == {"gate_up_proj", "down_proj"}
    for name in source.converted:
        whole = state[name]
        built = source.tensor_range((name,), tuple(whole.shape), torch.float32, 0, whole.numel())
        assert torch.equal(built, whole.reshape(-1)), name


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_a_fused_parameter_is_built_once_until_another_is_read(tmp_path, monkeypatch, fmt):
    """Either format keeps a fused parameter built from its experts for its next range,
    and lets it go when a stored parameter's range is read."""
    from distzo.models import converted_keys

    original = build("mixtral", seed=4)
    original.save_pretrained(tmp_path)
    if fmt == "bin":  # written by hand: transformers 5 writes safetensors
        torch.save(load_file(str(tmp_path / "model.safetensors")), tmp_path / "pytorch_model.bin")
        (tmp_path / "model.safetensors").unlink()
    source = open_checkpoint(tmp_path)
    source.convert_keys(skeleton(original.config, torch.float32))
    builds = []
    build_of = converted_keys.Converted.build
    monkeypatch.setattr(
        converted_keys.Converted, "build", lambda c, read: builds.append(c) or build_of(c, read)
    )
    whole = original.state_dict()
    fused, stored = (whole[GATE_UP].reshape(-1), whole["model.embed_tokens.weight"].reshape(-1))

    def piece(name: str, start: int, stop: int) -> torch.Tensor:
        return source.tensor_range((name,), tuple(whole[name].shape), torch.float32, start, stop)

    assert torch.equal(piece(GATE_UP, 0, 40), fused[:40])
    assert torch.equal(piece(GATE_UP, 40, 80), fused[40:80])
    assert len(builds) == 1
    assert torch.equal(piece("model.embed_tokens.weight", 8, 24), stored[8:24])
    assert torch.equal(piece(GATE_UP, 80, 120), fused[80:120])
    assert len(builds) == 2


def test_a_sliced_rank_builds_each_fused_parameter_once_for_all_its_chunks(tmp_path, monkeypatch):
    """A sliced rank reads its pieces of a block a chunk at a time: each chunk touching a
    fused parameter built it anew from its experts (8 chunks: 24 builds of 4 parameters
    over 2 ranks, each a layer's experts read from disk), and the rank's pieces are the
    whole block's."""
    from distzo.engine import bucket_layouts, bucket_range
    from distzo.models import converted_keys, family_for
    from distzo.offload import Shard, StreamedBlocks

    original = build("qwen3_moe", seed=5)
    original.save_pretrained(tmp_path)
    model = skeleton(original.config, torch.float32)
    source = open_checkpoint(tmp_path)
    source.convert_keys(model)
    builds = []
    build_of = converted_keys.Converted.build
    monkeypatch.setattr(
        converted_keys.Converted, "build", lambda c, read: builds.append(c) or build_of(c, read)
    )
    built, _ = bucket_layouts(model, family_for(model).blocks())
    layouts = [layout for layout, _ in built]
    whole = original.state_dict()
    for rank in range(2):
        shard = Shard(None, rank, 2)
        blocks = StreamedBlocks(layouts, torch.device("cpu"), 1, shard=shard, chunks=8)
        for i, layout in enumerate(layouts):
            blocks.load_block_ranges(
                i, lambda lo, hi, layout=layout: bucket_range(layout, source, lo, hi)
            )
            expected = torch.zeros(blocks.padded[i])
            for e in layout.entries:
                expected[e.offset : e.offset + e.numel] = whole[e.names[0]].reshape(-1)
            for (h_lo, h_hi), (s_lo, s_hi) in blocks._pieces(i):
                assert torch.equal(blocks.master(i)[h_lo:h_hi], expected[s_lo:s_hi])
    assert len(builds) <= 2 * len(source.converted)


@pytest.mark.parametrize(
    "dropped, says",
    [
        (
            "up_proj",
            f"{GATE_UP} is built from its tensors 4 mlp.experts.*.gate_proj.weight and 3 "
            "mlp.experts.*.up_proj.weight, which do not fit together (Sizes of tensors must "
            "match except in dimension 1. Expected 4 in dimension 0 but got 3 for tensor number "
            "1 in the list)",
        ),
        (
            "down_proj",
            "checkpoint tensor model.layers.1.mlp.experts.down_proj (built from 3 tensors: "
            "model.layers.1.mlp.experts.0.down_proj.weight, ...) has shape (3, 32, 16), the "
            "model expects (4, 32, 16) from {config}",
        ),
    ],
)
def test_a_checkpoint_short_of_an_expert_is_refused_before_any_tensor_is_read(
    tmp_path, dropped, says
):
    build("qwen3_moe").save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    state = load_file(str(file))
    del state[f"model.layers.1.mlp.experts.3.{dropped}.weight"]
    save_file(state, str(file), metadata={"format": "pt"})
    run = tmp_path / "run"
    proc = train_in_process(["--model", str(tmp_path), "--output-dir", str(run)])
    assert proc.returncode == 2 and not run.exists()
    says = says.format(config=tmp_path / "config.json")
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {file}: {says}: the weights and config.json are of different models; "
        "download or copy the model again"
    )


def test_a_float64_mixture_steps_on_experts_that_compute_in_float64():
    """transformers' default experts (torch's grouped matmul) take no float64: --dtype fp64
    failed at the first forward ("Expected mat_a to be Float32, BFloat16 or Float16")."""
    engine = ZOEngine(build("qwen3_moe", dtype=torch.float64), ZOConfig(device="cpu", seed=0))
    result = engine.step(random_batch(64, seed=1))
    assert result.loss_plus != result.loss_minus


@pytest.mark.parametrize(
    "name, options",
    [
        ("qwen2_moe", {}),
        # the other estimators, a low-bit link and micro-batches: each module perturbed
        # before every run of it, an expert's for each micro-batch
        (
            "mixtral",
            dict(
                estimator="fzoo",
                num_queries=3,
                noise="rademacher",
                transfer_dtype="fp8",
                grad_accum=2,
            ),
        ),
        ("olmoe", dict(estimator="lozo", noise="lowrank", optimizer="adam", transfer_dtype="bf16")),
    ],
    ids=["qwen2_moe", "mixtral-fzoo-fp8-micro-batches", "olmoe-lozo-adam-bf16"],
)
def test_a_mixture_perturbed_module_by_module_steps_as_the_whole_block(name, options):
    """--perturb-scope module: the routed experts (every expert of a layer one module) and
    the shared expert take their turns in the scratch as any module does."""
    runs = []
    for scope in ("block", "module"):
        config = ZOConfig(lr=1e-2, eps=1e-2, seed=0, device="cpu", perturb_scope=scope, **options)
        engine = ZOEngine(build(name), config)
        losses = [engine.step(random_batch(64, pad="left", seed=s)).loss for s in range(3)]
        engine.flush()
        runs.append((losses, engine.named_parameters()))
    (losses, weights), (module_losses, module_weights) = runs
    assert module_losses == losses and len(set(losses)) == 3
    assert all(torch.equal(module_weights[k], v) for k, v in weights.items())


def test_the_memory_plan_counts_every_expert():
    model = build("qwen2_moe")
    plan = plan_memory(model, ZOConfig(device="cpu"), 1, False, batch=2, seq=8)
    assert plan.parameters == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts > plan.parameters / 3


@pytest.mark.parametrize(
    "name, billions", [("qwen3-30b-a3b", 30.5), ("qwen3-235b-a22b", 235.1), ("mixtral-8x7b", 46.7)]
)
def test_a_named_mixture_has_its_published_size(name, billions):
    """--model-config of a mixture (and the plan of it, python -m distzo.job.plan_report)
    has every expert of the released model."""
    assert round(model_size(shape_config(name), name).parameters / 1e9, 1) == billions


@pytest.mark.parametrize("dense", [dict(decoder_sparse_step=2), dict(mlp_only_layers=[0, 2])])
def test_a_mixture_with_dense_layers_between_is_counted_as_built(dense):
    """Some of a Qwen-MoE's layers may be dense (``decoder_sparse_step``,
    ``mlp_only_layers``): counted from one and two layers as if all were alike, the
    pre-build size check took every layer for the first one's kind."""
    config = CONFIGS["qwen3_moe"]()
    config.num_hidden_layers = 4
    for field, value in dense.items():
        setattr(config, field, value)
    model = skeleton(config, torch.float32)
    size = model_size(config, "--model m")
    assert size.parameters == sum(p.numel() for p in model.parameters())
    assert size.modules == sum(1 for _ in model.modules())


@pytest.mark.parametrize("name, targets", [("mixtral", None), ("qwen3_moe", ("q_proj", "v_proj"))])
def test_a_lora_adapter_on_a_mixture_loads_with_peft_and_gives_the_engines_logits(
    tmp_path, name, targets
):
    """Mixtral with peft's default targets (which peft itself, left to pick them, turned
    into none: "No `target_modules` passed"), Qwen3-MoE with named ones."""
    from peft import PeftModel

    model = attach_adapter(build(name), AdapterSpec("lora", r=4, alpha=8, targets=targets), 5)
    engine = ZOEngine(model, ZOConfig(device="cpu", lr=1e-2, eps=1e-3, seed=1))
    for step in range(2):
        engine.step(random_batch(64, pad="left", seed=step))
    batch = random_batch(64, pad="right", seed=9)
    logits, _ = engine.forward(batch)
    export_model(engine, tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(build(name), tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    mask = batch["attention_mask"].bool()
    assert torch.allclose(theirs[mask], logits[mask], atol=1e-5)


def test_lora_on_the_experts_is_one_line(tmp_path):
    """Experts are 3-D parameters, not linear layers: peft's refusal printed the module over
    several lines, the first of them "Target module Qwen3MoeExperts(" alone."""
    build("qwen3_moe").save_pretrained(tmp_path / "model")
    args = ["--model", str(tmp_path / "model"), "--peft", "lora", "--lora-targets", "experts"]
    proc = train_in_process([*args, "--output-dir", str(tmp_path / "run")])
    assert (proc.returncode, proc.stderr.strip().splitlines()[-1]) == (
        2,
        "error: --lora-targets: model.layers.0.mlp.experts (Qwen3MoeExperts) is not a linear "
        "layer; --peft lora trains LoRA on linear layers only (such as q_proj,v_proj)",
    )


@pytest.mark.parametrize(
    "targets, named",
    [
        (("q_proj", "experts"), "model.layers.0.mlp.experts (Qwen3MoeExperts)"),
        (("q_proj", "model.layers.1.mlp.experts"), "model.layers.1.mlp.experts (Qwen3MoeExperts)"),
        (("v_proj", "gate"), "model.layers.0.mlp.gate (Qwen3MoeTopKRouter)"),
    ],
)
def test_a_target_that_is_not_linear_is_refused_before_peft_adapts_any(targets, named):
    """Checked by peft's own matcher, not read out of peft's message: the module named is
    the one targeted (the first module of its kind was named, layer 0's for layer 1's), and
    the model is left as it was (peft had wrapped the projections before it in LoRA)."""
    model = build("qwen3_moe")
    with pytest.raises(ValueError) as refused:
        attach_adapter(model, AdapterSpec("lora", targets=targets), seed=0)
    assert str(refused.value) == (
        f"--lora-targets: {named} is not a linear layer; --peft lora trains LoRA on linear "
        "layers only (such as q_proj,v_proj)"
    )
    assert not any(type(m).__module__.startswith("peft.") for m in model.modules())
