"""A causal LM's prompt-task evaluation reports the loss of the run's training objective
(``eval_loss``, ``dev_loss``), which MeZO's OPT runs keep their best step by: the
classification cross-entropy read off the candidate scores the evaluation computes, or
the ``lm`` objective's teacher-forced loss of the right answer. Each equals the
objective's own loss on the same rows, and two ranks' sums give the one process's."""

import math
import threading
from typing import Any

import pytest

from distzo import ZOConfig, ZOEngine
from distzo.data.encoding import PromptEncoder
from distzo.data.task_data import LoadedRows, PromptData
from distzo.data.templates import TASKS, Example, build_examples
from distzo.dist import ParallelContext
from distzo.engine import UNPERTURBED
from distzo.job import eval_calls, evaluation
from distzo.job.summary import best_eval, run_summary
from distzo.models.tiny import byte_tokenizer
from distzo.objectives import Classification, LanguageModeling, collate_choices
from distzo.objectives.choice import prepare_choices
from tests.helpers.models import tiny_opt
from tests.unit.test_glue_metrics import ThreadRank
from tests.unit.test_wsc_record_drop import record_row

TOKENIZER = byte_tokenizer()
SINGLE = ParallelContext.single()


def engine() -> ZOEngine:
    model = tiny_opt(seed=4, vocab_size=len(TOKENIZER), max_position_embeddings=256)
    return ZOEngine(model, ZOConfig(device="cpu", seed=0))


def encoder() -> PromptEncoder:
    return PromptEncoder(TOKENIZER, max_length=256)


def rte(count: int = 7) -> list[Example]:
    rows = [{"premise": f"P{i} x.", "hypothesis": "H.", "label": i % 2} for i in range(count)]
    return build_examples(TASKS["rte"], rows, "x")


def copa(count: int = 7) -> list[Example]:
    rows = [
        {"premise": f"It rained {i}.", "question": "effect", "choice1": "We left.",
         "choice2": f"We stayed {i}.", "label": i % 2}
        for i in range(count)
    ]  # fmt: skip
    return build_examples(TASKS["copa"], rows, "x")


def squad(count: int = 5) -> list[Example]:
    rows = [
        {"title": "T", "context": f"Code {i}.", "question": "Which?", "answers": [f"c{i}"]}
        for i in range(count)
    ]
    return build_examples(TASKS["squad"], rows, "x")


def single_tokens(count: int = 5) -> list[Example]:
    """Candidates of one byte each after one prompt: the prompt alone is the row."""
    return [Example(f"Is {i} odd?", ("n", "y"), i % 2) for i in range(count)]


def classification_loss(eng: ZOEngine, examples: list[Example]) -> float:
    """The objective's own loss (a training step's) on ``examples``, all in one batch."""
    batch = collate_choices([encoder().encode_choices(e) for e in examples], encoder().pad_id)
    prepared = prepare_choices(batch, eng.device)
    objective = Classification()
    measured = eng.evaluate(
        lambda runner: objective.losses(runner, prepared, (UNPERTURBED,), len(examples))
    )
    return float(measured[UNPERTURBED])


def lm_loss(eng: ZOEngine, examples: list[Example]) -> float:
    """The ``lm`` objective's loss as a training step takes it: the right answers encoded
    as ``PromptTrainData`` encodes them, divided by the batch's label tokens."""
    batch = encoder().collate(encoder().encode_many(examples))
    objective = LanguageModeling()
    prepared, count = objective.prepare(batch, eng.device), objective.num_items(batch)
    measured = eng.evaluate(
        lambda runner: objective.losses(runner, prepared, (UNPERTURBED,), count)
    )
    return float(measured[UNPERTURBED])


@pytest.mark.parametrize("examples", [rte, single_tokens])
def test_the_classification_loss_is_the_objectives_own_on_the_rows(examples):
    eng, rows = engine(), examples()
    metrics = evaluation.evaluate_choices(eng, rows, encoder(), SINGLE, 4, loss="classification")
    assert list(metrics) == ["eval_loss", "eval_accuracy"]
    assert metrics["eval_loss"] == pytest.approx(classification_loss(eng, rows), rel=1e-6)
    plain = evaluation.evaluate_choices(eng, rows, encoder(), SINGLE, 4)
    assert plain == {"eval_accuracy": metrics["eval_accuracy"]}


