"""Evaluation, sharded over all ranks and reduced: every rank scores its share of the
examples and the sums are added up, so the metric covers the whole set once.

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
* generation (SQuAD, DROP): greedy decoding of a whole batch together, ``max_new_tokens``
  tokens cut at the first newline; SQuAD's F1 and exact match against every gold
  answer (the best one counts).
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from distzo.data.encoding import ChoiceEncoder, PaddedRows, PromptEncoder
from distzo.data.row_share import RowShare
from distzo.data.task_data import CountingData, MaskedPromptData, PromptData, TextData
from distzo.data.templates import Example
from distzo.dist import ParallelContext
from distzo.engine import UNPERTURBED, ZOEngine
from distzo.job.progress import evaluation_bar
from distzo.objectives import (
    PassRunner,
    answer_text,
    candidate_scores,
    collate_choices,
    collate_prompts,
    exact_match,
    f1_score,
    greedy_decode,
    lm_sums,
)
from distzo.objectives.choice import ChoiceEncoding, hits, prepare_choices
from distzo.objectives.choice_pieces import (
    ChoicePiece,
    candidate_count,
    join_scores,
    right_candidates,
    split_choices,
)
from distzo.objectives.confusion import binary_metric, confusion_counts
from distzo.objectives.generation import PromptBatch, flagged, prepare_prompts
from distzo.objectives.lm import prepare_lm
from distzo.objectives.scoring import broken_rows
from distzo.runtime.devices import to_device
from distzo.zo.estimators import Pass

# Before each forward call of an evaluation: the name of a stop signal some rank got, agreed
# on by every rank (``distzo.job.preemption.stop_voted``), or None to go on.
StopVote = Callable[[], str | None]


class EvaluationStopped(Exception):
    """A stop vote ended an evaluation between two forward calls; nothing was reported."""

    def __init__(self, received: str) -> None:
        super().__init__(f"evaluation stopped on {received}")
        self.received = received


def _check(stop: StopVote | None) -> None:
    """Raise ``EvaluationStopped`` when ``stop`` says some rank was signalled."""
    received = stop() if stop is not None else None
    if received is not None:
        raise EvaluationStopped(received)


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
        if isinstance(data, PromptData) and data.kind == "generation":
            metrics = evaluate_generation(
                engine,
                data.dev_examples if dev else data.eval_examples,
                data.encoder,
                parallel,
                data.eval_batch_size,
                data.max_new_tokens,
                stop,
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
            )
    else:
        rows = data.dev_set if dev and isinstance(data, TextData) else data.eval_set
        assert rows is not None, "a dev evaluation of data without dev rows"
        metrics = evaluate_lm(engine, rows, parallel, data.eval_batch_size, stop=stop)
    if not dev:
        return metrics
    return {"dev_" + name.removeprefix("eval_"): value for name, value in metrics.items()}


def rows_per_call(batch_size: int, world: int) -> int:
    """The rows each of ``world`` ranks forwards per call when ``batch_size`` rows go
    through one call over all of them: evaluation's peak memory follows it, so the
    plan and the evaluation read it from here."""
    return max(1, -(-batch_size // world))


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


def _share(count: int, parallel: ParallelContext) -> range:
    """This rank's contiguous share of ``count`` items (sizes differ by at most one): the
    rows whose tokens a text task's data holds on this rank (``RowShare.span``)."""
    return RowShare(parallel.env.rank, parallel.env.world_size).span(count)


def _calls(count: int, per_call: int, parallel: ParallelContext) -> int:
    """Forward calls every rank makes: enough for the largest share."""
    largest = math.ceil(count / parallel.env.world_size)
    return max(1, math.ceil(largest / per_call))


def _counted_calls(calls: int, parallel: ParallelContext) -> Iterator[int]:
    """Each of ``calls`` forward calls, counted on rank 0's bar (``evaluation_bar``)."""
    with evaluation_bar(calls, show=parallel.env.rank == 0) as done:
        for call in range(calls):
            yield call
            done()


def _reduce(values: Sequence[torch.Tensor | float], parallel: ParallelContext) -> list[float]:
    """Sum each value over the ranks (on the device, through ``distzo.dist``); one host
    read for all of them."""
    return parallel.sum_to_host(list(values))


