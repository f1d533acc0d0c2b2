"""Adapters through peft (LoRA, LoRA-FA): only the adapter is perturbed and updated, the
base streams read-only, g is the adapter's directional derivative, and the export is a
peft adapter (or a merged model) that gives the engine's logits."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from distzo import ZOConfig, ZOEngine
from distzo.adapters.peft_adapters import (
    AdapterSpec,
    AdapterWeights,
    attach_adapter,
    merge_problem,
)
from distzo.data import CountingTask
from distzo.export.hf_model import export_model
from distzo.models.weights import SafetensorsWeights, skeleton
from distzo.runtime.option_names import named_as_flags
from tests.helpers.engines import BATCHINGS, FLOAT64, Counting, engine_for, frozen_values, train
from tests.helpers.launch import train_in_process
from tests.helpers.models import adapted, base_model, build, random_batch, tiny_opt


@pytest.mark.parametrize("family", ["opt", "llama"])
@pytest.mark.parametrize("method", ["lora", "lora-fa"])
def test_only_the_adapter_changes(family, method):
    model = adapted(family, method)
    engine = engine_for(model, mode="offload", num_slots=2)
    trained_names = set(engine.canonical_names)
    assert all(".lora_B." in n or (method == "lora" and ".lora_A." in n) for n in trained_names)
    assert {n.split(".")[-4] for n in trained_names} == {
        "q_proj",
        "v_proj",
    }  # peft's default targets
    before_base, before = frozen_values(engine), engine.named_parameters()
    train(engine, model.config.vocab_size)
    after_base, after = frozen_values(engine), engine.named_parameters()
    assert before_base.keys() == after_base.keys()
    # the base, bit for bit
    assert all(torch.equal(before_base[n], after_base[n]) for n in before_base)
    assert all(not torch.equal(before[n], after[n]) for n in before)  # every trained tensor moved


@pytest.mark.parametrize("method", ["lora", "lora-fa"])
def test_offload_equals_resident_bitwise(method):
    runs = []
    for mode in ("resident", "offload"):
        model = adapted("opt", method)
        engine = engine_for(model, mode=mode, num_slots=2, num_queries=2)
        runs.append(
            (
                [
                    (r.loss_plus, r.loss_minus, r.projected_grads)
                    for r in train(engine, model.config.vocab_size)
                ],
                engine.named_parameters(),
            )
        )
    (trajectory_a, params_a), (trajectory_b, params_b) = runs
    assert trajectory_a == trajectory_b
    assert all(torch.equal(params_a[n], params_b[n]) for n in params_a)


@pytest.mark.parametrize("method", ["lora", "lora-fa"])
def test_projected_gradient_is_the_adapters_directional_derivative(method):
    # B starts at 0, where dL/dA is 0: take one step first so both halves carry gradient.
    model = adapted("opt", method, dtype=torch.float64, **FLOAT64)
    engine = engine_for(model, eps=1e-6, lr=0.0, weight_decay=0.0, seed=2)
    with torch.no_grad():  # a non-zero B, the same in the engine and the reference
        for e in engine.block_layouts[0].entries:
            engine.store.device_bucket(0)[e.offset : e.offset + e.numel] = 0.05
    batch = random_batch(model.config.vocab_size, pad="right", seed=4)
    (g,) = engine.step(batch).projected_grads

    reference = adapted("opt", method, dtype=torch.float64, **FLOAT64)
    values = dict(engine.stream_parameters()) | dict(engine.stream_parameters(frozen=True))
    with torch.no_grad():
        for name, p in reference.get_base_model().named_parameters():
            p.copy_(values[name])
    reference.eval()
    reference(**batch).loss.backward()
    grads = {n: p.grad for n, p in reference.get_base_model().named_parameters() if p.requires_grad}
    assert set(grads) == set(engine.canonical_names)
    dot = 0.0
    for i, layout in enumerate(engine.block_layouts):
        z = engine.noise.full(layout.numel, step=0, block_id=i + 1, query=0)
        for e in layout.entries:
            dot += (z[e.offset : e.offset + e.numel].view(e.shape) * grads[e.names[0]]).sum().item()
    assert engine.resident_layout.numel == 0  # LoRA trains nothing outside the blocks
    assert abs(g) > 1e-3
    # float64: the central difference's truncation at eps 1e-6
    assert g == pytest.approx(dot, rel=1e-5)


@pytest.mark.parametrize("transfer_dtype", ["fp32", "bf16", "fp8"])
def test_the_base_goes_up_once_per_step_and_never_back(transfer_dtype):
    model = adapted("opt", "lora-fa")
    engine = engine_for(model, mode="offload", num_slots=2, transfer_dtype=transfer_dtype)
    counts = Counting(engine.base_store)
    results = train(engine, model.config.vocab_size, steps=3)
    assert dict(counts.uploads) == {0: 3, 1: 3, 2: 3} and not counts.offloads
    assert all(torch.isfinite(torch.tensor(r.loss)) for r in results)
    full = engine_for(adapted("opt", "lora-fa"), mode="offload")
    assert engine.host_bytes * {"fp32": 1, "bf16": 2, "fp8": 4}[transfer_dtype] == full.host_bytes
    # read-only, a low-bit base stays in its wire format in the slots too (no float32 slots
    # beside them): the passes' scratch upcasts it
    store = engine.base_store
    assert store.unpacked is None and store.slots.buffers[0].dtype == store.transfer_dtype


def test_a_low_bit_base_is_rounded_once_to_nearest():
    model = adapted("opt", "lora-fa")
    reference = {n: p.detach().clone() for n, p in model.get_base_model().named_parameters()}
    engine = engine_for(model, mode="offload", transfer_dtype="bf16")
    train(engine, model.config.vocab_size, steps=2)
    in_blocks = {e.names[0] for layout in engine.base_layouts for e in layout.entries}
    for name, value in frozen_values(engine).items():
        rounded = (
            reference[name].to(torch.bfloat16).float() if name in in_blocks else reference[name]
        )
        # blocks rest in bf16; the resident modules stay fp32
        assert torch.equal(value, rounded), name


def test_a_skeleton_streamed_from_safetensors_equals_the_materialised_model(tmp_path):
    base_model("llama", seed=1).save_pretrained(tmp_path)
    spec = AdapterSpec("lora-fa", r=4, alpha=8)
    whole = attach_adapter(AutoModelForCausalLM.from_pretrained(tmp_path), spec, seed=5)
    shell = attach_adapter(
        skeleton(LlamaConfig.from_pretrained(tmp_path), torch.float32), spec, seed=5
    )
    a = engine_for(whole, mode="offload")
    b = engine_for(shell, AdapterWeights(SafetensorsWeights(tmp_path), shell), mode="offload")
    ra, rb = train(a, 64), train(b, 64)
    assert [r.projected_grads for r in ra] == [r.projected_grads for r in rb]
    pa, pb = a.named_parameters(), b.named_parameters()
    assert all(torch.equal(pa[n], pb[n]) for n in pa)


@pytest.mark.parametrize("family", ["opt", "llama"])
@pytest.mark.parametrize("method", ["lora", "lora-fa"])
def test_the_exported_adapter_loads_with_peft_and_gives_the_engines_logits(
    tmp_path, family, method
):
    from peft import PeftModel

    model = adapted(family, method)
    engine = engine_for(model, mode="offload")
    train(engine, model.config.vocab_size)
    batch = random_batch(model.config.vocab_size, pad="right", seed=9)
    logits, _ = engine.forward(batch)
    export_model(engine, tmp_path / "adapter")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    loaded = PeftModel.from_pretrained(base_model(family), tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    mask = batch["attention_mask"].bool()
    assert torch.allclose(theirs[mask], logits[mask], atol=1e-5)

    export_model(engine, tmp_path / "merged", merge_adapter=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        plain = merged(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.allclose(plain[mask], logits[mask], atol=1e-5)


def test_a_state_dict_holds_the_adapter_only_and_resumes_the_same_trajectory():
    full = engine_for(adapted("opt", "lora"), mode="offload")
    results = train(full, 64, steps=6)
    first = engine_for(adapted("opt", "lora"), mode="offload")
    train(first, 64, steps=3)
    state = first.state_dict()
    assert all(".lora_" in n for n in state["params"])
    resumed = engine_for(adapted("opt", "lora"), mode="resident")
    resumed.load_state_dict(state)
    rest = [resumed.step(random_batch(64, pad="left", seed=i)) for i in range(3, 6)]
    assert [r.projected_grads for r in rest] == [r.projected_grads for r in results[3:]]


def test_bad_adapter_options_are_one_line_errors():
    with pytest.raises(ValueError, match="drop --lora-dropout"):
        AdapterSpec("lora", dropout=0.1).validate()
    for alpha in (0.0, -1.0, float("nan")):  # scaling alpha / r: 0 trains an adapter of no effect
        with pytest.raises(ValueError, match="--lora-alpha must be > 0"):
            AdapterSpec("lora", alpha=alpha).validate()
    # a stray comma names no module of its own; commas alone name none at all
    assert AdapterSpec.parse_targets(" q_proj,,v_proj, ") == ("q_proj", "v_proj")
    with pytest.raises(ValueError, match="--lora-targets names no module"):
        AdapterSpec("lora", targets=AdapterSpec.parse_targets(" , ")).validate()
    with pytest.raises(ValueError) as refused:
        attach_adapter(base_model("opt"), AdapterSpec("lora", targets=("no_such_proj",)), seed=0)
    # peft's line said to "check the target modules": the model's own linear layers are named
    assert str(refused.value) == (
        "--peft lora: Target modules {'no_such_proj'} not found in the base model. Please "
        "check the target modules and try again. (set --lora-targets to some of the model's "
        "linear layers: k_proj, v_proj, q_proj, out_proj, fc1, fc2)"
    )


def test_lora_on_an_embedding_is_refused_in_one_line():
    # peft keeps an embedding's factors in lora_embedding_A/B: once a bare KeyError
    with pytest.raises(ValueError, match=r"embed_tokens \(Embedding\) is not a linear layer"):
        attach_adapter(base_model("llama"), AdapterSpec("lora", targets=("embed_tokens",)), 0)
    # the module peft would adapt is the one named: "norm" is model.norm, not the
    # input_layernorm whose name merely ends in it
    with pytest.raises(ValueError, match=r"^--lora-targets: model.norm \(LlamaRMSNorm\) is not"):
        attach_adapter(base_model("llama"), AdapterSpec("lora", targets=("q_proj", "norm")), 0)


def test_a_lora_on_a_tied_head_is_refused_before_training_not_merged_away(tmp_path):
    """A tied export holds one table for the embedding and the head: the head's delta was
    dropped, and the merged model gave the untrained logits."""
    spec = AdapterSpec("lora", r=4, alpha=8, targets=("q_proj", "lm_head"))
    model = attach_adapter(base_model("llama", tie_word_embeddings=True), spec, seed=5)
    assert merge_problem(model) is not None
    engine = engine_for(model, mode="resident")
    with pytest.raises(ValueError, match="lm_head would change model.embed_tokens.weight too"):
        export_model(engine, tmp_path / "merged", merge_adapter=True)
    assert not (tmp_path / "merged").exists() and not (tmp_path / "merged.tmp").exists()
    untied = attach_adapter(base_model("llama"), spec, seed=5)
    assert merge_problem(untied) is None
    line = train_in_process(
        ["--peft", "lora", "--lora-targets", "q_proj,lm_head", "--merge-adapter"]
        + ["--max-steps", "1", "--output-dir", str(tmp_path / "run")]
    )
    assert line.returncode == 2 and "lm_head would change" in line.stderr.splitlines()[-1]
    assert not (tmp_path / "run" / "seedlog.jsonl").exists()


@pytest.mark.parametrize(
    "option", [{"use_dora": True}, {"lora_bias": True}, {"modules_to_save": ["lm_head"]}]
)
def test_an_adapter_the_merge_cannot_fold_is_refused(tmp_path, option):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], **option)
    engine = engine_for(get_peft_model(base_model("llama"), config), mode="resident")
    with pytest.raises(ValueError, match=f"the adapter's {next(iter(option))} is not merged"):
        export_model(engine, tmp_path / "merged", merge_adapter=True)
    export_model(engine, tmp_path / "adapter")  # the adapter itself exports
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize(
    "mode, transfer_dtype, compute_dtype",
    [
        ("offload", "fp32", "fp32"),
        ("offload", "bf16", "fp32"),
        ("offload", "bf16", "bf16"),
        ("resident", "fp32", "fp32"),
        ("resident", "fp32", "bf16"),
    ],
)
def test_the_memory_plan_counts_what_an_adapter_engine_allocates(
    mode, transfer_dtype, compute_dtype
):
    from distzo.job.memory_plan import plan_memory

    config = ZOConfig(
        device="cpu",
        mode=mode,
        transfer_dtype=transfer_dtype,
        compute_dtype=compute_dtype,
        num_slots=2,
    )
    plan = plan_memory(adapted("llama", "lora-fa"), config, 1, False, batch=2, seq=8)
    engine = ZOEngine(adapted("llama", "lora-fa"), config)
    # the passes' copy of the frozen resident modules; a master in another dtype is on the host
    resident_base = engine._resident_base_compute.nbytes
    allocated = (
        engine.resident_master.nbytes
        + engine.resident_scratch.nbytes
        + engine.block_scratch.nbytes
        + engine.device_bytes
        + resident_base
        + engine.noise.device_bytes
    )
    assert plan.device_bytes == allocated
    assert plan.host_bytes == engine.host_bytes
    assert plan.parameters == engine.num_parameters and plan.frozen_parameters == engine.num_frozen
    assert engine.rounding_noise is None  # a read-only base never rounds


@pytest.mark.parametrize("family", ["opt", "llama"])
@pytest.mark.parametrize("batching", list(BATCHINGS))
@pytest.mark.parametrize(
    "method, dtype, rel", [("lora-fa", torch.float32, 1e-6), ("lora", torch.float64, 1e-12)]
)
def test_batched_passes_equal_the_sequential_passes(family, batching, method, dtype, rel):
    runs = []
    for flags in ({}, BATCHINGS[batching]):
        model = adapted(family, method, dtype=dtype)
        engine = engine_for(model, mode="offload", num_slots=2, num_queries=3, **flags)
        assert (engine.pass_scratch is not None) == bool(flags)
        runs.append((train(engine, model.config.vocab_size, steps=3), engine.named_parameters()))
    (sequential, params_a), (batched, params_b) = runs
    for a, b in zip(sequential, batched):
        assert (a.loss_plus, a.loss_minus) == pytest.approx((b.loss_plus, b.loss_minus), rel=rel)
        assert a.projected_grads == pytest.approx(b.projected_grads, rel=1e4 * rel, abs=1e4 * rel)
    for name in params_a:
        assert torch.allclose(params_a[name], params_b[name], rtol=1e4 * rel, atol=1e4 * rel), name


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_fzoos_perturbed_passes_batched_equal_them_one_by_one(family):
    # --batch-queries: FZOO's N perturbed LoRA-FA passes in one forward, the unperturbed one
    # alone; fp64, so batched and sequential agree to rounding
    runs = []
    for flags in ({}, dict(batch_queries=True)):
        model = adapted(family, "lora-fa", dtype=torch.float64)
        engine = engine_for(
            model, mode="offload", estimator="fzoo", num_queries=4, noise="rademacher", **flags
        )
        if flags:
            assert [len(g) for g in engine.pass_groups_of(engine.passes)] == [4, 1]
        runs.append((train(engine, model.config.vocab_size, steps=3), engine.named_parameters()))
    (sequential, params_a), (batched, params_b) = runs
    for a, b in zip(sequential, batched):
        assert a.losses == pytest.approx(b.losses, rel=1e-12)
        assert a.projected_grads == pytest.approx(b.projected_grads, rel=1e-8, abs=1e-8)
    for name in params_a:
        assert torch.allclose(params_a[name], params_b[name], rtol=1e-10, atol=1e-12), name


def test_batched_passes_need_an_adapter():
    """Named as the caller set them: ZOConfig's fields from Python, the flags in the job."""
    with pytest.raises(ValueError, match="^dual_forward and batch_queries need an adapter"):
        engine_for(base_model("opt"), dual_forward=True)
    with named_as_flags(), pytest.raises(ValueError, match=r"\(--peft lora, lora-fa or prefix\)"):
        engine_for(base_model("opt"), dual_forward=True)


