"""A block perturbed module by module (``perturb_scope="module"``): the whole block's
trajectory bit for bit, in a scratch the size of its largest module."""

import pytest
import torch

from distzo import ZOConfig, ZOEngine
from distzo.engine import split_layouts
from distzo.engine.module_scratch import block_pieces, module_scratch_numel
from distzo.engine.parts import describe
from distzo.engine.resident_sides import resident_sides, scratch_numel, share_block_scratch
from distzo.engine.vocab_slices import shared_scratch_numel
from distzo.job.memory_plan import plan_memory
from distzo.models import family_for
from distzo.models.shapes import shape_config
from distzo.models.weights import skeleton
from distzo.runtime.units import format_bytes
from tests.helpers.launch import train_in_process
from tests.helpers.models import build, random_batch, tiny_opt


def model_of(name):
    return tiny_opt(seed=0) if name == "opt" else build(name)


def trajectory(model, scope, **options):
    """Three steps' losses and an evaluation's, then every weight after them."""
    config = ZOConfig(lr=1e-2, eps=1e-2, seed=0, device="cpu", perturb_scope=scope, **options)
    engine = ZOEngine(model, config)
    vocab = model.config.vocab_size
    losses = [engine.step(random_batch(vocab, seed=s)).loss for s in range(3)]
    losses.append(engine.forward(random_batch(vocab, seed=9))[1].item())
    engine.flush()
    return engine, losses, engine.named_parameters()


def assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


OPTIONS = {
    "resident": {"mode": "resident"},
    "bf16-link": {"transfer_dtype": "bf16", "weight_decay": 0.1},
    "fp16-recompute": {
        "transfer_dtype": "fp16",
        "compute_dtype": "fp16",
        "low_bit_master": "recompute",
        "noise_chunk": 777,
    },
    "lozo": {"noise": "lowrank", "weight_decay": 0.5, "noise_chunk": 1001},
    "legacy-momentum-q2": {
        "noise": "legacy",
        "noise_chunk": 1001,
        "optimizer": "momentum",
        "num_queries": 2,
    },
    "fzoo-bf16-compute": {"estimator": "fzoo", "num_queries": 3, "compute_dtype": "bf16"},
    # micro-batches: each embeds and reads the head on its own
    "grad-accum": {"grad_accum": 2, "transfer_dtype": "bf16"},
}


@pytest.mark.parametrize("name", ["opt", "llama", "qwen3", "gpt2", "gemma3", "granite"])
@pytest.mark.parametrize("options", list(OPTIONS.values()), ids=list(OPTIONS))
def test_a_block_perturbed_module_by_module_steps_as_the_whole_block(name, options):
    whole, losses, weights = trajectory(model_of(name), "block", **options)
    by_module, module_losses, module_weights = trajectory(model_of(name), "module", **options)
    assert module_losses == losses
    assert len(set(losses)) == len(losses)  # the steps moved the weights
    assert_same(module_weights, weights)
    # the scratch holds the largest module (and what no hook reaches), not a block
    assert by_module.block_scratch.numel() < whole.block_scratch.numel() / 2
    said = describe(by_module, by_module.block_scratch.dtype)
    scratch = by_module.block_scratch
    size = format_bytes(scratch.numel() * scratch.element_size())
    assert f"blocks perturbed module by module ({size} scratch)" in said
    assert "module by module" not in describe(whole, whole.block_scratch.dtype)


def test_every_weight_of_a_block_has_one_place_and_the_modules_share_theirs():
    model = build("llama")
    engine = ZOEngine(model, ZOConfig(seed=0, device="cpu", perturb_scope="module"))
    for i, layout in enumerate(engine.block_layouts):
        pieces = block_pieces(model, layout)
        named = [n for _, piece in pieces.modules for e in piece.entries for n in e.names]
        named += [n for e in pieces.fixed.entries for n in e.names]
        assert sorted(named) == sorted(n for e in layout.entries for n in e.names)
        block = engine.blocks[i]
        hooked = {name for name, _ in pieces.modules}
        # every module with weights and no children is hooked: a Linear, a norm
        leaves = {
            f"model.layers.{i}.{name}"
            for name, m in block.named_modules()
            if next(m.children(), None) is None and any(True for _ in m.parameters(False))
        }
        assert hooked == leaves and not pieces.fixed.entries
        # each module's first run starts where every other module's does
        assert {piece.runs[0].at for _, piece in pieces.modules} == {pieces.fixed.numel}
        for run in (r for _, piece in pieces.modules for r in piece.runs):
            assert run.stop - run.start == run.numel and run.at + run.numel <= pieces.numel
        # the parameters are views of the one scratch, each module's at its piece
        mlp = block.mlp.gate_proj.weight
        assert mlp.untyped_storage().data_ptr() == engine.block_scratch.untyped_storage().data_ptr()
        assert mlp.data_ptr() == block.self_attn.q_proj.weight.data_ptr()
    biggest = max(block_pieces(model, layout).numel for layout in engine.block_layouts)
    assert biggest == module_scratch_numel(model, engine.block_layouts)
    # the resident sides share it (tests/unit/test_vocab_slices.py)
    shared = shared_scratch_numel(model, engine.block_layouts, engine.resident_layout)
    assert engine.block_scratch.numel() == shared >= biggest


