"""Checks that one rank makes and every rank must act on.

Once the process group exists, a check that can fail on one rank only (rank 0 reading the
seed log, a memory check on one GPU, rank 0 writing the run's files) must not end that
rank alone: its peers would wait in their next collective until a timeout (under NCCL,
with SIGTERM taken as a preemption notice, until torchrun kills them). ``agreed`` runs the
check on every rank and gathers every rank's verdict over the host group, so that every
rank raises the same one-line error, named by the first rank that failed, and the job
ends at once with exit code 2 (bad input) or 1 (a failed write) on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from distzo.dist.collectives import Collectives

T = TypeVar("T")


def agreed(comm: Collectives, check: Callable[[], T]) -> T:
    """``check()`` on every rank; if it raised ``ValueError`` or ``OSError`` on any rank,
    every rank raises it (the first failing rank's, by rank order)."""
    verdict: tuple[str, str, int | None, str | None] | None = None
    result: T | None = None
    try:
        result = check()
    except ValueError as err:
        verdict = ("ValueError", str(err), None, None)
    except OSError as err:
        verdict = ("OSError", err.strerror or str(err), err.errno, err.filename)
    verdicts = comm.all_gather_object(verdict) if comm.distributed else [verdict]
    for rank, failed in enumerate(verdicts):
        if failed is None:
            continue
        kind, message, errno, filename = failed
        if len(verdicts) > 1 and any(v != failed for v in verdicts):
            message = f"rank {rank}: {message}"  # not every rank saw it: say where
        if kind == "ValueError":
            raise ValueError(message)
        raise OSError(errno, message, filename)
    return result  # type: ignore[return-value]  # no rank failed: check() returned


def gathered(comm: Collectives, compute: Callable[[], T]) -> list[T]:
    """Every rank's ``compute()``, in rank order, on every rank; where it raised
    ``ValueError`` on any rank, every rank raises the first failing rank's, as it was (a
    rank's part of a pass over a file's rows: the error a pass over the whole file would
    have raised first, not one of a rank)."""
    outcome: tuple[T | None, str | None]
    try:
        outcome = (compute(), None)
    except ValueError as err:
        outcome = (None, str(err))
    outcomes = comm.all_gather_object(outcome) if comm.distributed else [outcome]
    for _, error in outcomes:
        if error is not None:
            raise ValueError(error)
    return [result for result, _ in outcomes]  # type: ignore[misc]  # none failed