@pytest.mark.parametrize("examples", [copa, single_tokens])
def test_the_lm_loss_of_a_choice_task_is_teacher_forcing_on_the_right_answer(examples):
    """COPA trains LM-style: the loss is per answer token, as a training step's."""
    eng, rows = engine(), examples()
    metrics = evaluation.evaluate_choices(eng, rows, encoder(), SINGLE, 4, loss="lm")
    assert metrics["eval_loss"] == pytest.approx(lm_loss(eng, rows), rel=1e-5)
    assert metrics["eval_loss"] != pytest.approx(classification_loss(eng, rows), rel=1e-3)


def test_the_lm_loss_of_an_example_scored_in_pieces_is_the_one_of_it_whole():
    """ReCoRD's candidates in pieces of 2 rows: the right answer's loss read off the
    joined scores, whichever piece it lies on."""
    eng = engine()
    rows = build_examples(TASKS["record"], [record_row(i) for i in range(6)], "x")
    pieces = evaluation.evaluate_choices(eng, rows, encoder(), SINGLE, 2, loss="lm")
    whole = evaluation.evaluate_choices(eng, rows, encoder(), SINGLE, 16, loss="lm")
    assert pieces["eval_loss"] == pytest.approx(whole["eval_loss"], rel=1e-6)
    assert pieces["eval_loss"] == pytest.approx(lm_loss(eng, rows), rel=1e-5)


def test_a_generation_task_reports_the_lm_loss_of_its_gold_answers():
    eng, rows = engine(), squad()
    metrics = evaluation.evaluate_generation(eng, rows, encoder(), SINGLE, 2, 3, loss=True)
    assert list(metrics) == ["eval_loss", "eval_f1", "eval_exact_match"]
    assert metrics["eval_loss"] == pytest.approx(lm_loss(eng, rows), rel=1e-6)
    plain = evaluation.evaluate_generation(eng, rows, encoder(), SINGLE, 2, 3)
    assert plain == {k: v for k, v in metrics.items() if k != "eval_loss"}


def on_two_ranks(run) -> list[Any]:
    """``run(parallel)`` on two thread ranks whose sums are added as an all-reduce adds
    them, each rank with a model of its own."""
    given: list = [None, None]
    barrier = threading.Barrier(2, timeout=60)
    results: list = [None, None]
    engines = [engine(), engine()]

    def rank(r: int) -> None:
        results[r] = run(engines[r], ThreadRank(r, given, barrier))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def classified(eng: ZOEngine, rows: list[Example], parallel: Any) -> dict[str, float]:
    return evaluation.evaluate_choices(eng, rows, encoder(), parallel, 4, loss="classification")


def lm_choices(eng: ZOEngine, rows: list[Example], parallel: Any) -> dict[str, float]:
    return evaluation.evaluate_choices(eng, rows, encoder(), parallel, 4, loss="lm")


def generated(eng: ZOEngine, rows: list[Example], parallel: Any) -> dict[str, float]:
    return evaluation.evaluate_generation(eng, rows, encoder(), parallel, 2, 2, loss=True)


@pytest.mark.parametrize(
    "examples, evaluate", [(rte, classified), (copa, lm_choices), (squad, generated)]
)
def test_two_ranks_sum_the_loss_and_its_count_before_dividing(examples, evaluate):
    """7 (or 5) examples over 2 ranks, shares of 4 and 3: the mean of each rank's own
    mean would weigh the smaller share's examples more."""
    rows = examples()
    whole = evaluate(engine(), rows, SINGLE)
    ranks = on_two_ranks(lambda e, p: evaluate(e, rows, p))
    assert ranks[0] == ranks[1]
    assert ranks[0]["eval_loss"] == pytest.approx(whole["eval_loss"], rel=1e-6)
    shares = [eval_calls.share(len(rows), ThreadRank(r, [], None)) for r in (0, 1)]
    own = [evaluate(engine(), [rows[i] for i in share], SINGLE) for share in shares]
    assert sum(o["eval_loss"] for o in own) / 2 != pytest.approx(whole["eval_loss"], rel=1e-6)