class ReadCounting:
    """A weight source that counts the bytes read from it."""

    def __init__(self, inner):
        self.inner, self.read = inner, 0

    def tensor(self, names, shape, dtype):
        out = self.inner.tensor(names, shape, dtype)
        self.read += out.nbytes
        return out

    def tensor_range(self, names, shape, dtype, start, stop):
        out = self.inner.tensor_range(names, shape, dtype, start, stop)
        self.read += out.nbytes
        return out


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            AdapterSpec("lora", r=4, targets=("q_proj", "lm_head")),
            "^dual_forward and batch_queries batch .* lm_head.lora_A.default.weight is trained "
            "outside them; leave its module out of target_modules, or drop dual_forward and "
            "batch_queries$",
        ),
        (
            None,
            r"^dual_forward and batch_queries need an adapter that trains only inside the "
            r"blocks \(peft: lora, lora-fa or prefix\); drop them for full tuning$",
        ),
    ],
    ids=["lora_on_the_head", "full_tuning"],
)
def test_batched_passes_are_refused_before_the_checkpoint_is_read(tmp_path, spec, message):
    # the refusal names what cannot be batched, before a byte of a large base is read
    base_model("llama").save_pretrained(tmp_path)
    shell = skeleton(LlamaConfig.from_pretrained(tmp_path), torch.float32)
    if spec is None:
        weights = ReadCounting(SafetensorsWeights(tmp_path))
    else:
        shell = attach_adapter(shell, spec, seed=5)
        weights = ReadCounting(AdapterWeights(SafetensorsWeights(tmp_path), shell))
    with pytest.raises(ValueError, match=message):
        engine_for(shell, weights, dual_forward=True)
    assert weights.read == 0


