"""CoLA's Matthews correlation and MRPC's and QQP's F1 of label 1 (GLUE's metrics, which
MeZO's RoBERTa runs report and choose their best dev step by), beside accuracy: distzo
scored every classification task by accuracy alone. Neither metric is a mean over
examples, so the ranks' confusion counts are summed before it is read."""

import math
import random
import threading
from typing import Any

import numpy as np
import pytest
import torch
from transformers import RobertaForMaskedLM

from distzo import ZOConfig, ZOEngine
from distzo.data.masked_prompts import MASKED_PROMPTS, MaskedPromptEncoder
from distzo.data.task_data import LoadedRows, MaskedPromptData
from distzo.data.templates import MaskedExample
from distzo.dist import LaunchEnv, ParallelContext
from distzo.job import eval_calls, evaluation
from distzo.job.records import describe
from distzo.objectives import Classification
from distzo.objectives.confusion import (
    binary_metric,
    confusion_counts,
    matthews_correlation,
    positive_f1,
)
from tests.helpers.masked_prompts import WORDS, roberta_tokenizer, tiny_roberta_config

TOKENIZER = roberta_tokenizer()


def test_each_task_names_the_metric_mezos_dev_objective_reads():
    metrics = {task: prompt.metric for task, prompt in MASKED_PROMPTS.items()}
    assert {task: m for task, m in metrics.items() if m != "accuracy"} == {
        "cola": "mcc",
        "mrpc": "f1",
        "qqp": "f1",
    }


def test_the_metrics_of_hand_counted_confusion_matrices():
    """TP 6, FP 2, FN 1, TN 3: MCC (18 - 2) / sqrt(8 * 7 * 5 * 4), F1 12 / 15; a matrix
    with an empty margin is 0.0, as scikit-learn gives it, not NaN (which stops a run)."""
    assert matthews_correlation(6, 2, 1, 3) == pytest.approx(16 / math.sqrt(1120))
    assert positive_f1(6, 2, 1) == pytest.approx(0.8)
    assert binary_metric("mcc", [5, 0, 0, 7]) == 1.0
    assert binary_metric("mcc", [0, 5, 7, 0]) == -1.0
    assert binary_metric("mcc", [0, 0, 4, 8]) == 0.0  # nothing picked positive
    assert binary_metric("mcc", [3, 9, 0, 0]) == 0.0  # everything picked positive
    assert binary_metric("f1", [0, 0, 0, 8]) == 0.0  # no positive, picked or gold
    assert binary_metric("f1", [0, 3, 2, 8]) == 0.0
    with pytest.raises(ValueError, match="no binary metric 'acc'; choose one of mcc, f1"):
        binary_metric("acc", [1, 1, 1, 1])


