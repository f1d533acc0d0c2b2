"""Divergence: a step whose loss or projected gradient is NaN or infinite ends the run.

A non-finite ``g`` would be applied to every parameter by the step's pending update, and
the run would go on training (and exporting) garbage with exit code 0. The check reads
the step's reduced values, which are already host floats and the same on every rank
after the step's all-reduce, so every rank stops at the same step with no extra
collective and no extra device sync. Nothing of that step is kept: its pending update is
never applied, saved or logged, so the last checkpoint and the seed log hold the last
good state, from which ``--resume`` goes on.
"""

from __future__ import annotations

import logging
import math

from distzo.config.engine_options import ZOConfig
from distzo.engine import StepResult

logger = logging.getLogger("distzo.train")

EXIT_DIVERGED = 1  # a failure of the run, not bad input (2)


class Diverged(Exception):
    """Step ``step`` (0-based) had a non-finite loss or projected gradient; ``step`` steps
    are done and kept."""

    def __init__(self, step: int, message: str) -> None:
        super().__init__(message)
        self.step = step


def is_finite(result: StepResult) -> bool:
    """Whether the step's reduced losses and every query's ``g`` are finite."""
    values = (result.loss_plus, result.loss_minus, *result.projected_grads)
    return all(math.isfinite(v) for v in values)


def diverged(result: StepResult, config: ZOConfig, last_checkpoint: str | None) -> Diverged:
    """The error of a non-finite step: the step, its values and what to try."""
    grads = ", ".join(f"{g:.4g}" for g in result.projected_grads)
    kept = f"{last_checkpoint} and " if last_checkpoint else ""
    return Diverged(
        result.step,
        f"training diverged at step {result.step}: loss {result.loss:.4g} "
        f"(L+ {result.loss_plus:.4g}, L- {result.loss_minus:.4g}), projected gradient "
        f"{grads} at lr {result.lr:.3g}; the step was not applied, saved or logged, and the "
        f"run keeps {kept}the seed log up to step {result.step - 1}: try a lower --lr "
        f"({config.lr:g} in this run) or a larger --eps ({config.eps:g}); if it persists, "
        "check the data",
    )


def warn_if_nothing_learns(config: ZOConfig) -> None:
    """One warning line for ``--lr 0``: every step is taken and logged, and nothing moves."""
    if config.lr == 0:
        logger.warning("--lr is 0: the parameters will not change, nothing learns")