def test_a_lora_bias_is_named_when_batched_passes_refuse_it():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        base_model("opt"),
        LoraConfig(r=4, lora_bias=True, target_modules=["q_proj"], task_type="CAUSAL_LM"),
    )
    with pytest.raises(ValueError, match=r"lora_B\.default\.weight of a Linear with a bias"):
        engine_for(model, dual_forward=True)


@pytest.mark.parametrize("flags", [dict(dual_forward=True), dict(batch_queries=True)])
def test_the_memory_plan_counts_the_batched_passes_scratch(flags):
    from distzo.job.memory_plan import plan_memory

    config = ZOConfig(device="cpu", mode="offload", num_slots=2, num_queries=3, **flags)
    plan = plan_memory(adapted("llama", "lora"), config, 1, False, batch=2, seq=8)
    engine = ZOEngine(adapted("llama", "lora"), config)
    tuning = engine.tuning
    assert tuning.pass_scratch is not None and tuning.base_scratch is not None
    allocated = (
        engine.resident_master.nbytes
        + engine.resident_scratch.nbytes
        + engine.block_scratch.nbytes
        + tuning.base_store.device_bytes
        + tuning.trained_store.device_bytes
        + tuning.base_scratch.nbytes
        + tuning.pass_scratch.nbytes  # the passes' adapters side by side
        + engine._resident_base_compute.nbytes
        + engine.noise.device_bytes
    )
    assert engine.device_bytes == allocated - (
        engine.resident_master.nbytes
        + engine.resident_scratch.nbytes
        + engine.block_scratch.nbytes
        + engine._resident_base_compute.nbytes
        + engine.noise.device_bytes
    )
    assert plan.device_bytes == allocated


