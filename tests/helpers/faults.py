"""Failures injected into a training job for the tests of failure handling, through the
trainer's callbacks: the product itself reads none of these variables.

* ``DISTZO_FAIL_AT=RANK:STEP``: that rank raises just before that step.
* ``DISTZO_SIGNAL_AT=RANK:STEP[:SIGNAL],...``: that rank sends itself SIGNAL (default
  SIGTERM, a preemption notice; SIGINT is a Ctrl-C) just before that step, unless the run
  resumes. Entries are comma-separated and sent in order: ``0:5:SIGINT,1:5:SIGINT`` is a
  Ctrl-C reaching both ranks, the same entry twice a second Ctrl-C.
* ``DISTZO_KILL_AT=RANK:STEP``: that rank SIGKILLs itself there, on a job's first
  attempt only (torchrun's restarts then go on).
* ``DISTZO_CRASH_IN_SAVE=STEP``: the process exits abruptly right after launching that
  step's asynchronous checkpoint.
* ``DISTZO_SIGNAL_AFTER_SAVE=RANK:STEPS``: that rank sends itself SIGTERM once its
  synchronous checkpoint of STEPS steps is written (the final one: a notice arriving in
  the run's last phase, before its evaluation and export).
* ``DISTZO_UNWRITABLE_SUMMARY=RANK``: after its last step that rank finds a directory
  where its ``rankN.json`` goes (its node cannot write it, as a full disk would not let it).

A launched job loads them with ``python -m tests.helpers.faulty_train`` in place of
``python -m distzo.train``.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Mapping
from typing import Any

from distzo.job.trainer import Trainer, TrainerCallback

FAIL_AT = "DISTZO_FAIL_AT"
SIGNAL_AT = "DISTZO_SIGNAL_AT"
KILL_AT = "DISTZO_KILL_AT"
CRASH_IN_SAVE = "DISTZO_CRASH_IN_SAVE"
UNWRITABLE_SUMMARY = "DISTZO_UNWRITABLE_SUMMARY"
SIGNAL_AFTER_SAVE = "DISTZO_SIGNAL_AFTER_SAVE"
VARIABLES = (FAIL_AT, SIGNAL_AT, KILL_AT, CRASH_IN_SAVE, UNWRITABLE_SUMMARY, SIGNAL_AFTER_SAVE)

logger = logging.getLogger(__name__)


def injects(environ: Mapping[str, str] | None) -> bool:
    """Whether ``environ`` asks for a fault (a launch then runs the faulty entry point)."""
    return environ is not None and any(name in environ for name in VARIABLES)


def _signals_at(spec: str | None, rank: int, step: int) -> list[signal.Signals]:
    """The signals of the ``RANK:STEP[:SIGNAL]`` entries of ``spec`` naming ``rank`` and
    ``step``, in order."""
    signals = []
    for entry in spec.split(",") if spec else ():
        fault_rank, fault_step, *name = entry.split(":")
        if (int(fault_rank), int(fault_step)) == (rank, step):
            signals.append(signal.Signals[name[0] if name else "SIGTERM"])
    return signals


def _step_of(spec: str | None, rank: int) -> int | None:
    """The step of ``RANK:STEP`` when it names ``rank``."""
    if not spec:
        return None
    fault_rank, step = (int(x) for x in spec.split(":"))
    return step if fault_rank == rank else None


class Faults(TrainerCallback):
    """The failures ``environ`` names, injected at the trainer's hook points."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.environ = dict(os.environ if environ is None else environ)

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        rank = trainer.env.rank
        if step == _step_of(self.environ.get(FAIL_AT), rank):
            raise RuntimeError(f"failure injected by {FAIL_AT} at step {step}")
        if trainer.job.run.resume != "yes":
            for sig in _signals_at(self.environ.get(SIGNAL_AT), rank, step):
                signal.raise_signal(sig)  # its handler runs before this returns
        if step == _step_of(self.environ.get(KILL_AT), rank) and trainer.env.restart_count == 0:
            logger.error("killing rank %d at step %d (%s)", rank, step, KILL_AT)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        rank = trainer.env.rank
        last = step == trainer.job.optim.max_steps - 1
        if last and self.environ.get(UNWRITABLE_SUMMARY) == str(rank):
            (trainer.run_dir / f"rank{rank}.json").mkdir()

    def on_save(self, trainer: Trainer, step: int, asynchronous: bool) -> None:
        signalled = step == _step_of(self.environ.get(SIGNAL_AFTER_SAVE), trainer.env.rank)
        if signalled and not asynchronous and trainer.job.run.resume != "yes":
            signal.raise_signal(signal.SIGTERM)  # its handler runs before this returns
        if asynchronous and self.environ.get(CRASH_IN_SAVE) == str(step):
            logger.error(
                "crashing during the asynchronous save of step %d (%s)", step, CRASH_IN_SAVE
            )
            os._exit(1)
