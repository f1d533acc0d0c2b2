"""How an evaluation goes over the ranks: each rank's contiguous share of the examples,
the forward calls every rank makes (as many as the largest share needs: a rank short of
work repeats a spare batch, since under the sliced transfer each forward's uploads are
collectives), the stop vote before each call, and the one all-reduce of the sums."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch

from distzo.data.row_share import RowShare
from distzo.dist import ParallelContext
from distzo.engine import UNPERTURBED
from distzo.job.progress import evaluation_bar
from distzo.objectives import PassRunner

# Before each forward call of an evaluation: the name of a stop signal some rank got, agreed
# on by every rank (``distzo.job.preemption.stop_voted``), or None to go on.
StopVote = Callable[[], str | None]


class EvaluationStopped(Exception):
    """A stop vote ended an evaluation between two forward calls; nothing was reported."""

    def __init__(self, received: str) -> None:
        super().__init__(f"evaluation stopped on {received}")
        self.received = received


def check_stop(stop: StopVote | None) -> None:
    """Raise ``EvaluationStopped`` when ``stop`` says some rank was signalled."""
    received = stop() if stop is not None else None
    if received is not None:
        raise EvaluationStopped(received)


def rows_per_call(batch_size: int, world: int) -> int:
    """The rows each of ``world`` ranks forwards per call when ``batch_size`` rows go
    through one call over all of them: evaluation's peak memory follows it, so the
    plan and the evaluation read it from here."""
    return max(1, -(-batch_size // world))


def share(count: int, parallel: ParallelContext) -> range:
    """This rank's contiguous share of ``count`` items (sizes differ by at most one): the
    rows whose tokens a text task's data holds on this rank (``RowShare.span``)."""
    return RowShare(parallel.env.rank, parallel.env.world_size).span(count)


def calls(count: int, per_call: int, parallel: ParallelContext) -> int:
    """Forward calls every rank makes: enough for the largest share."""
    largest = math.ceil(count / parallel.env.world_size)
    return max(1, math.ceil(largest / per_call))


def counted_calls(count: int, parallel: ParallelContext) -> Iterator[int]:
    """Each of ``count`` forward calls, counted on rank 0's bar (``evaluation_bar``)."""
    with evaluation_bar(count, show=parallel.env.rank == 0) as done:
        for call in range(count):
            yield call
            done()


def reduce(values: Sequence[torch.Tensor | float], parallel: ParallelContext) -> list[float]:
    """Sum each value over the ranks (on the device, through ``distzo.dist``); one host
    read for all of them."""
    return parallel.sum_to_host(list(values))


def hidden(
    runner: PassRunner, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """The unperturbed model's last hidden states of ``input_ids``."""
    return runner.hidden_states({UNPERTURBED: input_ids}, attention_mask)[UNPERTURBED]


def unless_broken(metric: float, broken: float) -> float:
    """``metric``, or NaN where ``broken`` examples scored NaN or +inf: a metric read off
    their argmax would look like a result of broken weights (the trainer stops at it)."""
    return math.nan if broken else metric
