"""Evaluation, sharded over all ranks and reduced: every rank scores its share of the
examples and the sums are added up, so the metric covers the whole set once
(``eval_calls``: the shares, the calls every rank makes, the stop vote, the reduction).

``--eval-batch-size`` is the rows of one forward call over all the ranks, like
``--batch-size``: each rank forwards its ``rows_per_call`` share of them, the rows the
memory plan counts (``planned_rows``). A choice task's call takes whole examples, or, where
an example has more candidate rows than that (ReCoRD), one piece of an example
(``split_choices``), the pieces' scores joined before the argmax. Every rank makes the
same number of forward calls (a rank short of work repeats a spare batch): under the
sliced transfer each forward's uploads are collectives.
Scores and sums stay on the device until the end of the evaluation (a generation task
reads its tokens back once per batch, to decode and score them); the LM head runs only at
the positions a metric reads.

* classification / multiple choice: each candidate continuation scored by its mean
  token log-likelihood (MeZO's rule); accuracy of the argmax, a hit where it is any
  right candidate (ReCoRD's answers: MeZO's rule too). A masked LM's CoLA, MRPC and QQP
  also get GLUE's metric (``eval_mcc``, ``eval_f1``), of the ranks' summed confusion counts.
  A causal LM's run trained on ``classification`` or ``lm`` also gets that objective's
  loss (``eval_loss``, first), read off the same scores (``choice_loss``): the dev loss
  MeZO's OPT runs keep their best step by.
* generation (SQuAD, DROP): ``generation_evaluation``.
* language modelling: next-token loss and accuracy over the label tokens.

A stop vote (``stop``: a preemption notice to any rank, agreed on by every rank) is taken
before each forward call, so that an evaluation of minutes does not outlast a cluster's
grace period: the evaluation then raises ``EvaluationStopped`` and reports nothing (a
resume runs it again). Every rank votes before the same calls, its collectives kept in step.

A metric read off a score or logit that is NaN or +inf (``broken_rows``) is NaN: an
argmax over them still picks a candidate or a token, and the accuracy or F1 of broken
weights would look like a result. The trainer stops at a non-finite evaluation.

Imports run one way: train -> evaluation -> {engine, data}; ``evaluate`` picks the
evaluation for a task's data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from distzo.data.encoding import ChoiceEncoder, PaddedRows
from distzo.data.task_data import CountingData, MaskedPromptData, PromptData, TextData
from distzo.dist import ParallelContext
from distzo.engine import UNPERTURBED, ZOEngine
from distzo.job.eval_calls import (
    EvaluationStopped,
    StopVote,
    calls,
    check_stop,
    counted_calls,
    hidden,
    reduce,
    rows_per_call,
    share,
    unless_broken,
)
from distzo.job.generation_evaluation import evaluate_generation
from distzo.objectives import PassRunner, candidate_scores, collate_choices, lm_sums
from distzo.objectives.choice import (
    SCORED_LOSSES,
    ChoiceEncoding,
    choice_loss,
    hits,
    label_tokens,
    prepare_choices,
)
from distzo.objectives.choice_pieces import (
    ChoicePiece,
    candidate_count,
    join_scores,
    right_candidates,
    split_choices,
)
from distzo.objectives.confusion import binary_metric, confusion_counts
from distzo.objectives.lm import prepare_lm
from distzo.objectives.scoring import broken_rows
from distzo.runtime.devices import to_device

__all__ = [
    "EvaluationStopped",
    "StopVote",
    "evaluate",
    "evaluate_choices",
    "evaluate_generation",
    "evaluate_lm",
    "has_dev",
    "planned_rows",
    "rows_per_call",
]

# What an evaluation is of: the evaluation rows (--eval-file, --num-eval) or the dev rows
# (--num-dev), whose metrics are named dev_loss, dev_accuracy... in the logs.
SPLITS = ("eval", "dev")


# what a job's task builds (``distzo.job.build.build_task_data``)
TaskData = CountingData | TextData | PromptData | MaskedPromptData


def has_dev(data: TaskData) -> bool:
    """Whether ``data`` holds dev rows, which the evaluations during training then score."""
    if isinstance(data, (PromptData, MaskedPromptData)):
        return bool(data.dev_examples)
    return isinstance(data, TextData) and data.dev_set is not None


def evaluate(
    engine: ZOEngine,
    data: TaskData,
    parallel: ParallelContext,
    stop: StopVote | None = None,
    split: str = "eval",
) -> dict[str, float]:
    """The evaluation that fits ``data``'s task, of its ``split`` rows; ``stop``: voted on
    before each forward call."""
    dev = split == "dev"
    if isinstance(data, (PromptData, MaskedPromptData)):
        examples = data.dev_examples if dev else data.eval_examples
        loss = scored_loss(data)
        if isinstance(data, PromptData) and data.kind == "generation":
            metrics = evaluate_generation(
                engine,
                data.dev_examples if dev else data.eval_examples,
                data.encoder,
                parallel,
                data.eval_batch_size,
                data.max_new_tokens,
                stop,
                loss=loss == "lm",
            )
        else:
            widest = data.dev_rows if dev else data.eval_rows
            metrics = evaluate_choices(
                engine,
                examples,
                data.encoder,
                parallel,
                data.eval_batch_size,
                stop=stop,
                rows=widest,
                metric=data.metric if isinstance(data, MaskedPromptData) else "accuracy",
                loss=loss,
            )
    else:
        rows = data.dev_set if dev and isinstance(data, TextData) else data.eval_set
        assert rows is not None, "a dev evaluation of data without dev rows"
        metrics = evaluate_lm(engine, rows, parallel, data.eval_batch_size, stop=stop)
    if not dev:
        return metrics
    return {"dev_" + name.removeprefix("eval_"): value for name, value in metrics.items()}


def scored_loss(data: PromptData | MaskedPromptData) -> str | None:
    """The objective whose loss a prompt task's evaluation reports: a causal LM's run
    trained on ``lm`` or ``classification`` (MeZO's OPT runs keep the step of the lowest
    dev loss); None for ``accuracy`` and ``f1`` (minus the metric reported) and for a
    masked LM, whose best step MeZO's RoBERTa trainer chooses by its metric."""
    if isinstance(data, MaskedPromptData) or data.objective not in SCORED_LOSSES:
        return None
    return data.objective


