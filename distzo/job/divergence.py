"""Divergence: a step whose loss or projected gradient is NaN or infinite ends the run.

A non-finite ``g`` would be applied to every parameter by the step's pending update, and
the run would go on training (and exporting) garbage with exit code 0. The check reads
the step's reduced values, which are already host floats and the same on every rank
after the step's all-reduce, so every rank stops at the same step with no extra
collective and no extra device sync.

What is kept is the last good state: the weights of the last finite loss. Step N's loss is
measured on the weights after step N-1's update (each update rides on the next pass), so
a non-finite loss at step N says that update, its ``g`` finite but too large, broke the
weights: neither step N nor step N-1 is kept. The run keeps N-1 steps: a checkpoint of
more steps is dropped (it carries step N-1's update, and a resume from it diverges at
once, whatever its --lr) and the logs end at step N-2, so ``--resume`` (with a lower
--lr) trains step N-1 again from the weights whose loss was finite. At step 0 nothing
was applied: nothing is kept.
"""

from __future__ import annotations

import logging
import math

from distzo.config.engine_options import ZOConfig
from distzo.engine import StepResult

logger = logging.getLogger("distzo.train")

EXIT_DIVERGED = 1  # a failure of the run, not bad input (2)


class Diverged(Exception):
    """Step ``step`` (0-based) had a non-finite loss or projected gradient; ``kept`` steps
    (``step - 1``, as the module says, or 0) are kept."""

    def __init__(self, step: int, kept: int, message: str) -> None:
        super().__init__(message)
        self.step = step
        self.kept = kept


def is_finite(result: StepResult) -> bool:
    """Whether the step's reduced losses and every query's ``g`` are finite."""
    values = (result.loss_plus, result.loss_minus, *result.projected_grads)
    return all(math.isfinite(v) for v in values)


def steps_kept(step: int) -> int:
    """The steps a run that diverged at step ``step`` keeps: all before the update that led
    to the non-finite loss (step ``step - 1``'s), none at step 0."""
    return max(step - 1, 0)


def _resumes(kept: int, checkpoint: str | None) -> str:
    """What the run keeps and how it goes on from there."""
    if kept == 0:
        return "no step is kept: start afresh (--overwrite)"
    log = f"the seed log up to step {kept - 1}"
    if checkpoint is None:
        return (
            f"the run keeps {log} and no checkpoint: --resume auto catches up with it from "
            f"the initial weights and goes on from step {kept}"
        )
    return f"the run keeps {checkpoint} and {log}: --resume goes on from step {kept}"


def diverged(result: StepResult, config: ZOConfig, checkpoint: str | None) -> Diverged:
    """The error of a non-finite step: the step, its values, what is kept and what to try.
    ``checkpoint``: the latest one of at most ``steps_kept`` steps, if any."""
    grads = ", ".join(f"{g:.4g}" for g in result.projected_grads)
    kept = steps_kept(result.step)
    dropped = (
        f"neither this step nor step {kept}, whose update led to it, is kept"
        if result.step
        else "the initial weights give it"
    )
    # FZOO's other end is the unperturbed loss, and its coefficients are not gradients
    sides, coefficients = (
        (("L+", "L-"), "projected gradient")
        if config.estimator != "fzoo"  # lozo's passes are SPSA's
        else (("mean L(theta + eps z)", "L(theta)"), "update coefficients")
    )
    return Diverged(
        result.step,
        kept,
        f"training diverged at step {result.step}: loss {result.loss:.4g} "
        f"({sides[0]} {result.loss_plus:.4g}, {sides[1]} {result.loss_minus:.4g}), "
        f"{coefficients} {grads} at lr {result.lr:.3g}; {dropped}; "
        f"{_resumes(kept, checkpoint)}, with a lower --lr ({config.lr:g} in this run) "
        f"or a larger --eps ({config.eps:g}); if it persists, check the data",
    )


def warn_if_nothing_learns(config: ZOConfig) -> None:
    """One warning line for ``--lr 0``: every step is taken and logged, and nothing moves."""
    if config.lr == 0:
        logger.warning("--lr is 0: the parameters will not change, nothing learns")
