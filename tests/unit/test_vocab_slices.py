"""The resident sides in the module scratch, their vocabulary matrices read a slice of rows
at a time (``perturb_scope="module"``): the block scope's trajectory bit for bit on CPU,
in a scratch no larger than a block's largest module needs."""

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from distzo import ZOConfig, ZOEngine
from distzo.engine.parts import describe
from distzo.engine.resident_sides import EMBEDDING, HEAD, WHOLE
from distzo.engine.vocab_slices import MIN_ROWS, shared_scratch_numel, sliced_sides, vocab_modules
from distzo.job.memory_plan import plan_memory
from tests.helpers.models import CONFIGS, random_batch, tiny_opt
from tests.unit.test_module_scratch import OPTIONS, assert_same

VOCAB = 701  # rows: many slices of a tiny model's module scratch, the last one short


def model_of(name):
    """A tiny model whose vocabulary matrices are several times its largest module."""
    if name == "opt":  # tied head, learned positions
        return tiny_opt(seed=0, vocab_size=VOCAB)
    if name == "opt-projected":  # project_in / project_out around a narrower embedding
        return tiny_opt(seed=0, vocab_size=VOCAB, word_embed_proj_dim=16)
    torch.manual_seed(0)
    config = CONFIGS[name.removesuffix("-bias")]()
    config.vocab_size = VOCAB
    model = AutoModelForCausalLM.from_config(config).eval()
    if name.endswith("-bias"):  # an untied head with a bias, in the head's fixed places
        model.lm_head = nn.Linear(config.hidden_size, VOCAB, bias=True)
    return model


def batches():
    """Steps' batches: 8 x 40 tokens (two HEAD_CHUNKs of positions: the head's slices are
    read twice a pass), one of them left-padded."""
    return [random_batch(VOCAB, batch=8, seq=40, seed=s, pad="left" if s else None) for s in (0, 1)]


def trajectory(model, scope, **options):
    config = ZOConfig(lr=1e-2, eps=1e-2, seed=0, device="cpu", perturb_scope=scope, **options)
    engine = ZOEngine(model, config)
    losses = [engine.step(batch).loss for batch in batches()]
    logits, loss = engine.forward(random_batch(VOCAB, seed=9))
    engine.flush()
    return engine, losses + [loss.item()], logits, engine.named_parameters()


MODELS = [
    "opt",
    "opt-projected",
    "llama",
    "llama_tied",
    "qwen3",
    "gpt2",
    "llama-bias",
    "granite",
    "gemma3",
]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("options", ["fp32", *OPTIONS], ids=["fp32", *OPTIONS])
def test_a_sliced_vocabulary_steps_as_the_whole_side(name, options):
    kwargs = OPTIONS.get(options, {})
    whole, losses, logits, weights = trajectory(model_of(name), "block", **kwargs)
    sliced, sliced_losses, sliced_logits, sliced_weights = trajectory(
        model_of(name), "module", **kwargs
    )
    assert sliced.resident.num_slices > 2  # the vocabulary really was read in slices
    assert sliced_losses == losses
    assert len(set(losses)) == len(losses)
    assert torch.equal(sliced_logits, logits)
    assert_same(sliced_weights, weights)


def test_gemma_s_scaled_embedding_is_read_in_slices_scaled_as_its_own_forward():
    """Gemma scales what its embedding looks up, in its own module: a slice's lookup
    scales it alike, so its vocabulary (262k words) never needs a scratch of its size."""
    model = model_of("gemma3")
    assert set(vocab_modules(model)) == {"model.embed_tokens", "lm_head"}
    assert model.model.embed_tokens.embed_scale.item() != 1.0  # the scale matters here


