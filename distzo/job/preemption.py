"""Preemption: SIGTERM (SLURM's and the clouds' notice, and what torchrun forwards) or
SIGUSR1 asks the job to stop after the step under way.

A signal only sets a flag here; the training loop passes it as this rank's stop vote to
the step's one all-reduce (``ZOEngine.step(stop=...)``), so every rank sees, in the same
step, whether any rank was signalled, and they all stop after that step: ranks signalled
a moment apart never wait for each other in a collective. The job then saves (with
``--save-on-signal``) or relies on its seed log, and exits with ``EXIT_PREEMPTED``
(non-zero, so torchrun and SLURM treat it as a failure to requeue).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_PREEMPTED = 128 + signal.SIGTERM  # the code a process killed by SIGTERM reports
# What signal.signal installs and returns: a function, SIG_DFL/SIG_IGN, or None (not Python's).
Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class Preempted(Exception):
    """The job stopped at a step boundary on a signal; ``step`` steps are done."""

    def __init__(self, step: int, signal_name: str) -> None:
        super().__init__(f"stopped after step {step - 1} on {signal_name}")
        self.step = step
        self.signal_name = signal_name


class StopSignals:
    """While entered, SIGTERM and SIGUSR1 set ``requested`` instead of killing the process
    (the main thread only: Python delivers signals there); the old handlers come back on exit."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Handler] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            logger.warning("%s received: stopping after the step under way", self.received)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
