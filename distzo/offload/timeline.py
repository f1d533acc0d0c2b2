"""Start/end times of each upload, compute and offload, for tests and benchmarks.

On CUDA the marks are timing events recorded on the phase's own stream, so they
show when the device ran the work (not when the host queued it); on CPU they are
wall-clock reads around the synchronous call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from distzo.offload.streams import Streams

PROLOGUE = -1  # the block of the compute span before block 0's (the embedding, the resident
# bucket's perturbation), on the compute stream while the first uploads run


@dataclass
class Span:
    phase: str
    block: int
    start_ms: float
    end_ms: float

    @property
    def ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass
class Timeline:
    streams: Streams
    _marks: list = field(default_factory=list)

    def start(self, phase: str):
        return (
            self.streams.record(phase, timing=True)
            if self.streams.is_async
            else time.perf_counter()
        )

    def end(self, phase: str, block: int, start) -> None:
        stop = (
            self.streams.record(phase, timing=True)
            if self.streams.is_async
            else time.perf_counter()
        )
        self._marks.append((phase, block, start, stop))

    def clear(self) -> None:
        self._marks.clear()

    def spans(self) -> list[Span]:
        """Every recorded phase as milliseconds from the first mark (synchronises the device)."""
        if not self._marks:
            return []
        if self.streams.is_async:
            torch.cuda.synchronize(self.streams.device)
            origin = self._marks[0][2]  # any event serves as origin; elapsed times may be negative
            out = [
                Span(p, b, origin.elapsed_time(s), origin.elapsed_time(e))
                for p, b, s, e in self._marks
            ]
        else:
            out = [Span(p, b, s * 1e3, e * 1e3) for p, b, s, e in self._marks]
        first = min(s.start_ms for s in out)
        for span in out:
            span.start_ms -= first
            span.end_ms -= first
        return out