@pytest.mark.parametrize("method", ["lora-fa", "prefix"])
def test_a_batched_forward_stopped_half_way_leaves_no_pass_weights_behind(method, monkeypatch):
    # Ctrl-C (or a caught out-of-memory) inside a batched group, then the documented
    # recovery, load_state_dict: the next forward reads the adapter, not a pass's weights
    def made():
        model = attach_adapter(
            base_model("opt"), AdapterSpec(method, r=4, alpha=8, prefix_init="random"), seed=5
        )
        return engine_for(model, dual_forward=True, batch_queries=True, num_queries=2)

    vocab = base_model("opt").config.vocab_size
    batch = random_batch(vocab, pad="left", seed=1)
    a, b = made(), made()
    for engine in (a, b):
        engine.step(random_batch(vocab, pad="left", seed=0))
    saved = a.state_dict()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(b.blocks[1], "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        b.step(random_batch(vocab, pad="left", seed=5))
    monkeypatch.undo()
    b.load_state_dict(saved)
    assert torch.equal(b.forward(batch)[0], a.forward(batch)[0])


def test_a_partly_frozen_plain_model_trains_the_rest_and_exports_everything(tmp_path):
    model = base_model("opt")
    model.model.decoder.embed_tokens.requires_grad_(False)  # tied with the head: both stay
    frozen = model.model.decoder.embed_tokens.weight.detach().clone()
    engine = engine_for(model, mode="offload")
    assert engine.frozen_base and not any("embed_tokens" in n for n in engine.canonical_names)
    train(engine, model.config.vocab_size, steps=2)
    batch = random_batch(model.config.vocab_size, seed=3)
    logits, _ = engine.forward(batch)
    export_model(engine, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(loaded.model.decoder.embed_tokens.weight, frozen)
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=batch["input_ids"]).logits, logits, atol=1e-5)


def adapted_family(family: str):
    """A LoRA-FA adapter on the tiny OPT, Llama or a ``CONFIGS`` family."""
    if family in ("opt", "llama"):
        return adapted(family, "lora-fa")
    return attach_adapter(build(family), AdapterSpec("lora-fa", r=4, alpha=8), seed=5)


