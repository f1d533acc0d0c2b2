"""The embedding and an untied head take turns in one resident scratch: half the memory,
each side perturbed once per pass, and not one bit of any trajectory changed."""

import collections

import pytest
import torch

from distzo import ZOConfig, ZOEngine
from distzo.engine.layouts import RESIDENT_BLOCK_ID, split_layouts
from distzo.engine.resident_sides import EMBEDDING, HEAD, WHOLE, resident_sides
from distzo.job.memory_plan import plan_memory
from distzo.models import family_for
from distzo.offload.bucket import ALIGN_ELEMENTS
from tests.helpers.models import build, random_batch, tiny_opt


def sides_of(model):
    (_, (layout, _)), _ = split_layouts(model, family_for(model).blocks())
    return layout, resident_sides(layout, model)


def names(side):
    return {name for e in side.entries for name in e.names}


def untied_opt():
    # project_in / project_out (word_embed_proj_dim != hidden) put a head matrix between
    # the embedding's in the decayed prefix: each side is then more than one run
    return tiny_opt(seed=0, word_embed_proj_dim=16, tie_word_embeddings=False)


def test_an_untied_head_is_a_side_of_its_own_and_a_tied_one_is_not():
    layout, sides = sides_of(build("llama"))
    assert names(sides[HEAD]) == {"lm_head.weight", "model.norm.weight"}
    assert names(sides[EMBEDDING]) == {"model.embed_tokens.weight"}
    assert sides[HEAD].numel + sides[EMBEDDING].numel <= layout.numel

    layout, sides = sides_of(untied_opt())
    assert names(sides[HEAD]) == {
        "lm_head.weight",
        "model.decoder.project_out.weight",
        "model.decoder.final_layer_norm.weight",
        "model.decoder.final_layer_norm.bias",
    }
    assert len(sides[HEAD].runs) > 1 and len(sides[EMBEDDING].runs) > 1
    for side in sides.values():
        by_name = {e.names[0]: e for e in layout.entries}
        for e in side.entries:  # each view keeps its alignment and its place in its run
            assert e.offset % ALIGN_ELEMENTS == 0
            run = next(r for r in side.runs if r.at <= e.offset < r.at + r.numel)
            assert by_name[e.names[0]].offset - run.start == e.offset - run.at

    for tied in (build("llama_tied"), tiny_opt(seed=0)):
        layout, sides = sides_of(tied)
        assert sides[HEAD] is sides[EMBEDDING] and sides[HEAD].name == WHOLE
        assert sides[HEAD].numel == layout.numel


def engine(model, whole=False, monkeypatch=None, **overrides):
    if whole:  # the scratch of the whole bucket, as before the sides
        family = type(family_for(model))
        monkeypatch.setattr(family, "head_modules", lambda self: [])
    options = dict(lr=1e-2, eps=1e-3, seed=5, device="cpu", noise_chunk=333, weight_decay=0.1)
    options.update(overrides)
    built = ZOEngine(model, ZOConfig(**options))
    if whole:
        monkeypatch.undo()
    return built


def trajectory(e, vocab, steps=3):
    results = [e.step(random_batch(vocab, pad="left", seed=i)) for i in range(steps)]
    logits, _ = e.forward(random_batch(vocab, seed=9))
    return [(r.loss_plus, r.loss_minus, r.projected_grads) for r in results], logits


@pytest.mark.parametrize(
    "model, overrides",
    [
        ("llama", dict(mode="offload")),
        ("opt", dict(num_queries=2)),
        ("opt", dict(estimator="fzoo", num_queries=3, mode="offload")),
        ("llama", dict(noise="lowrank")),
        ("llama", dict(noise="legacy", mode="offload", transfer_dtype="bf16")),
    ],
)
def test_the_sides_change_no_trajectory(monkeypatch, model, overrides):
    make = (lambda: build("llama")) if model == "llama" else untied_opt
    vocab = make().config.vocab_size
    split, whole = engine(make(), **overrides), engine(make(), True, monkeypatch, **overrides)
    # the sides take turns in the block scratch too; the whole bucket has one of its own
    assert split.resident.shares_blocks and not whole.resident.shares_blocks
    assert split.resident_scratch.data_ptr() == split.block_scratch.data_ptr()
    own = whole.block_scratch.numel() + whole.resident_scratch.numel()
    assert split.block_scratch.numel() < own
    (steps_split, logits_split), (steps_whole, logits_whole) = (
        trajectory(split, vocab),
        trajectory(whole, vocab),
    )
    assert steps_split == steps_whole
    assert torch.equal(logits_split, logits_whole)
    params_split, params_whole = split.named_parameters(), whole.named_parameters()
    for name, value in params_whole.items():
        assert torch.equal(params_split[name], value), name


def resident_elements_perturbed(e, vocab):
    counted = collections.Counter()
    perturb_into = e.noise.perturb_into

    def spy(out, theta, *args, **kwargs):
        if args[2] == RESIDENT_BLOCK_ID:
            counted["elements"] += theta.numel()
        perturb_into(out, theta, *args, **kwargs)

    e.noise.perturb_into = spy
    e.step(random_batch(vocab, seed=1))
    e.step(random_batch(vocab, seed=2))  # a step with an update, after one without
    return counted["elements"]


def test_each_side_is_perturbed_once_per_pass(monkeypatch):
    vocab = build("llama").config.vocab_size
    split = engine(build("llama"))
    _, sides = sides_of(build("llama"))
    side_elements = sum(run.numel for s in sides.values() for run in s.runs)
    # two steps of two passes: each pass perturbs the embedding's side and the head's once
    assert resident_elements_perturbed(split, vocab) == 2 * 2 * side_elements
    # the whole scratch: three whole perturbations a step (the head of the pass embedded
    # last reuses it)
    whole = engine(build("llama"), True, monkeypatch)
    assert resident_elements_perturbed(whole, vocab) == 2 * 3 * whole.resident_layout.numel


def test_the_plan_counts_the_larger_side_in_the_block_scratch():
    """Under full tuning an untied head's sides share the block scratch: it is the
    larger of the largest block and the larger side, and the resident term is the
    master alone."""
    model = build("llama")
    layout, sides = sides_of(model)
    plan = plan_memory(model, ZOConfig(device="cpu", compute_dtype="bf16"), 1, False, 2, 8)
    larger = max(sides[EMBEDDING].numel, sides[HEAD].numel)
    built = engine(build("llama"), compute_dtype="bf16")
    shared = max(larger, *(b.numel for b in built.block_layouts))
    assert plan.device_resident == layout.numel * 4
    assert built.block_scratch.numel() == shared == built.resident_scratch.numel()
    # (test_streaming_load holds the plan's device total to what the engine allocates)


def test_a_tied_head_keeps_a_scratch_of_its_own():
    """A tied head reuses the perturbation the embedding left (one side): sharing the
    block scratch would lose that, so it stays apart."""
    tied = engine(build("llama_tied"))
    assert tied.resident.sides[EMBEDDING] is tied.resident.sides[HEAD]
    assert not tied.resident.shares_blocks
    assert tied.resident_scratch.data_ptr() != tied.block_scratch.data_ptr()
