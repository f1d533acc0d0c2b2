"""Scores of broken weights: an argmax over NaN scores or logits still picks a candidate or
a token, so an accuracy, an F1 or a greedy answer read off it looks like a result. Each
objective and evaluation turns it into a NaN instead, which a divergence check sees, and
a finite model's values do not change."""

import math

import pytest
import torch

from distzo import ZOConfig, ZOEngine
from distzo.data.encoding import ChoiceTrainData, PromptEncoder, PromptOnlyTrainData
from distzo.data.templates import TASKS, build_examples
from distzo.dist import ParallelContext
from distzo.engine import UNPERTURBED
from distzo.job.evaluation import evaluate_choices, evaluate_generation, evaluate_lm
from distzo.models.tiny import byte_tokenizer
from distzo.objectives import F1, Accuracy
from distzo.objectives.scoring import broken_rows
from tests.helpers.models import tiny_opt

TOKENIZER = byte_tokenizer()
ENCODER = PromptEncoder(TOKENIZER, max_length=256)
SINGLE = ParallelContext.single()
NEW_TOKENS = 3


def engine(broken: bool) -> ZOEngine:
    """The tiny OPT; ``broken``: its final norm scaled to inf, so every logit is NaN (the
    state a too-large update leaves)."""
    model = tiny_opt(seed=3, vocab_size=len(TOKENIZER), max_position_embeddings=256)
    if broken:
        with torch.no_grad():
            model.model.decoder.final_layer_norm.weight.fill_(math.inf)
    return ZOEngine(model, ZOConfig(device="cpu", seed=0))


def rte(n: int = 4):
    rows = [{"premise": f"Fact {i}.", "hypothesis": "Claim.", "label": i % 2} for i in range(n)]
    return build_examples(TASKS["rte"], rows, "x")


def squad(n: int = 2):
    rows = [
        {"title": "T", "context": f"Code {i}.", "question": "What?", "answers": [f"code {i}"]}
        for i in range(n)
    ]
    return build_examples(TASKS["squad"], rows, "x")


def objective_loss(e: ZOEngine, objective, batch) -> float:
    prepared = objective.prepare(batch, e.device)
    items = objective.num_items(batch)
    return e.evaluate(lambda r: objective.losses(r, prepared, (UNPERTURBED,), items))[
        UNPERTURBED
    ].item()


def test_a_row_is_broken_by_a_nan_or_plus_inf_not_by_an_absent_candidates_minus_inf():
    scores = torch.tensor([[-1.0, -math.inf], [math.nan, -1.0], [math.inf, -1.0], [0.0, 0.0]])
    assert broken_rows(scores).tolist() == [False, True, True, False]


@pytest.mark.parametrize("broken", [False, True])
def test_the_accuracy_objective_of_nan_scores_is_nan(broken):
    batch = ChoiceTrainData(rte(), ENCODER, seed=0).batch(4, 0)
    loss = objective_loss(engine(broken), Accuracy(), batch)
    assert math.isnan(loss) if broken else -1 <= loss <= 0


@pytest.mark.parametrize("broken", [False, True])
def test_the_f1_objective_of_nan_logits_is_nan(broken):
    examples = squad()
    batch = PromptOnlyTrainData(examples, ENCODER, seed=0, max_new_tokens=NEW_TOKENS).batch(2, 0)
    objective = F1(TOKENIZER.decode, [e.answers for e in examples])
    loss = objective_loss(engine(broken), objective, batch)
    assert math.isnan(loss) if broken else -1 <= loss <= 0


@pytest.mark.parametrize("broken", [False, True])
def test_every_evaluation_of_nan_scores_is_nan(broken):
    e = engine(broken)
    # each evaluation's own: evaluate_lm's eval_accuracy would hide the choices' in one dict
    metrics = [
        evaluate_choices(e, rte(), ENCODER, SINGLE, 4),
        evaluate_generation(e, squad(), ENCODER, SINGLE, 2, NEW_TOKENS),
        evaluate_lm(e, lm_rows(), SINGLE, 2),
    ]
    assert [set(m) for m in metrics] == [
        {"eval_accuracy"},
        {"eval_f1", "eval_exact_match"},
        {"eval_loss", "eval_accuracy"},
    ]
    values = [v for m in metrics for v in m.values()]
    assert all(math.isnan(v) if broken else math.isfinite(v) for v in values)


def lm_rows() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 200, (2, 10), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def test_the_f1_objective_is_nan_where_any_row_is_broken():
    """One row's logits NaN (a token whose input embedding broke, only in the second prompt):
    the batch's F1 is NaN, not the F1 of the rows that look fine."""
    from distzo.objectives import collate_prompts

    rows = [
        {"title": "T", "context": context, "question": "What?", "answers": ["code"]}
        for context in ("Code a.", "Code ~.")
    ]
    examples = build_examples(TASKS["squad"], rows, "x")
    model = tiny_opt(
        seed=3, vocab_size=len(TOKENIZER), max_position_embeddings=256, tie_word_embeddings=False
    )  # untied: the head's own row for the token stays finite
    (poisoned,) = TOKENIZER("~", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        model.model.decoder.embed_tokens.weight[poisoned] = math.nan
    e = ZOEngine(model, ZOConfig(device="cpu", seed=0))
    prompts = [ENCODER.encode_prompt(x.prompt, NEW_TOKENS) for x in examples]
    batch = collate_prompts(prompts, [0, 1], NEW_TOKENS, ENCODER.pad_id)
    objective = F1(TOKENIZER.decode, [x.answers for x in examples])
    assert math.isnan(objective_loss(e, objective, batch))
    healthy = collate_prompts(prompts[:1], [0], NEW_TOKENS, ENCODER.pad_id)
    assert -1 <= objective_loss(e, objective, healthy) <= 0
