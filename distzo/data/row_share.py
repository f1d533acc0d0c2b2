"""One process's share of a pass over a file's rows, and how the shares of a job meet.

The pass that reads every row's token lengths (the rows the limit cuts, the memory
plan's longest sequence) tokenized the whole file on every rank: a million SST-2 rows
took 221 s of one rank's build, paid again by each of a node's eight ranks. With a share,
each rank tokenizes its part of the rows and the parts' counts meet (``meet``: the job's
collective; in one process, the pass alone). The data package knows no ranks: the job
gives the share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def alone(compute: Callable[[], Any]) -> list[Any]:
    """The one part's result: a process that shares its pass with none."""
    return [compute()]


@dataclass(frozen=True)
class RowShare:
    """Part ``part`` of ``parts``; ``meet(compute)``: every part's ``compute()`` in part
    order, or the error of the first part that raised one, on every part."""

    part: int = 0
    parts: int = 1
    meet: Callable[[Callable[[], Any]], list[Any]] = alone

    def span(self, count: int) -> range:
        """This part's rows of ``count``: a contiguous run, so that the first part to fail
        holds the first bad row, the one a pass over the whole file would name."""
        return range(count * self.part // self.parts, count * (self.part + 1) // self.parts)


WHOLE = RowShare()  # a process alone: every row its own
