"""Prefix tuning through peft: each streamed block carries its own columns of peft's prefix
table, the blockwise forward equals peft's own, g is the prefix's directional derivative,
the init is MeZO's (the model's keys and values of random tokens) and the export is peft's."""

import warnings

import pytest
import torch
from peft import PeftModel, PrefixTuningConfig, get_peft_model
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from distzo.adapters.peft_adapters import ADAPTER_NAME, AdapterSpec, AdapterWeights, attach_adapter
from distzo.export.hf_model import export_model
from distzo.models.family import CACHE_KEYWORD
from distzo.models.registry import family_for
from distzo.models.weights import SafetensorsWeights, skeleton
from tests.helpers.engines import BATCHINGS, FLOAT64, engine_for, frozen_values, train
from tests.helpers.models import base_model, random_batch


def prefixed(family, init="random", length=3, dtype=torch.float32, **overrides):
    return attach_adapter(
        base_model(family, dtype=dtype, **overrides),
        AdapterSpec("prefix", prefix_length=length, prefix_init=init),
        seed=5,
    )


def peft_table(model):
    return model.prompt_encoder[ADAPTER_NAME].embedding.weight


@pytest.mark.parametrize("family", ["opt", "llama", "gpt2"])
@pytest.mark.parametrize("pad", [None, "left"])
def test_the_blockwise_forward_with_a_prefix_is_pefts_forward(family, pad):
    if family == "gpt2":
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(
            GPT2Config(
                vocab_size=64,
                n_embd=32,
                n_layer=3,
                n_head=4,
                n_positions=64,
                bos_token_id=1,
                eos_token_id=2,
            )
        )
        model = attach_adapter(
            base, AdapterSpec("prefix", prefix_length=3, prefix_init="random"), seed=5
        )
    else:
        model = prefixed(family)
    model.eval()
    batch = random_batch(64, pad=pad, seed=1) if pad else random_batch(64, seed=1)
    mask = batch["attention_mask"] if pad else None
    with torch.no_grad(), warnings.catch_warnings():
        theirs = model(input_ids=batch["input_ids"], attention_mask=mask).logits
        plain = model.get_base_model()(input_ids=batch["input_ids"], attention_mask=mask).logits
        warnings.simplefilter("error", FutureWarning)  # the prefix's cache: no deprecated keyword
        ours, _ = family_for(model.get_base_model()).forward(batch["input_ids"], mask)
    assert torch.equal(ours, theirs)
    assert not torch.allclose(plain, theirs, atol=1e-2)  # the prefix does change the function


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_only_the_prefix_changes_and_offload_equals_resident_bitwise(family):
    runs = []
    for mode in ("resident", "offload"):
        engine = engine_for(prefixed(family, init="real"), mode=mode, num_slots=2, num_queries=2)
        assert all(n.endswith(".prefix_tuning.key_values") for n in engine.canonical_names)
        assert len(engine.canonical_names) == 3 and engine.resident_layout.numel == 0
        before_base, before = frozen_values(engine), engine.named_parameters()
        results = train(engine, 64, steps=3)
        after_base, after = frozen_values(engine), engine.named_parameters()
        # the base, bit for bit
        assert all(torch.equal(before_base[n], after_base[n]) for n in before_base)
        # every layer's prefix moved
        assert all(not torch.equal(before[n], after[n]) for n in before)
        runs.append(([r.projected_grads for r in results], after))
    (grads_a, params_a), (grads_b, params_b) = runs
    assert grads_a == grads_b
    assert all(torch.equal(params_a[n], params_b[n]) for n in params_a)


def test_projected_gradient_is_the_prefixs_directional_derivative():
    model = prefixed("opt", dtype=torch.float64, **FLOAT64)
    engine = engine_for(model, eps=1e-6, lr=0.0, weight_decay=0.0, seed=2)
    batch = random_batch(model.config.vocab_size, pad="right", seed=4)
    (g,) = engine.step(batch).projected_grads

    # peft's own forward and autograd, through its table (the blocks' prefixes side by side)
    reference = prefixed("opt", dtype=torch.float64, **FLOAT64).eval()
    table = peft_table(reference)
    table.requires_grad_(True)
    values = engine.named_parameters()
    width = table.shape[1] // len(engine.blocks)
    with torch.no_grad():
        for i, layout in enumerate(engine.block_layouts):
            table[:, i * width : (i + 1) * width] = values[layout.entries[0].names[0]].reshape(
                table.shape[0], -1
            )
    reference(**batch).loss.backward()
    dot = 0.0
    for i, layout in enumerate(engine.block_layouts):
        z = engine.noise.full(layout.numel, step=0, block_id=i + 1, query=0)
        (entry,) = layout.entries
        grad = table.grad[:, i * width : (i + 1) * width].reshape(entry.shape)
        dot += (z[entry.offset : entry.offset + entry.numel].view_as(grad) * grad).sum().item()
    assert abs(g) > 1e-4
    assert g == pytest.approx(dot, rel=1e-5)