@pytest.mark.parametrize(
    "family, pad, dtype",
    [
        ("opt", "right", torch.float32),
        ("llama", "right", torch.float32),
        # left padding: the loss reads the last pad position, where the eager attention the
        # program once forced (all keys masked: a softmax over every key, the target's too)
        # and the engine's sdpa differ; g was 54% off on Llama, 6% on Gemma 3
        ("llama", "left", torch.float32),
        ("gemma3", "left", torch.float32),
        ("gpt2", "left", torch.float32),
        ("gemma2", "left", torch.float32),  # an eager model: the program's attention is eager too
        ("mixtral", "left", torch.float32),  # routed experts: grouped_mm, traced as the engine runs
        # a model held in 16 bits (an on-device one) was refused: the program's float32
        # arithmetic met its bf16 activations in a bmm. B rounds as the engine's does
        ("llama", "left", torch.bfloat16),
    ],
)
def test_the_exported_training_step_equals_the_engines_steps(family, pad, dtype, tmp_path):
    from distzo.export.training_step import TrainingStep, save_training_step, step_keys

    model = adapted_family(family).to(dtype)
    engine = engine_for(model, mode="resident", weight_decay=0.1, lr=1e-2)
    batches = [random_batch(model.config.vocab_size, pad=pad, seed=20 + i) for i in range(3)]
    # the runtime has a test of its own
    files = save_training_step(engine, batches[0], tmp_path, pte=False)
    program = torch.export.load(files[0]).module()  # read back from disk
    step_module = TrainingStep(engine)  # the eager module: the same arithmetic
    results = []
    for batch in batches:
        results.append(engine.step(batch))
    previous, scale, shrink = step_keys(engine, 0), torch.tensor(0.0), torch.tensor(1.0)
    for t, (batch, result) in enumerate(zip(batches, results)):
        keys = step_keys(engine, t)
        args = (
            batch["input_ids"],
            batch["attention_mask"],
            batch["labels"],
            previous,
            scale,
            shrink,
            keys,
        )
        plus, minus = program(*args)
        eager_plus, eager_minus = step_module(*args)
        assert (plus.item(), minus.item()) == pytest.approx(
            (result.loss_plus, result.loss_minus), rel=1e-6
        ), t
        assert (eager_plus.item(), eager_minus.item()) == pytest.approx(
            (plus.item(), minus.item()), rel=1e-6
        )
        # the host's part: g of the step (the engine's, so that the two runs stay on one
        # trajectory: g divides a loss difference by 2 eps, magnifying float rounding)
        previous, scale = keys, torch.tensor(-result.lr * result.projected_grad)
        shrink = torch.tensor(1 - result.lr * engine.config.weight_decay)
    # B after the updates of steps 0 and 1 (step 2's is the next call's first act, and the
    # engine's pending one); a 16-bit B, rounded by each op as the engine's, is its bits
    for i in range(len(engine.block_layouts)):
        for held in (program.get_buffer(f"adapter_{i}"), step_module.get_buffer(f"adapter_{i}")):
            if dtype == torch.float32:
                assert torch.allclose(held, engine.store.device_bucket(i), rtol=1e-5, atol=1e-7)
            else:
                assert torch.equal(held, engine.store.device_bucket(i)), i
            assert held.abs().sum() > 0


def test_a_float64_mixtures_step_exports_with_the_engines_losses():
    """A float64 mixture computes its experts one at a time (grouped_mm takes no float64),
    a loop over the routed experts that torch.export refused ("Could not guard on
    data-dependent expression"): the program computes them batched, the engine's losses."""
    from distzo.export.training_step import export_training_step, step_keys

    model = adapted_family("mixtral").to(torch.float64)
    engine = engine_for(model, mode="resident")
    batch = random_batch(model.config.vocab_size, pad="left", seed=60)
    program = export_training_step(engine, batch).module()
    keys = step_keys(engine, 0)
    plus, minus = program(*batch.values(), keys, torch.tensor(0.0), torch.tensor(1.0), keys)
    result = engine.step(batch)
    assert (plus.item(), minus.item()) == pytest.approx(
        (result.loss_plus, result.loss_minus), rel=1e-6
    )


def test_a_step_exported_from_labels_that_are_the_input_ids_reads_both():
    """A batch whose labels are its input_ids tensor (the command's own example batch)
    was traced as one input: the program embedded its labels and ignored its input_ids,
    and a label of -100 was an IndexError."""
    from distzo.export.training_step import export_training_step, step_keys

    model = adapted("llama", "lora-fa")
    engine = engine_for(model, mode="resident")
    ids = torch.ones(4, 12, dtype=torch.int64)
    example = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    program = export_training_step(engine, example).module()
    batch = random_batch(model.config.vocab_size, pad="left", seed=50)
    batch["labels"][:, :6] = -100  # a prompt left out of the loss
    keys = step_keys(engine, 0)
    plus, minus = program(*batch.values(), keys, torch.tensor(0.0), torch.tensor(1.0), keys)
    result = engine.step(batch)
    assert (plus.item(), minus.item()) == pytest.approx(
        (result.loss_plus, result.loss_minus), rel=1e-6
    )


def test_a_step_exported_after_training_continues_the_engines_run():
    """The export flushes the pending update into the program's adapter: the first call
    takes update_scale 0 (the engine's last g there applied it twice: losses 2e-4 off)."""
    from distzo.export.training_step import export_training_step, step_keys

    model = adapted("llama", "lora-fa")
    engine = engine_for(model, mode="resident", weight_decay=0.1, lr=1e-2)
    batches = [random_batch(model.config.vocab_size, pad="left", seed=40 + i) for i in range(4)]
    for batch in batches[:2]:
        engine.step(batch)
    program = export_training_step(engine, batches[0]).module()
    previous, scale, shrink = step_keys(engine, 1), torch.tensor(0.0), torch.tensor(1.0)
    for t, batch in enumerate(batches[2:], start=2):
        result, keys = engine.step(batch), step_keys(engine, t)
        plus, minus = program(*batch.values(), previous, scale, shrink, keys)
        assert (plus.item(), minus.item()) == pytest.approx(
            (result.loss_plus, result.loss_minus), rel=1e-6
        ), t
        previous, scale = keys, torch.tensor(-result.lr * result.projected_grad)
        shrink = torch.tensor(1 - result.lr * engine.config.weight_decay)


def test_the_exported_training_step_refuses_another_estimator():
    from distzo.export.training_step import TrainingStep

    model = adapted("opt", "lora-fa")
    engine = engine_for(model, estimator="fzoo", num_queries=2, noise="rademacher")
    with pytest.raises(ValueError) as refused:
        TrainingStep(engine)
    assert str(refused.value) == (
        "the exportable step is SPSA's two passes (P-RGE's on-device step); the engine runs "
        "estimator fzoo"
    )
    for optimizer in ("momentum", "adam"):  # its moments would be dropped without a word
        engine = engine_for(adapted("opt", "lora-fa"), optimizer=optimizer)
        with pytest.raises(ValueError, match=f"ZO-SGD's update .* runs optimizer {optimizer}"):
            TrainingStep(engine)