def gated_opt():
    """A tiny OPT whose attention modules each own a parameter their own forward reads,
    around their children's."""
    model = tiny_opt(seed=0)
    for layer in model.model.decoder.layers:
        layer.self_attn.register_parameter("gate", torch.nn.Parameter(torch.full((4,), 0.5)))
    return model


def test_weights_read_outside_their_own_module_keep_places_of_their_own(monkeypatch):
    """A parameter of a module with children is perturbed when the block starts, at a
    place no module's hook overwrites: the trajectory is still the whole block's."""
    from transformers.models.opt.modeling_opt import OPTAttention

    original = OPTAttention.forward

    def gated(self, hidden_states, *args, **kwargs):
        out = original(self, hidden_states, *args, **kwargs)
        return (out[0] * self.gate.mean(), *out[1:])

    monkeypatch.setattr(OPTAttention, "forward", gated)
    pieces = block_pieces(
        gated_opt(), ZOEngine(gated_opt(), ZOConfig(seed=0, device="cpu")).block_layouts[1]
    )
    assert [n for e in pieces.fixed.entries for n in e.names] == [
        "model.decoder.layers.1.self_attn.gate"
    ]
    _, losses, weights = trajectory(gated_opt(), "block")
    _, module_losses, module_weights = trajectory(gated_opt(), "module")
    assert module_losses == losses
    assert_same(module_weights, weights)
    assert not torch.equal(weights["model.decoder.layers.0.self_attn.gate"], torch.full((4,), 0.5))


def test_a_module_run_outside_the_engines_pass_is_refused():
    """Its weights exist only while the engine's pass reads them: a forward of the bare
    model would read another module's, so it fails with what to do instead."""
    model = tiny_opt(seed=0)
    ZOEngine(model, ZOConfig(seed=0, device="cpu", perturb_scope="module"))
    with pytest.raises(RuntimeError, match=r"ran outside the engine's pass .* perturb_scope block"):
        model(**random_batch(model.config.vocab_size))


def test_bad_scopes_are_refused_before_anything_is_built():
    with pytest.raises(ValueError, match="perturb_scope must be one of block, module"):
        ZOConfig(perturb_scope="layer")
    with pytest.raises(ValueError, match="batched passes .* use perturb_scope block"):
        ZOConfig(perturb_scope="module", dual_forward=True)
    proc = train_in_process(["--peft", "lora", "--perturb-scope", "module"])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--perturb-scope module" in lines[0], proc.stderr


@pytest.mark.parametrize("shape", ["opt-6.7b", "opt-175b", "qwen3-8b"])
def test_the_plan_counts_the_largest_module(shape):
    """The plan's scratch is the largest module in the compute dtype (OPT: fc1, its weight
    and bias), what the engine allocates, shared by the resident sides (whose own scratch
    goes: their vocabulary read in slices, tests/unit/test_vocab_slices.py); everything
    else is the block plan's."""
    model = skeleton(shape_config(shape), torch.float32)
    plans = {
        scope: plan_memory(
            model,
            ZOConfig(
                device="cpu", transfer_dtype="fp16", compute_dtype="fp16", perturb_scope=scope
            ),
            1,
            False,
            1,
            2048,
            device_type="cuda",
        )
        for scope in ("block", "module")
    }
    blocks = family_for(model).blocks()
    if shape.startswith("opt"):
        fc1 = blocks[0].fc1
        largest = fc1.weight.numel() + fc1.bias.numel()
    else:
        mlp = blocks[0].mlp.gate_proj
        largest = mlp.weight.numel()
    block = sum(p.numel() for p in blocks[0].parameters())
    resident_layout = split_layouts(model, blocks)[0][1][0]
    sides = resident_sides(resident_layout, model)
    side = scratch_numel(sides)
    assert side >= model.get_output_embeddings().weight.numel()  # the head's, or embedding's
    if share_block_scratch(sides, full_tuning=True):  # untied (Qwen3-8B): in the block's
        block_scratch, own_scratch = max(block, side), 0
    else:  # tied (OPT): a scratch of its own
        block_scratch, own_scratch = block, side * 2
    noise = plans["block"].device_scratch - plans["module"].device_scratch
    assert noise == pytest.approx((block_scratch - largest) * 2, rel=0.01)
    assert plans["module"].device_resident == plans["block"].device_resident - own_scratch
    assert plans["module"].device_blocks == plans["block"].device_blocks
