"""Bucket layouts for the low-rank kernels' tests: entries anywhere (1-D entries between
matrices, padding, offsets past 2^31), which ``BucketLayout.build`` does not lay out."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Entry:
    names: tuple[str, ...]
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


@dataclass(frozen=True)
class Layout:
    entries: tuple[Entry, ...]
    numel: int


# 1-D entries between matrices, padding, a matrix of three dimensions (its first by the
# rest), a wide one, a one-row one
LAYOUT = Layout(
    (
        Entry(("a",), 0, (7, 13)),
        Entry(("b",), 91, (13,)),
        Entry(("c",), 110, (5, 3, 4)),
        Entry(("d",), 170, (3,)),
        Entry(("e",), 173, (2, 150)),
        Entry(("f",), 480, (1, 9)),
        Entry(("g",), 489, (40, 33)),
        Entry(("h",), 1809, (1,)),
    ),
    1816,
)