def test_the_sides_share_the_module_scratch_and_the_plan_counts_it_once():
    model = model_of("llama")
    config = ZOConfig(seed=0, device="cpu", perturb_scope="module")
    engine = ZOEngine(model, config)
    scratch = engine.block_scratch
    norm = model.model.norm.weight  # the head's fixed place, in the blocks' scratch
    assert norm.untyped_storage().data_ptr() == scratch.untyped_storage().data_ptr()
    assert model.model.layers[0].mlp.up_proj.weight.data_ptr() == scratch.data_ptr()
    # the vocabulary matrices have no place: stand-ins of their shape, read only in slices
    assert model.lm_head.weight.shape == (VOCAB, 32) and model.lm_head.weight.stride() == (0, 0)
    numel = shared_scratch_numel(model, engine.block_layouts, engine.resident_layout)
    assert scratch.numel() == numel < engine.resident_layout.numel / 4
    sides = engine.resident.sides
    rows = (numel - sides[HEAD].fixed.numel) // 32
    assert engine.resident.num_slices == -(-VOCAB // rows)
    said = describe(engine, scratch.dtype)
    assert f"the vocabulary in {engine.resident.num_slices} slices" in said
    block = ZOEngine(model_of("llama"), ZOConfig(seed=0, device="cpu"))
    plans = {
        scope: plan_memory(
            model_of("llama"), ZOConfig(seed=0, device="cpu", perturb_scope=scope), 1, False, 4, 12
        )
        for scope in ("block", "module")
    }
    master = engine.resident_master.nbytes
    # both scopes hold the untied head's sides in the block's scratch: the block scope
    # whole (each side as large as the vocabulary), the module scope in slices
    assert plans["module"].device_resident == plans["block"].device_resident == master
    assert block.block_scratch.numel() >= VOCAB * 32
    moved = plans["block"].device_scratch - plans["module"].device_scratch
    assert moved == block.block_scratch.nbytes - scratch.nbytes > 0


def test_which_weights_are_sliced():
    """Only the vocabulary matrices of plain ``nn.Embedding`` / ``nn.Linear`` modules, at
    every name of a tied weight; everything else keeps a fixed place."""
    model = model_of("opt")
    engine = ZOEngine(model, ZOConfig(seed=0, device="cpu", perturb_scope="module"))
    sides = sliced_sides(engine.resident_layout, model)
    assert sides[EMBEDDING] is sides[HEAD] and sides[HEAD].name == WHOLE  # tied
    assert [m.module for m in sides[HEAD].matrices] == ["model.decoder.embed_tokens", "lm_head"]
    fixed = {n for e in sides[HEAD].fixed.entries for n in e.names}
    assert "model.decoder.embed_positions.weight" in fixed
    assert not any("embed_tokens" in n or "lm_head" in n for n in fixed)

    untied = model_of("llama-bias")
    engine = ZOEngine(untied, ZOConfig(seed=0, device="cpu", perturb_scope="module"))
    sides = sliced_sides(engine.resident_layout, untied)
    assert [m.module for m in sides[EMBEDDING].matrices] == ["model.embed_tokens"]
    assert [m.module for m in sides[HEAD].matrices] == ["lm_head"]
    assert {n for e in sides[HEAD].fixed.entries for n in e.names} == {
        "model.norm.weight",
        "lm_head.bias",
    }


class Doubled(nn.Embedding):
    """An embedding whose forward is its own: not a plain lookup, so never sliced, though
    it holds an ``embed_scale`` as transformers' scaled embeddings do (not one of them)."""

    embed_scale = 1.0

    def forward(self, ids):
        return super().forward(ids) * 2


def test_an_embedding_with_a_forward_of_its_own_keeps_its_whole_weight():
    def doubled():
        model = model_of("llama")
        old = model.model.embed_tokens
        model.model.embed_tokens = Doubled(VOCAB, 32)
        model.model.embed_tokens.weight.data.copy_(old.weight.data)
        return model

    sliced = ZOEngine(doubled(), ZOConfig(seed=0, device="cpu", perturb_scope="module"))
    sides = sliced.resident.sides
    assert not sides[EMBEDDING].matrices and sides[EMBEDDING].fixed.numel >= VOCAB * 32
    assert sides[HEAD].matrices  # the head still is
    _, losses, logits, weights = trajectory(doubled(), "block")
    _, sliced_losses, sliced_logits, sliced_weights = trajectory(doubled(), "module")
    assert sliced_losses == losses and torch.equal(sliced_logits, logits)
    assert_same(sliced_weights, weights)


def test_an_embedding_with_a_max_norm_keeps_its_whole_weight():
    """``max_norm`` renormalises the rows a lookup reads (in place, as its forward runs):
    a slice's plain lookup would skip that, so such an embedding is read whole."""
    model = model_of("llama")
    model.model.embed_tokens.max_norm = 1.0
    sides = ZOEngine(model, ZOConfig(seed=0, device="cpu", perturb_scope="module")).resident.sides
    assert not sides[EMBEDDING].matrices and sides[EMBEDDING].fixed.numel >= VOCAB * 32
    assert sides[HEAD].matrices  # the head still is


def test_a_vocabulary_module_run_outside_the_engines_pass_is_refused():
    model = model_of("llama")
    engine = ZOEngine(model, ZOConfig(seed=0, device="cpu", perturb_scope="module"))
    message = r"module lm_head ran outside the engine's pass .* use perturb_scope block"
    with pytest.raises(RuntimeError, match=message):
        model.lm_head(torch.zeros(2, 32))
    engine.step(random_batch(VOCAB))  # the blocks overwrote what the last head read
    with pytest.raises(RuntimeError, match=message):
        model.lm_head(torch.zeros(2, 32))
    with pytest.raises(RuntimeError, match=r"module model.embed_tokens ran outside"):
        model(**random_batch(VOCAB))


def test_a_module_scratch_smaller_than_a_slice_grows_to_one():
    """A vocabulary far wider than the blocks' modules: the scratch holds MIN_ROWS rows."""
    torch.manual_seed(0)
    config = CONFIGS["llama"]()
    config.vocab_size, config.hidden_size, config.intermediate_size = 300, 64, 8
    config.num_attention_heads, config.num_key_value_heads = 8, 8  # 64 x 64 attention weights
    model = AutoModelForCausalLM.from_config(config)
    engine = ZOEngine(model, ZOConfig(seed=0, device="cpu", perturb_scope="module"))
    assert engine.block_scratch.numel() == 64 + MIN_ROWS * 64  # the norm, then the rows
    assert engine.resident.num_slices == -(-300 // MIN_ROWS)


@pytest.mark.parametrize("scope", ["block", "module"])
def test_a_token_outside_the_vocabulary_is_refused_before_a_step(scope):
    """A lookup in slices clamps what a whole embedding's would reject: the engine checks
    a host batch's ids itself, in either scope, before any block is updated."""
    model = model_of("llama")
    engine = ZOEngine(model, ZOConfig(seed=0, device="cpu", perturb_scope=scope))
    for bad in (VOCAB, -1):
        batch = random_batch(VOCAB)
        batch["input_ids"][1, 3] = bad
        with pytest.raises(ValueError, match=f"token id {bad} is outside the model's vocabulary"):
            engine.step(batch)
        with pytest.raises(ValueError, match="tokenize with the model's own tokenizer"):
            engine.forward(batch)
    assert engine.step_index == 0
    engine.step(random_batch(VOCAB))  # nothing was left half-done