def _choices_per_call(batch_size: int, rows: int, world: int) -> int:
    """Whole examples per call when each takes ``rows`` rows; 0 where one takes more than
    a rank's rows a call (``rows_per_call``): its rows then go in pieces, one a call."""
    return rows_per_call(batch_size, world) // rows


def planned_rows(data: TaskData, world: int) -> int:
    """The most rows one rank passes to a forward while evaluating ``data``: never more
    than its ``rows_per_call``, an example of more candidates being scored in pieces."""
    per_call = rows_per_call(data.eval_batch_size, world)
    if isinstance(data, (PromptData, MaskedPromptData)) and data.kind != "generation":
        rows = max(data.eval_rows, data.dev_rows)  # the build's count, every rank's share
        return _choices_per_call(data.eval_batch_size, rows, world) * rows or per_call
    return per_call


def evaluate_choices(
    engine: ZOEngine,
    examples: Sequence[Any],
    encoder: ChoiceEncoder,
    parallel: ParallelContext,
    batch_size: int,
    full_head: bool = False,
    stop: StopVote | None = None,
    rows: int | None = None,
    metric: str = "accuracy",
    loss: str | None = None,
) -> dict[str, float]:
    """Accuracy of the best-scored candidate; ``batch_size`` rows (sequences) per call
    over all the ranks, an example of more candidate rows than a rank's share scored in
    pieces (``split_choices``). ``rows``: the most rows an example of ``examples`` takes,
    the same on every rank (``PromptData.eval_rows``, counted in the build's shared pass);
    None: counted here, every example encoded on every rank. ``metric``: a two-label
    task's GLUE metric (``BINARY_METRICS``: ``eval_mcc``, ``eval_f1``), reported first,
    before the accuracy, read off the confusion counts summed over the ranks. ``loss``:
    the objective (``lm``, ``classification``) whose loss on the examples is reported
    first (``eval_loss``, ``choice_loss``), or None."""
    mine = [examples[i] for i in share(len(examples), parallel)]
    if rows is None:
        rows = max(encoder.choice_rows(e) for e in examples)
    per_rank = rows_per_call(batch_size, parallel.env.world_size)
    work = _choice_work([encoder.encode_choices(e) for e in mine], rows, per_rank)
    # for a call past this rank's share
    spare = [split_choices(encoder.encode_choices(examples[0]), per_rank)[0].encoding]
    tally = _ChoiceTally(engine.device, metric, loss)
    pending: list[tuple[torch.Tensor, ChoicePiece]] = []  # an example's pieces scored so far
    for call in counted_calls(_choice_calls(len(examples), rows, per_rank, parallel), parallel):
        check_stop(stop)
        chunk = work[call] if call < len(work) else []
        prepared = prepare_choices(
            collate_choices([p.encoding for p in chunk] or spare, encoder.pad_id),
            engine.device,
            full_head,
        )

        def scores(runner: PassRunner) -> torch.Tensor:
            states = hidden(runner, prepared.input_ids, prepared.attention_mask)
            return candidate_scores(runner, prepared, UNPERTURBED, states)

        scored = engine.evaluate(scores)
        if chunk and not chunk[0].whole:
            pending.append((scored, chunk[0]))
            if chunk[0].last:
                tally.add(*_joined(pending, engine.device))
                pending = []
        elif chunk:
            tally.add(scored, prepared.right, prepared.labels, label_tokens(prepared))
    return tally.metrics(len(mine), parallel)


