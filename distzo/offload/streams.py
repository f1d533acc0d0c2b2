"""Upload / compute / offload streams, ordered by events; a synchronous stand-in on CPU.

One schedule, two backends: on CUDA each phase runs on its own stream and the
phases are chained by events (never a global synchronize); on CPU every call runs
in order on the calling thread, so the same code is tested without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

PHASES = ("upload", "compute", "offload")


class Streams:
    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.is_async = self.device.type == "cuda"
        if self.is_async:
            self._streams = {name: torch.cuda.Stream(device=self.device) for name in PHASES}

    @contextlib.contextmanager
    def on(self, phase: str) -> Iterator[None]:
        """Run the enclosed work on ``phase``'s stream."""
        if not self.is_async:
            yield
            return
        with torch.cuda.stream(self._streams[phase]):
            yield

    @contextlib.contextmanager
    def compute_scope(self) -> Iterator[None]:
        """Run engine work (a step, a read-back) with the compute stream current, joined
        with the caller's stream both ways.

        Entering, all three streams wait for the caller's queued work (a batch it copied,
        a block it loaded, a slot a read-back gathered into); leaving, the caller's stream
        waits for all three, so whatever the engine wrote (results, slots, host copies)
        is safe to use, reuse or tear down after it on the caller's stream.
        """
        if not self.is_async:
            yield
            return
        caller = torch.cuda.current_stream(self.device)
        for stream in self._streams.values():
            stream.wait_stream(caller)
        try:
            with torch.cuda.stream(self._streams["compute"]):
                yield
        finally:
            for stream in self._streams.values():
                caller.wait_stream(stream)

    def record(self, phase: str, timing: bool = False) -> torch.cuda.Event | None:
        """An event marking everything queued so far on ``phase``; None on CPU."""
        if not self.is_async:
            return None
        event = torch.cuda.Event(enable_timing=timing)
        event.record(self._streams[phase])
        return event

    def wait(self, phase: str, event: torch.cuda.Event | None) -> None:
        """Make ``phase`` wait (on the device, not the host) for ``event``."""
        if event is not None and self.is_async:
            self._streams[phase].wait_event(event)

    def synchronize(self) -> None:
        """Block the host until all three streams are idle (step boundaries and export only)."""
        if self.is_async:
            for stream in self._streams.values():
                stream.synchronize()