def test_the_counts_of_picks_give_the_correlation_and_f1_of_their_definitions():
    """Against Pearson's correlation of the 0/1 picks and labels (which MCC is) and F1
    from precision and recall; the pick is the argmax, the first candidate on ties."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(200, 2, generator=g).round(decimals=1)  # ties among them
    labels = torch.randint(0, 2, (200,), generator=g)
    right = torch.nn.functional.one_hot(labels, 2).bool()
    counts = confusion_counts(scores, right)
    picks = scores.argmax(dim=1).numpy()
    assert (scores[:, 0] == scores[:, 1]).any() and counts.sum() == 200
    tp, fp, fn, _ = counts.tolist()
    assert tp == int(((picks == 1) & (labels.numpy() == 1)).sum())
    pearson = np.corrcoef(picks, labels.numpy())[0, 1]
    assert binary_metric("mcc", counts.tolist()) == pytest.approx(pearson, rel=1e-12)
    precision, recall = tp / (tp + fp), tp / (tp + fn)
    f1 = 2 * precision * recall / (precision + recall)
    assert binary_metric("f1", counts.tolist()) == pytest.approx(f1, rel=1e-12)


def tiny_engine() -> ZOEngine:
    torch.manual_seed(0)
    model = RobertaForMaskedLM(tiny_roberta_config(TOKENIZER)).eval()
    return ZOEngine(model, ZOConfig(device="cpu", seed=0), objective=Classification())


def cola_examples(count: int = 15) -> list[MaskedExample]:
    """Rows of words in a random order, whose picks by the tiny model differ."""
    rng = random.Random(0)
    return [
        MaskedExample((" ".join(rng.sample(list(WORDS), 4)),), (i * 7 // 3) % 2)
        for i in range(count)
    ]


def picks_of(monkeypatch, engine, examples, metric, parallel) -> tuple[dict, list[int]]:
    seen: list[int] = []
    hits = evaluation.hits

    def seeing(scores: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        seen.extend(scores.argmax(dim=1).tolist())
        return hits(scores, right)

    monkeypatch.setattr(evaluation, "hits", seeing)
    encoder = MaskedPromptEncoder(TOKENIZER, "cola", 128)
    metrics = evaluation.evaluate_choices(engine, examples, encoder, parallel, 4, metric=metric)
    return metrics, seen


@pytest.mark.parametrize("metric", ["mcc", "f1"])
def test_a_glue_task_is_scored_by_its_metric_beside_accuracy(monkeypatch, metric):
    engine, examples = tiny_engine(), cola_examples()
    metrics, picks = picks_of(monkeypatch, engine, examples, metric, ParallelContext.single())
    labels = [e.label for e in examples]
    assert len(set(picks)) == 2  # both labels picked: the metric is no degenerate 0.0
    expected = {
        "mcc": np.corrcoef(picks, labels)[0, 1],
        "f1": 2 * sum(p & y for p, y in zip(picks, labels)) / (sum(picks) + sum(labels)),
    }[metric]
    assert list(metrics) == [f"eval_{metric}", "eval_accuracy"]  # the task's own first
    assert metrics[f"eval_{metric}"] == pytest.approx(expected, rel=1e-12)
    accuracy = sum(p == y for p, y in zip(picks, labels)) / len(labels)
    assert metrics["eval_accuracy"] == pytest.approx(accuracy)
    plain = picks_of(monkeypatch, engine, examples, "accuracy", ParallelContext.single())[0]
    assert plain == {"eval_accuracy": metrics["eval_accuracy"]}


class ThreadRank:
    """Rank ``rank`` of 2 in a thread, its sums added to the other's as an all-reduce
    adds them: both ranks' values, summed element by element, once both have given
    theirs."""

    def __init__(self, rank: int, given: list, barrier: threading.Barrier) -> None:
        self.env = LaunchEnv(rank=rank, world_size=2)
        self.rank, self.given, self.barrier = rank, given, barrier

    def sum_to_host(self, values):
        self.given[self.rank] = [float(v) for v in values]
        self.barrier.wait()
        summed = [a + b for a, b in zip(*self.given)]
        self.barrier.wait()  # both have read the sums before either gives its next
        return summed


def test_two_ranks_sum_their_confusion_counts_before_the_metric(monkeypatch):
    """dp=2 scores what one process scores; the mean of each rank's own MCC would not."""
    examples = cola_examples()
    whole, _ = picks_of(monkeypatch, tiny_engine(), examples, "mcc", ParallelContext.single())
    given: list = [None, None]
    barrier = threading.Barrier(2, timeout=60)
    results: list = [None, None]
    engines = [tiny_engine(), tiny_engine()]  # a rank's own model, as in a launch
    encoder = MaskedPromptEncoder(TOKENIZER, "cola", 128)

    def rank(r: int) -> None:
        parallel: Any = ThreadRank(r, given, barrier)  # the ParallelContext it stands in for
        results[r] = evaluation.evaluate_choices(
            engines[r], examples, encoder, parallel, 4, metric="mcc"
        )

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results[0] == results[1] == whole
    own = []
    for r in (0, 1):  # each rank's share alone, its sums not reduced
        share = [examples[i] for i in eval_calls.share(len(examples), ThreadRank(r, [], barrier))]
        own.append(picks_of(monkeypatch, tiny_engine(), share, "mcc", ParallelContext.single()))
    mean = sum(metrics["eval_mcc"] for metrics, _ in own) / 2
    assert mean != pytest.approx(whole["eval_mcc"])


def test_cola_s_dev_rows_are_scored_and_logged_by_mcc():
    """The job's evaluation of a masked LM's cola names the dev rows' MCC ``dev_mcc``,
    first, and its log line says it; sst2 keeps accuracy alone."""
    engine, examples = tiny_engine(), cola_examples(6)
    encoder = MaskedPromptEncoder(TOKENIZER, "cola", 128)
    data = MaskedPromptData(LoadedRows("cola", examples, examples, examples), encoder, 0, 4)
    metrics = evaluation.evaluate(engine, data, ParallelContext.single(), split="dev")
    assert list(metrics) == ["dev_mcc", "dev_accuracy"]
    assert describe(metrics).startswith("mcc ") and ", accuracy " in describe(metrics)
    sst2 = MaskedPromptEncoder(TOKENIZER, "sst2", 128)
    data = MaskedPromptData(LoadedRows("sst2", examples, examples), sst2, 0, 4)
    assert list(evaluation.evaluate(engine, data, ParallelContext.single())) == ["eval_accuracy"]


def test_a_cola_run_logs_its_dev_mcc_and_exports_the_step_mcc_chose(tmp_path):
    """Through the CLI: eval.jsonl's dev records hold dev_mcc, the summary's dev.best is
    chosen by it and says so, and --export-best names it in its log line."""
    import json
    import subprocess
    import sys

    from tests.helpers.masked_prompts import save_tiny_roberta

    model = save_tiny_roberta(tmp_path / "model")
    rows = [{"sentence": e.sentences[0], "label": e.label} for e in cola_examples(12)]
    data = tmp_path / "cola.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = tmp_path / "run"
    args = ["--model", str(model), "--task", "cola", "--train-file", str(data)]
    args += ["--eval-file", str(data), "--num-dev", "6", "--eval-steps", "1", "--max-steps"]
    args += ["3", "--batch-size", "2", "--lr", "1e-2", "--export-best", "--output-dir", str(run)]
    proc = subprocess.run(
        [sys.executable, "-m", "distzo.train", *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    dev = [r for r in records if "dev_accuracy" in r]
    assert dev and all(list(r) == ["step", "dev_mcc", "dev_accuracy"] for r in dev)
    assert list(records[0]) == ["step", "eval_mcc", "eval_accuracy"]
    summary = json.loads((run / "summary.json").read_text())
    best = max(dev, key=lambda r: r["dev_mcc"])  # the earliest of the highest
    assert summary["dev"]["best"] == {"by": "dev_mcc", **best}
    assert f"best dev step {best['step']} (dev_mcc {best['dev_mcc']:.4f})" in proc.stderr
