"""Start/end times of each upload, compute and offload, for tests and benchmarks.

On CUDA the marks are timing events recorded on the phase's own stream, so they
show when the device ran the work (not when the host queued it); on CPU they are
wall-clock reads around the synchronous call. Either way each span also carries the
host's own time in the call (``host_ms``): on CUDA how long the host took to queue the
work, which, where it is as long as the device's span, means the device waited on the
host's launches; on CPU the same as the span.
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
    host_ms: float = 0.0  # the host's time in the call (queueing it, on CUDA)

    @property
    def ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass
class Timeline:
    streams: Streams
    _marks: list = field(default_factory=list)

    def start(self, phase: str):
        host = time.perf_counter()
        return (self.streams.record(phase, timing=True) if self.streams.is_async else host, host)

    def end(self, phase: str, block: int, start) -> None:
        host = time.perf_counter()
        stop = self.streams.record(phase, timing=True) if self.streams.is_async else host
        mark, host_start = start
        self._marks.append((phase, block, mark, stop, (host - host_start) * 1e3))

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
                Span(p, b, origin.elapsed_time(s), origin.elapsed_time(e), h)
                for p, b, s, e, h in self._marks
            ]
        else:
            out = [Span(p, b, s * 1e3, e * 1e3, h) for p, b, s, e, h in self._marks]
        first = min(s.start_ms for s in out)
        for span in out:
            span.start_ms -= first
            span.end_ms -= first
        return out