def test_broken_scores_make_the_loss_nan_as_the_metrics(monkeypatch):
    real = evaluation.candidate_scores

    def nan_scores(*args):
        return real(*args).fill_(math.nan)

    monkeypatch.setattr(evaluation, "candidate_scores", nan_scores)
    metrics = evaluation.evaluate_choices(engine(), rte(), encoder(), SINGLE, 4, loss="lm")
    assert all(math.isnan(v) for v in metrics.values()) and "eval_loss" in metrics


@pytest.mark.parametrize(
    "task, objective, keys",
    [
        ("rte", None, ["dev_loss", "dev_accuracy"]),  # classification: MeZO's default
        ("copa", None, ["dev_loss", "dev_accuracy"]),  # lm
        ("rte", "accuracy", ["dev_accuracy"]),  # minus the metric: no other loss
        ("squad", None, ["dev_loss", "dev_f1", "dev_exact_match"]),  # lm
        ("squad", "f1", ["dev_f1", "dev_exact_match"]),
    ],
)
def test_a_causal_prompt_task_reports_its_objectives_dev_loss(task, objective, keys):
    rows = {"rte": rte, "copa": copa, "squad": squad}[task](4)
    loaded = LoadedRows(task, rows, rows, dev=rows)
    data = PromptData(loaded, encoder(), 0, 4, max_new_tokens=2, objective=objective)
    metrics = evaluation.evaluate(engine(), data, SINGLE, split="dev")
    assert list(metrics) == keys
    if "dev_loss" in metrics:
        expected = lm_loss if data.objective == "lm" else classification_loss
        assert metrics["dev_loss"] == pytest.approx(expected(engine(), rows), rel=1e-5)


def test_a_causal_tasks_best_dev_step_is_its_lowest_loss_not_its_best_accuracy():
    """MeZO's OPT runs: ``--load_best_model_at_end`` keeps the lowest dev loss (step 4
    here), where accuracy would keep step 2."""
    dev = [
        {"step": 2, "dev_loss": 0.70, "dev_accuracy": 0.75},
        {"step": 4, "dev_loss": 0.60, "dev_accuracy": 0.70},
        {"step": 6, "dev_loss": 0.60, "dev_accuracy": 0.72},
    ]
    end = {"step": 6, "eval_loss": 0.5, "eval_accuracy": 0.7}
    at_4 = {"step": 4, "eval_loss": 0.6, "eval_accuracy": 0.7}
    summary = run_summary({}, 6, {}, [], [*dev, at_4, end], {})
    assert summary["dev"]["best"] == {"by": "dev_loss", **dev[1]}  # the earliest of equals
    assert summary["eval"]["best"] == {"by": "dev_loss", **at_4}
    squad_like = [
        {"step": 2, "dev_f1": 0.9, "dev_loss": 2.0},
        {"step": 4, "dev_f1": 0.1, "dev_loss": 1.0},
    ]
    assert best_eval(squad_like)["step"] == 4


def test_a_masked_tasks_best_dev_step_is_still_its_metric():
    """A masked LM's records hold no loss: F1, then MCC, then accuracy, as MeZO's RoBERTa
    trainer chooses."""
    dev = [
        {"step": 2, "dev_f1": 0.5, "dev_accuracy": 0.8},
        {"step": 4, "dev_f1": 0.6, "dev_accuracy": 0.7},
    ]
    assert best_eval(dev) == {"by": "dev_f1", **dev[1]}
    plain = [{"step": 2, "dev_accuracy": 0.8}, {"step": 4, "dev_accuracy": 0.7}]
    assert best_eval(plain) == {"by": "dev_accuracy", **plain[0]}


def test_a_resumed_run_begun_without_a_dev_loss_keeps_choosing_by_its_metric():
    """Its first session (an earlier distzo) logged accuracy alone; the resumed one logs
    the loss too: choosing by the loss would skip the first session's steps."""
    dev = [
        {"step": 2, "dev_accuracy": 0.8},
        {"step": 4, "dev_loss": 0.3, "dev_accuracy": 0.7},
        {"step": 6, "dev_loss": 0.5, "dev_accuracy": 0.75},
    ]
    assert best_eval(dev) == {"by": "dev_accuracy", **dev[0]}
    assert run_summary({}, 6, {}, [], dev, {})["dev"]["best"]["step"] == 2