def test_the_exported_training_step_refuses_a_prefix_naming_the_fix():
    """It was the batched passes' error, telling a prefix engine to train a prefix or to
    drop --dual-forward, an option the step does not have."""
    from distzo.export.training_step import TrainingStep

    spec = AdapterSpec("prefix", r=4, alpha=8, prefix_init="random")
    engine = engine_for(attach_adapter(base_model("llama"), spec, seed=5), mode="resident")
    with pytest.raises(ValueError) as refused:
        TrainingStep(engine)
    assert str(refused.value) == (
        "the exportable step trains a LoRA adapter's factors (P-RGE's on-device step), not "
        "a prefix: attach --peft lora-fa (or lora)"
    )


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_exported_training_step_refuses_a_low_precision_compute(dtype):
    """The program computes in the model's dtype: a bf16 engine's step was accepted, then
    its first call died inside the model (float != BFloat16)."""
    from distzo.export.training_step import TrainingStep

    engine = engine_for(adapted("opt", "lora-fa"), mode="resident", compute_dtype=dtype)
    with pytest.raises(ValueError) as refused:
        TrainingStep(engine)
    assert str(refused.value) == (
        f"the exportable step computes in the model's dtype (torch.float32); the engine "
        f"computes in {dtype}: build it with compute_dtype auto"
    )


def test_the_step_command_exports_a_16_bit_model_as_one():
    """The command built every model in float32 and had no --dtype: an on-device model's
    bf16 step could not be written."""
    from distzo.export.training_step import _lora_fa_engine, _parser

    args = _parser().parse_args(["--out", "unused", "--dtype", "bf16"])
    engine = _lora_fa_engine(args)
    assert {layout.dtype for layout in engine.block_layouts} == {torch.bfloat16}
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}


def test_a_gpt2_training_step_lowers_for_the_edge(tmp_path):
    """GPT-2's Conv1D views its input: a lowered SDPA once handed it a strided one."""
    pytest.importorskip("executorch")
    from executorch.exir import to_edge

    from distzo.export.training_step import export_training_step

    model = attach_adapter(build("gpt2"), AdapterSpec("lora-fa", r=4, alpha=8), seed=5)
    engine = engine_for(model, mode="resident")
    program = export_training_step(engine, random_batch(64, batch=1, seq=8))
    assert to_edge(program).exported_program() is not None


def test_the_training_step_names_an_adapter_outside_the_blocks():
    from distzo.export.training_step import TrainingStep

    spec = AdapterSpec("lora-fa", r=4, alpha=8, targets=("q_proj", "lm_head"))
    engine = engine_for(attach_adapter(base_model("llama"), spec, seed=5), mode="resident")
    with pytest.raises(ValueError, match=r"inside the blocks only.*\(lm_head\.lora_B"):
        TrainingStep(engine)


def test_the_training_step_runs_under_the_executorch_runtime(tmp_path):
    """Gemma 3 (sliding and full layers, a soft-capped head), left-padded batches."""
    pytest.importorskip("executorch")
    from executorch.runtime import Runtime

    from distzo.export.training_step import save_training_step, step_keys

    model = adapted_family("gemma3")
    engine = engine_for(model, mode="resident", weight_decay=0.1, lr=1e-2)
    batches = [random_batch(model.config.vocab_size, pad="left", seed=30 + i) for i in range(3)]
    files = save_training_step(engine, batches[0], tmp_path)
    assert [f.name for f in files] == ["step.pt2", "step.pte"]
    method = Runtime.get().load_program(str(files[1])).load_method("forward")
    previous, scale, shrink = step_keys(engine, 0), torch.tensor(0.0), torch.tensor(1.0)
    for t, batch in enumerate(batches):
        result = engine.step(batch)
        keys = step_keys(engine, t)
        plus, minus = method.execute(
            [
                batch["input_ids"],
                batch["attention_mask"],
                batch["labels"],
                previous,
                scale,
                shrink,
                keys,
            ]
        )
        # steps 1 and 2 read the B that the runtime's own buffers updated
        assert (plus.item(), minus.item()) == pytest.approx(
            (result.loss_plus, result.loss_minus), rel=1e-6
        ), t
        previous, scale = keys, torch.tensor(-result.lr * result.projected_grad)
        shrink = torch.tensor(1 - result.lr * engine.config.weight_decay)