def _hidden(
    runner: PassRunner, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    return runner.hidden_states({UNPERTURBED: input_ids}, attention_mask)[UNPERTURBED]


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
) -> dict[str, float]:
    """Accuracy of the best-scored candidate; ``batch_size`` rows (sequences) per call
    over all the ranks, an example of more candidate rows than a rank's share scored in
    pieces (``split_choices``). ``rows``: the most rows an example of ``examples`` takes,
    the same on every rank (``PromptData.eval_rows``, counted in the build's shared pass);
    None: counted here, every example encoded on every rank. ``metric``: a two-label
    task's GLUE metric (``BINARY_METRICS``: ``eval_mcc``, ``eval_f1``), reported first,
    before the accuracy, read off the confusion counts summed over the ranks."""
    mine = [examples[i] for i in _share(len(examples), parallel)]
    if rows is None:
        rows = max(encoder.choice_rows(e) for e in examples)
    per_rank = rows_per_call(batch_size, parallel.env.world_size)
    work = _choice_work([encoder.encode_choices(e) for e in mine], rows, per_rank)
    # for a call past this rank's share
    spare = [split_choices(encoder.encode_choices(examples[0]), per_rank)[0].encoding]
    correct = broken = torch.zeros((), dtype=torch.long, device=engine.device)
    counts = torch.zeros(4, dtype=torch.long, device=engine.device)  # a binary metric's
    pending: list[tuple[torch.Tensor, ChoicePiece]] = []  # an example's pieces scored so far
    calls = _choice_calls(len(examples), rows, per_rank, parallel)
    for call in _counted_calls(calls, parallel):
        _check(stop)
        chunk = work[call] if call < len(work) else []
        prepared = prepare_choices(
            collate_choices([p.encoding for p in chunk] or spare, encoder.pad_id),
            engine.device,
            full_head,
        )

        def scores(runner: PassRunner) -> torch.Tensor:
            hidden = _hidden(runner, prepared.input_ids, prepared.attention_mask)
            return candidate_scores(runner, prepared, UNPERTURBED, hidden)

        scored, right = engine.evaluate(scores), prepared.right
        if chunk and not chunk[0].whole:
            pending.append((scored, chunk[0]))
            if not chunk[0].last:
                continue
            scored, right = _joined(pending, engine.device)
            pending = []
        if chunk:
            correct = correct + hits(scored, right).sum()
            broken = broken + broken_rows(scored).sum()
            if metric != "accuracy":
                counts = counts + confusion_counts(scored, right)
    binary = list(counts) if metric != "accuracy" else []
    right_sum, bad, total, *summed = _reduce([correct, broken, len(mine), *binary], parallel)
    accuracy = {"eval_accuracy": _unless_broken(right_sum / total, bad)}
    if metric == "accuracy":
        return accuracy
    return {f"eval_{metric}": _unless_broken(binary_metric(metric, summed), bad), **accuracy}


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
        return _calls(count, whole, parallel)
    largest = math.ceil(count / parallel.env.world_size)
    return max(1, largest * math.ceil(rows / per_rank))


def _joined(
    pending: list[tuple[torch.Tensor, ChoicePiece]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """An example's scores [1, C], joined from its pieces', and its right candidates."""
    example = pending[0][1].example
    candidates = candidate_count(example)
    scores = join_scores([s for s, _ in pending], [p for _, p in pending], candidates)
    return scores, to_device(right_candidates(example, candidates), device)


def _unless_broken(metric: float, broken: float) -> float:
    """``metric``, or NaN where ``broken`` examples scored NaN or +inf: a metric read off
    their argmax would look like a result of broken weights (the trainer stops at it)."""
    return math.nan if broken else metric


def evaluate_generation(
    engine: ZOEngine,
    examples: Sequence[Example],
    encoder: PromptEncoder,
    parallel: ParallelContext,
    batch_size: int,
    max_new_tokens: int = 16,
    stop: StopVote | None = None,
) -> dict[str, float]:
    """Greedy answers of ``batch_size`` examples at a time over all the ranks, decoded
    together."""
    share = _share(len(examples), parallel)
    batch_size = rows_per_call(batch_size, parallel.env.world_size)
    f1 = em = 0.0
    broken = 0
    for call in _counted_calls(_calls(len(examples), batch_size, parallel), parallel):
        _check(stop)
        chunk = list(share[call * batch_size : (call + 1) * batch_size])
        indices = chunk or [0]
        prompts = encoder.encode_prompts([examples[i].prompt for i in indices], max_new_tokens)
        prepared = prepare_prompts(
            collate_prompts(prompts, indices, max_new_tokens, encoder.pad_id), engine.device
        )
        decoded = engine.evaluate(lambda runner: _decode(runner, prepared))
        for i, row in zip(chunk, decoded.tolist()):  # one read per batch
            prediction = answer_text(encoder.answer, row[:-1])
            broken += row[-1]
            f1 += max(f1_score(prediction, gold) for gold in examples[i].answers)
            em += max(exact_match(prediction, gold) for gold in examples[i].answers)
    f1_sum, em_sum, bad, total = _reduce([f1, em, broken, len(share)], parallel)
    return {
        "eval_f1": _unless_broken(f1_sum / total, bad),
        "eval_exact_match": _unless_broken(em_sum / total, bad),
    }


def _decode(runner: PassRunner, prepared: PromptBatch) -> torch.Tensor:
    """The greedy tokens of the unperturbed pass, each row's broken flag as a last column."""
    broken: dict[Pass, torch.Tensor] = {}
    tokens = greedy_decode(runner, prepared, (UNPERTURBED,), broken)[UNPERTURBED]
    return flagged(tokens, broken[UNPERTURBED])


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
    rows = list(_share(sequences, parallel))
    batch_size = rows_per_call(batch_size or sequences, parallel.env.world_size)
    loss = hits = torch.zeros((), dtype=torch.float64, device=engine.device)
    count = 0
    for call in _counted_calls(_calls(sequences, batch_size, parallel), parallel):
        _check(stop)
        chunk = rows[call * batch_size : (call + 1) * batch_size]
        shard = _take(batch, chunk or rows[:1] or [0])  # a spare call repeats a row
        prepared = prepare_lm(shard, engine.device, full_head)

        def sums(runner: PassRunner) -> tuple[torch.Tensor, torch.Tensor]:
            return lm_sums(
                runner,
                prepared,
                UNPERTURBED,
                _hidden(runner, prepared.input_ids, prepared.attention_mask),
            )

        nll, right = engine.evaluate(sums)
        if chunk:
            loss, hits, count = loss + nll, hits + right, count + prepared.targets.num_entries
    loss_sum, hit_sum, total = _reduce([loss, hits, count], parallel)
    # a NaN loss's argmax hits are picks among NaN logits
    accuracy = hit_sum / total if math.isfinite(loss_sum) else math.nan
    return {"eval_loss": loss_sum / total, "eval_accuracy": accuracy}
