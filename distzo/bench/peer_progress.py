"""How far a peers run got: which peer was built when, for the log as it happens and for
the note a run stopped at its time limit leaves in its partial report.

A device command is cut at a fixed limit; a run of large models that is cut while its
peers build must still say which peers were built, in how long, and which were not, or
the lease's minutes leave nothing to plan the next one with.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class Readies(Protocol):
    """What ``await_ready`` needs of a peer (``PeerProcess``)."""

    name: str

    def ready(self, timeout: float | None = None) -> dict[str, Any] | None: ...


@dataclass
class PeerProgress:
    """The run's clock and each peer's build time, in the order the peers became ready."""

    names: list[str]
    started: float = field(default_factory=time.monotonic)
    built: dict[str, float] = field(default_factory=dict)
    stepping: list[str] = field(default_factory=list)  # took steps (or began to)
    measured: list[str] = field(default_factory=list)  # took all of theirs

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def ready(self, name: str, build_s: float) -> None:
        self.built[name] = build_s
        print(
            f"peers.py: {name} is ready (built in {build_s:.1f} s, {self.elapsed():.0f} s "
            f"into the run; {len(self.built)} of {len(self.names)})",
            file=sys.stderr,
        )

    def stop_note(self, why: str) -> str:
        """One note: when and why the run stopped, what was built and what was not."""
        built = ", ".join(f"{n} in {s:.0f} s" for n, s in self.built.items()) or "none"
        note = f"Stopped ({why}) {self.elapsed():.0f} s into the run. Built: {built}"
        waiting = [n for n in self.names if n not in self.built]
        if waiting:
            note += f"; still building: {', '.join(waiting)}"
        unmeasured = [n for n in self.stepping if n not in self.measured]
        if unmeasured:
            note += f"; steps not finished: {', '.join(unmeasured)}"
        return note


def await_ready(
    peers: Sequence[Readies], progress: PeerProgress, poll_s: float = 0.2
) -> dict[str, dict[str, Any]]:
    """Every peer's ready line, taken in the order they come (each said as it comes), so
    that a run stopped while peers build knows exactly which were built."""
    ready: dict[str, dict[str, Any]] = {}
    while len(ready) < len(peers):
        for peer in peers:
            if peer.name in ready:
                continue
            message = peer.ready(timeout=poll_s)
            if message is not None:
                ready[peer.name] = message
                progress.ready(peer.name, float(message["build_s"]))
    return ready