def test_a_model_wrapped_by_the_user_with_get_peft_model_trains_through_the_python_api(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    model = get_peft_model(
        base_model("llama"), LoraConfig(r=2, lora_alpha=4, target_modules=["o_proj", "down_proj"])
    )
    engine = engine_for(model, mode="offload")
    assert {n.split(".")[-4] for n in engine.canonical_names} == {"o_proj", "down_proj"}
    train(engine, 64, steps=2)
    batch = random_batch(64, pad="right", seed=2)
    logits, _ = engine.forward(batch)
    export_model(engine, tmp_path)
    loaded = PeftModel.from_pretrained(base_model("llama"), tmp_path).eval()
    with torch.no_grad():
        theirs = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    mask = batch["attention_mask"].bool()
    assert torch.allclose(theirs[mask], logits[mask], atol=1e-5)


def test_an_adapter_under_another_name_than_default_is_refused_before_a_step():
    """Under adapter_name="mine" the export was a bare KeyError after training, and the
    merged export silently left the trained adapter out (logits 0.49 off)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])
    model = get_peft_model(base_model("llama"), config, adapter_name="mine")
    with pytest.raises(ValueError, match=r"adapters are \['mine'\]; .* named 'default'"):
        engine_for(model, mode="offload")
    model.add_adapter("default", config)  # a second adapter: which one trains is ambiguous
    with pytest.raises(ValueError, match=r"adapters are \['default', 'mine'\]"):
        engine_for(model, mode="offload")


def test_export_step_command_writes_a_step_and_its_keys(tmp_path):
    import sys

    from safetensors.torch import load_file

    from tests.helpers.launch import child_env, main_in_process, run_python

    out = tmp_path / "step"
    cmd = [
        sys.executable,
        "-m",
        "distzo.export.training_step",
        "--out",
        str(out),
        "--batch",
        "2",
        "--seq",
        "8",
        "--no-pte",
        "--steps",
        "3",
    ]
    proc = run_python(cmd, child_env(), 300)  # a fork server's child where it can be
    assert proc.returncode == 0, proc.stderr[-2000:]
    # torch.export.save warns of (and means to refuse) an archive named other than *.pt2
    assert "Expect archive file" not in proc.stderr
    keys = load_file(str(out / "keys.safetensors"))["keys"]
    assert keys.shape == (3, 2, 2)  # steps x blocks of the tiny OPT x key words
    # as readable as the program beside it (safetensors alone made it private)
    assert (out / "keys.safetensors").stat().st_mode == (out / "step.pt2").stat().st_mode
    step = torch.export.load(out / "step.pt2").module()
    batch = random_batch(64, batch=2, seq=8, seed=1)

    def losses(ids):
        mask, labels, zero, one = batch["attention_mask"], batch["labels"], 0.0, 1.0
        return step(ids, mask, labels, keys[0], torch.tensor(zero), torch.tensor(one), keys[0])

    plus, minus = losses(batch["input_ids"])
    assert torch.isfinite(plus) and plus != minus
    # the program reads its input_ids (traced from labels that were the same tensor, it
    # read the labels in their place)
    rolled, _ = losses(batch["input_ids"].roll(1, dims=1))
    assert rolled != plus
    assert sorted(p.name for p in out.iterdir()) == ["keys.safetensors", "step.pt2"]
    bad_args = [str(tmp_path / "bad") if a == str(out) else a for a in cmd[3:-1]]
    bad = main_in_process("distzo.export.training_step", [*bad_args, "0"])
    assert bad.returncode == 2 and "--steps must be >= 1" in bad.stderr
    # an existing --out is replaced only when asked, and its staging folder is nobody's
    again = main_in_process("distzo.export.training_step", cmd[3:])
    assert again.returncode == 2 and again.stderr.strip() == (
        f"error: --out {out}: the folder exists; add --overwrite to replace it, or give "
        "another --out"
    )
    (out / "stale.pte").write_text("old")
    replaced = main_in_process("distzo.export.training_step", [*cmd[3:], "--overwrite"])
    assert replaced.returncode == 0, replaced.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["keys.safetensors", "step.pt2"]
    assert torch.equal(load_file(str(out / "keys.safetensors"))["keys"], keys)
    assert not (tmp_path / "step.tmp").exists()


def test_the_keys_of_many_steps_are_the_engines():
    """The command's keys.safetensors (``steps_keys``, array ops) holds each block's key of
    each step as the engine draws it, at steps past 10**6 and 2**31 too."""
    from distzo.export.training_step import step_keys, steps_keys

    engine = engine_for(adapted("opt", "lora-fa"), mode="resident", seed=11)
    steps = [0, 1, 5, 10**6, 2**31 + 3, 2**32 + 1]
    keys = steps_keys(engine, np.array(steps))
    blocks = range(1, len(engine.block_layouts) + 1)
    assert keys.dtype == torch.int64
    assert keys.tolist() == [[list(engine.noise.key(t, b, 0)) for b in blocks] for t in steps]
    assert torch.equal(step_keys(engine, 2**31 + 3), keys[4])


def test_export_step_command_refuses_pte_without_executorch(tmp_path, monkeypatch, caplog):
    """``--pte`` with executorch missing exited 0 with no step.pte and not a word said; the
    default skipped it as silently, though docs/peft.md says the command writes it."""
    import sys

    from tests.helpers.launch import main_in_process

    for name in ("executorch", "executorch.exir"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    out = tmp_path / "step"
    proc = main_in_process("distzo.export.training_step", ["--out", str(out), "--pte"])
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
        "error: --pte needs the executorch package ("
    )
    assert "pip install 'distzo[executorch]', or pass --no-pte" in proc.stderr
    assert not out.exists() and not (tmp_path / "step.tmp").exists()
    from distzo.export.training_step import _pte_wanted

    with caplog.at_level("WARNING", logger="distzo.export.training_step"):
        assert _pte_wanted(None) is False
    assert "step.pte not written: the executorch package is not installed" in caplog.text
    caplog.clear()
    assert _pte_wanted(False) is False and not caplog.text


def test_export_step_command_reads_a_multimodal_checkpoints_text_model(tmp_path):
    """transformers' own loader read a Gemma 3 multimodal checkpoint as a config without
    positions (an AttributeError's traceback); the command now reads --model as a training
    run does: the text model, its frozen weights the checkpoint's."""
    from safetensors.torch import load_file

    from tests.helpers.launch import main_in_process
    from tests.helpers.models import save_multimodal

    source = save_multimodal(tmp_path / "mm")
    out = tmp_path / "step"
    args = ["--model", str(source), "--out", str(out), "--seq", "8", "--no-pte", "--steps", "2"]
    proc = main_in_process("distzo.export.training_step", args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    held = torch.export.load(out / "step.pt2").state_dict
    stored = load_file(str(source / "model.safetensors"))
    for name in ("embed_tokens.weight", "layers.1.self_attn.q_proj.base_layer.weight"):
        checkpoint_name = "language_model.model." + name.replace(".base_layer", "")
        assert torch.equal(held["model.model." + name], stored[checkpoint_name]), name


def test_export_step_command_says_a_missing_model_folder_is_missing(tmp_path):
    """It was transformers' 'Repo id must be in the form ...' (a path taken for a hub name)."""
    from tests.helpers.launch import main_in_process

    missing = tmp_path / "nope"
    proc = main_in_process(
        "distzo.export.training_step", ["--model", str(missing), "--out", str(tmp_path / "o")]
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"error: --model {missing}: no such directory (a local model is a Hugging Face folder)"
    )


def test_lora_fa_with_batched_queries_lowers_the_default_tasks_loss():
    """The default task (tiny random OPT, counting) with LoRA-FA at 4 queries, all 8 passes
    of a step as one: benchmarks/RESULTS.md records 4.18 -> 3.97 in 900 steps, the time
    the full-parameter default takes for its 2000; 300 steps must show the way down."""
    model = attach_adapter(tiny_opt(seed=0), AdapterSpec("lora-fa"), seed=0)
    task = CountingTask(model.config.vocab_size, seed=0)
    evaluation = task.batch(64)
    evaluation["labels"] = evaluation["input_ids"]
    engine = ZOEngine(
        model,
        ZOConfig(
            lr=1.0,
            eps=1e-3,
            seed=0,
            device="cpu",
            num_queries=4,
            dual_forward=True,
            batch_queries=True,
        ),
    )
    before = engine.forward(evaluation)[1].item()
    for _ in range(300):
        engine.step(task.batch(16))
    after = engine.forward(evaluation)[1].item()
    assert after < before - 0.1, (before, after)  # without learning it stays at log(64) = 4.16


@pytest.mark.parametrize("pert, rank, warned", [(2, 0, True), (2, 1, False), (1, 0, False)])
def test_batched_passes_that_pert_ranks_split_apart_are_said_to_batch_nothing(
    caplog, pert, rank, warned
):
    """With 2 pert ranks each runs one of a query's two passes: --dual-forward batched
    nothing, and the run did not say so. Said once, by rank 0: every rank said it, the
    same line twice in a 2-rank launch's log."""
    from distzo.dist import Collectives, LaunchEnv, ParallelContext, ParallelDims

    parallel = ParallelContext(
        LaunchEnv(rank=rank, world_size=pert, local_world_size=pert),
        ParallelDims(1, pert),
        comm=Collectives(torch.device("cpu")),
    )
    config = ZOConfig(device="cpu", seed=0, dual_forward=True)
    with caplog.at_level("WARNING", logger="distzo.engine.parts"):
        engine = ZOEngine(adapted("llama", "lora-fa"), config, parallel=parallel)
    assert len(engine.passes) == 2 // pert
    said = [r.getMessage() for r in caplog.records if "batch" in r.getMessage()]
    assert said == (
        [
            "dual_forward batches nothing: the 2 pert ranks split a step's passes so that each "
            "runs 1, none of them batchable together; use fewer pert ranks (a smaller pert, a "
            "larger dp) to batch them"
        ]
        if warned
        else []
    )


def test_a_run_is_told_of_unbatched_passes_by_its_flags(caplog):
    """The command line's user set --dual-forward and --pert, not dual_forward and pert."""
    from distzo.dist import Collectives, LaunchEnv, ParallelContext, ParallelDims
    from distzo.runtime.option_names import named_as_flags

    parallel = ParallelContext(
        LaunchEnv(rank=0, world_size=2, local_world_size=2),
        ParallelDims(1, 2),
        comm=Collectives(torch.device("cpu")),
    )
    config = ZOConfig(device="cpu", seed=0, dual_forward=True, batch_queries=True)
    with caplog.at_level("WARNING", logger="distzo.engine.parts"), named_as_flags():
        ZOEngine(adapted("llama", "lora-fa"), config, parallel=parallel)
    said = [r.getMessage() for r in caplog.records if "batch nothing" in r.getMessage()]
    assert len(said) == 1
    assert said[0].startswith("--dual-forward and --batch-queries batch nothing: ")
    assert said[0].endswith("(a smaller --pert, a larger --dp) to batch them")


def test_an_adapter_with_no_trained_elements_is_refused_before_a_step():
    """A frozen model whose only trainable tensor is empty trained nothing, each step's
    projected gradient 0, without a word: refused when the engine is built."""
    model = tiny_opt()
    model.requires_grad_(False)
    model.model.decoder.layers[0].self_attn.q_proj.empty = torch.nn.Parameter(torch.zeros(0))
    with pytest.raises(ValueError, match="the adapter has no trainable parameters"):
        ZOEngine(model, ZOConfig(device="cpu"))


def test_batched_passes_fit_the_widest_blocks_adapter_not_the_first():
    """peft's ``layers_to_transform`` leaves block 0 without an adapter: the passes'
    scratch sized by the first block's held none of the others' factors."""
    from peft import LoraConfig, get_peft_model

    losses = []
    for dual in (False, True):
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], layers_to_transform=[1])
        model = get_peft_model(base_model("llama", 0, torch.float32), lora)
        engine = ZOEngine(model, ZOConfig(device="cpu", seed=0, dual_forward=dual))
        assert [layout.numel for layout in engine.block_layouts] == [0, 256, 0]
        losses.append(engine.step(random_batch(64)).losses)
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


@pytest.mark.parametrize("method", ["lora", "prefix"])
def test_attaching_an_adapter_prints_no_deprecation_of_peft_s_own_calls(method):
    # transformers 5 deprecates is_gradient_checkpointing, which peft reads when it wraps a
    # model: every --peft run printed its FutureWarning, about code no user can change
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adapted("opt", method=method)
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [
        str(w.message) for w in caught
    ]