def test_the_real_init_is_each_layers_keys_and_values_of_random_tokens():
    model = prefixed("llama", init="real", length=4)
    tokens = model.get_base_model().model.layers[0].prefix_tuning.init_tokens
    engine = engine_for(model, mode="offload")
    with torch.no_grad():
        cache = getattr(base_model("llama")(input_ids=tokens, use_cache=True), CACHE_KEYWORD)
    values = engine.named_parameters()
    # MeZO: model(random tokens, use_cache=True).past_key_values
    for i, layer in enumerate(cache.layers):
        kv = values[f"model.layers.{i}.prefix_tuning.key_values"]
        assert torch.allclose(kv[:, 0], layer.keys[0].transpose(0, 1), atol=1e-6)
        assert torch.allclose(kv[:, 1], layer.values[0].transpose(0, 1), atol=1e-6)


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_the_exported_prefix_loads_with_peft_and_gives_the_engines_logits(tmp_path, family):
    if family == "llama":  # wrapped by the user: peft's own random init, through the Python API
        model = get_peft_model(
            base_model("llama"), PrefixTuningConfig(num_virtual_tokens=2, task_type="CAUSAL_LM")
        )
    else:
        model = prefixed(family, init="real")
    engine = engine_for(model, mode="offload")
    train(engine, 64)
    batch = random_batch(64, pad="right", seed=9)
    logits, _ = engine.forward(batch)
    export_model(engine, tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(base_model(family), tmp_path / "adapter").eval()
    assert loaded.peft_config[ADAPTER_NAME].peft_type == "PREFIX_TUNING"
    with torch.no_grad():
        theirs = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    mask = batch["attention_mask"].bool()
    assert torch.allclose(theirs[mask], logits[mask], atol=1e-5)
    with pytest.raises(ValueError, match="a prefix cannot be merged"):
        export_model(engine, tmp_path / "merged", merge_adapter=True)


@pytest.mark.parametrize("batching", ["dual", "both"])
def test_batched_passes_with_a_prefix_equal_the_sequential_passes(batching):
    runs = []
    for flags in ({}, BATCHINGS[batching]):
        engine = engine_for(
            prefixed("llama", dtype=torch.float64),
            mode="offload",
            num_slots=2,
            num_queries=2,
            **flags,
        )
        runs.append((train(engine, 64, steps=3), engine.named_parameters()))
    (sequential, params_a), (batched, params_b) = runs
    for a, b in zip(sequential, batched):
        assert (a.loss_plus, a.loss_minus) == pytest.approx((b.loss_plus, b.loss_minus), rel=1e-12)
    for name in params_a:
        assert torch.allclose(params_a[name], params_b[name], rtol=1e-8, atol=1e-8), name


@pytest.mark.parametrize("init", ["real", "random"])
def test_a_skeleton_streamed_from_safetensors_equals_the_materialised_model(tmp_path, init):
    base_model("llama", seed=1).save_pretrained(tmp_path)
    # real: one pass over the streamed blocks; random: peft's N(0, 1), from the run seed
    # on a skeleton as on the whole model (a run on the default model and its replay)
    spec = AdapterSpec("prefix", prefix_length=3, prefix_init=init)
    whole = attach_adapter(AutoModelForCausalLM.from_pretrained(tmp_path), spec, seed=5)
    shell = attach_adapter(
        skeleton(LlamaConfig.from_pretrained(tmp_path), torch.float32), spec, seed=5
    )
    a = engine_for(whole, mode="offload")
    b = engine_for(shell, AdapterWeights(SafetensorsWeights(tmp_path), shell), mode="offload")
    assert [r.projected_grads for r in train(a, 64)] == [r.projected_grads for r in train(b, 64)]
    pa, pb = a.named_parameters(), b.named_parameters()
    assert all(torch.equal(pa[n], pb[n]) for n in pa)


def test_a_prefix_counts_in_the_position_limit():
    engine = engine_for(prefixed("llama", length=4, max_position_embeddings=16))
    with pytest.raises(
        ValueError, match="after a 4-token prefix exceed the model's max_position_embeddings 16"
    ):
        engine.step(random_batch(64, seq=14, seed=0))


def test_a_prefix_of_other_layers_than_the_models_blocks_is_refused():
    """A user's PrefixTuningConfig(num_layers=5) on a model of 3 blocks: peft sizes its
    table for 5, and the blocks would train the first 3 layers' columns of it silently."""
    config = PrefixTuningConfig(num_virtual_tokens=3, task_type="CAUSAL_LM", num_layers=5)
    model = get_peft_model(base_model("opt"), config)
    with pytest.raises(ValueError, match="the prefix has 5 layers but the model streams 3 blocks"):
        engine_for(model)
