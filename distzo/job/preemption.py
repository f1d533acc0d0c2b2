"""Preemption: SIGTERM (SLURM's and the clouds' notice, and what torchrun forwards),
SIGUSR1 or SIGINT (Ctrl-C) asks the job to stop after the step under way.

A signal only sets a flag here; the training loop passes it as this rank's stop vote to
the step's one all-reduce (``ZOEngine.step(stop=...)``), so every rank sees, in the same
step, whether any rank was signalled, and they all stop after that step: ranks signalled
a moment apart never wait for each other in a collective. The job then saves (with
``--save-on-signal``) or relies on its seed log, and exits with ``EXIT_PREEMPTED``
(non-zero, so torchrun and SLURM treat it as a failure to requeue), or ``EXIT_INTERRUPTED``
after a Ctrl-C. A second SIGINT while stopping raises ``KeyboardInterrupt`` at once: the
user asked again, so the step, the save and every wait are abandoned.

Outside the steps there is no step's all-reduce to carry the vote: ``stop_voted`` gathers
it before each forward call of an evaluation (minutes on a large eval set, a grace period's
length), after a periodic checkpoint, and after the final checkpoint and evaluation; a run
signalled by then stops there (a checkpoint or the seed log holds every step: a resume runs
the abandoned evaluation again), rather than spending a cluster's grace period on work that
a kill at its deadline would cut off, unrequeued. ``StopSignals.expect`` keeps the signal's
log line true to the phase.

Before the steps start (the build, which loads a large model for minutes, and the
evaluation before training) there is no step to stop after: a signal raises ``Preempted``
at once, and a job preempted while loading its weights exits then, not when the loading
and a first step are done.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from distzo.dist.collectives import Collectives

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
EXIT_PREEMPTED = 128 + signal.SIGTERM  # the code a process killed by SIGTERM reports
EXIT_INTERRUPTED = 128 + signal.SIGINT  # a shell's code for Ctrl-C
# What a deferred signal does, by the phase it comes in (``StopSignals.expect``).
AFTER_STEP = "stopping after the step under way"
IN_EVALUATION = "stopping the evaluation under way before its next batch (a resume runs it again)"
AFTER_SAVE = "stopping once the checkpoint under way is written"
AFTER_FINAL_SAVE = "stopping once the final checkpoint is written (a resume evaluates and exports)"
IN_FINAL_EVALUATION = (
    "stopping the final evaluation before its next batch (a resume evaluates and exports)"
)
IN_EXPORT = "the run ends once its export is written (nothing is left to resume)"
# What signal.signal installs and returns: a function, SIG_DFL/SIG_IGN, or None (not Python's).
Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class Preempted(Exception):
    """The job stopped at a step boundary on a signal; ``step`` steps are done."""

    def __init__(self, step: int, signal_name: str, before_training: bool = False) -> None:
        where = "before training" if before_training else f"after step {step - 1}"
        super().__init__(f"stopped {where} on {signal_name}")
        self.step = step
        self.signal_name = signal_name
        self.before_training = before_training  # in the build: no step ran, none was kept

    @property
    def exit_code(self) -> int:
        """What the process reports: a shell's Ctrl-C code when this rank got SIGINT, else
        ``EXIT_PREEMPTED`` (a rank stopped by another's vote cannot tell which signal)."""
        return EXIT_INTERRUPTED if self.signal_name == "SIGINT" else EXIT_PREEMPTED


class StopSignals:
    """While entered, SIGTERM, SIGUSR1 and SIGINT set ``requested`` instead of killing the
    process (the main thread only: Python delivers signals there), and a SIGINT after the
    first signal raises ``KeyboardInterrupt``; the old handlers come back on exit. Until
    ``defer`` (the steps under way), a signal raises ``Preempted`` at once instead."""

    def __init__(self) -> None:
        self.received: str | None = None
        self.deferred = False  # a signal waits for the step under way (once steps run)
        self.stopping = AFTER_STEP  # what a deferred signal does now, as its log line says
        self._previous: dict[int, Handler] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def defer(self) -> None:
        """From here on a signal stops the job after the step under way (the steps' stop
        vote); before, nothing is trained that a step boundary would keep."""
        self.deferred = True

    def expect(self, stopping: str) -> None:
        """Say what a signal from here on does (``stopping ...``, its log line): the run's
        phase decides, the step, an evaluation, a save or the final export."""
        self.stopping = stopping

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.deferred:
            self.received = signal.Signals(signum).name
            raise Preempted(0, self.received, before_training=True)
        if self.received is None:
            self.received = signal.Signals(signum).name
            again = " (Ctrl-C again stops at once, unsaved)" if signum == signal.SIGINT else ""
            logger.warning("%s received: %s%s", self.received, self.stopping, again)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: main reports it in one line

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def expect(signals: StopSignals | None, stopping: str) -> None:
    """Tell ``signals`` (if any) what a signal does in the phase that starts."""
    if signals is not None:
        signals.expect(stopping)


def stop_voted(signals: StopSignals | None, comm: Collectives) -> str | None:
    """Whether a rank was signalled, agreed on every rank (one gather): a vote outside the
    steps, at the end of a run. This rank's signal's name, or "a signal to another rank"
    when only another was signalled; None when none was."""
    mine = signals.received if signals is not None else None
    votes = comm.all_gather_object(mine)
    if mine is not None or not any(votes):
        return mine
    return "a signal to another rank"