@dataclass
class _ChoiceTally:
    """A choice evaluation's sums on one rank, kept on the device until ``metrics``."""

    device: torch.device
    metric: str  # accuracy, or a binary metric reported before it
    loss: str | None  # the objective whose loss is reported first, or None
    sums: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        # hits, broken examples, the loss and what it is a mean over, a binary metric's counts
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        binary = 4 if self.metric != "accuracy" else 0
        counts = torch.zeros(binary, dtype=torch.long, device=self.device)
        self.sums = [zero, zero, zero, zero, *counts]

    def add(
        self, scores: torch.Tensor, right: torch.Tensor, labels: torch.Tensor, tokens: torch.Tensor
    ) -> None:
        """Examples' [E, C] ``scores``, right candidates, labels and labelled tokens."""
        loss, items = choice_loss(self.loss, scores, labels, tokens) if self.loss else (0, 0)
        added = [hits(scores, right).sum(), broken_rows(scores).sum(), loss, items]
        if self.metric != "accuracy":
            added += list(confusion_counts(scores, right))
        self.sums = [s + a for s, a in zip(self.sums, added, strict=True)]

    def metrics(self, examples: int, parallel: ParallelContext) -> dict[str, float]:
        """The metrics of the examples of every rank, ``examples`` this rank's count."""
        right, bad, loss, items, *binary, total = reduce([*self.sums, examples], parallel)
        reported = {"eval_loss": unless_broken(loss / items, bad)} if self.loss else {}
        if self.metric != "accuracy":
            reported[f"eval_{self.metric}"] = unless_broken(binary_metric(self.metric, binary), bad)
        return {**reported, "eval_accuracy": unless_broken(right / total, bad)}


def _choice_work(
    encodings: Sequence[ChoiceEncoding], rows: int, per_rank: int
) -> list[list[ChoicePiece]]:
    """This rank's forward calls: as many whole examples a call as ``per_rank`` rows hold
    where the widest (``rows``) fits, else one piece of an example a call."""
    whole = per_rank // rows
    if whole:
        return [
            [ChoicePiece(e, e, 0, True) for e in encodings[i : i + whole]]
            for i in range(0, len(encodings), whole)
        ]
    return [[piece] for e in encodings for piece in split_choices(e, per_rank)]


def _choice_calls(count: int, rows: int, per_rank: int, parallel: ParallelContext) -> int:
    """The calls of ``_choice_work`` for the largest share, which every rank makes."""
    whole = per_rank // rows
    if whole:
        return calls(count, whole, parallel)
    largest = math.ceil(count / parallel.env.world_size)
    return max(1, largest * math.ceil(rows / per_rank))


def _joined(
    pending: list[tuple[torch.Tensor, ChoicePiece]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An example's scores [1, C], joined from its pieces', its right candidates, its
    label and its labelled candidate's tokens (as ``prepare_choices`` counts them)."""
    example = pending[0][1].example
    candidates = candidate_count(example)
    scores = join_scores([s for s, _ in pending], [p for _, p in pending], candidates)
    tokens = sum(1 for *_, c in example.scored if c == example.label)
    return (
        scores,
        to_device(right_candidates(example, candidates), device),
        to_device(torch.tensor([example.label]), device),
        to_device(torch.tensor([tokens]), device),
    )


def _take(
    batch: Mapping[str, torch.Tensor] | PaddedRows, indices: list[int]
) -> dict[str, torch.Tensor]:
    if isinstance(batch, PaddedRows):
        return batch.take(indices)
    return {k: v[indices] for k, v in batch.items()}


def evaluate_lm(
    engine: ZOEngine,
    batch: Mapping[str, torch.Tensor] | PaddedRows,
    parallel: ParallelContext,
    batch_size: int | None = None,
    full_head: bool = False,
    stop: StopVote | None = None,
) -> dict[str, float]:
    """Next-token loss and accuracy on the label tokens of ``batch``, rows sharded over the
    ranks and scored ``batch_size`` rows per forward call over all of them (the whole batch
    in one call when None: one call per rank, the largest share's rows, so that a rank with
    a smaller share does not make a second call its peers do not)."""
    sequences = len(batch) if isinstance(batch, PaddedRows) else batch["input_ids"].shape[0]
    rows = list(share(sequences, parallel))
    batch_size = rows_per_call(batch_size or sequences, parallel.env.world_size)
    loss = hits = torch.zeros((), dtype=torch.float64, device=engine.device)
    count = 0
    for call in counted_calls(calls(sequences, batch_size, parallel), parallel):
        check_stop(stop)
        chunk = rows[call * batch_size : (call + 1) * batch_size]
        shard = _take(batch, chunk or rows[:1] or [0])  # a spare call repeats a row
        prepared = prepare_lm(shard, engine.device, full_head)

        def sums(runner: PassRunner) -> tuple[torch.Tensor, torch.Tensor]:
            return lm_sums(
                runner,
                prepared,
                UNPERTURBED,
                hidden(runner, prepared.input_ids, prepared.attention_mask),
            )

        nll, right = engine.evaluate(sums)
        if chunk:
            loss, hits, count = loss + nll, hits + right, count + prepared.targets.num_entries
    loss_sum, hit_sum, total = reduce([loss, hits, count], parallel)
    # a NaN loss's argmax hits are picks among NaN logits
    accuracy = hit_sum / total if math.isfinite(loss_sum) else math.nan
    return {"eval_loss": loss_sum / total, "eval_accuracy": accuracy}
