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
was applied: nothing is kept. An evaluation reads the weights the next step would train
from, so a non-finite one after N steps is step N's divergence by the same rule: the
final evaluation is what checks the last step's update, and a run whose last update
broke the weights neither keeps its final checkpoint nor exports them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from distzo.config.engine_options import ZOConfig
from distzo.engine import StepResult
from distzo.job.checkpoint import latest_checkpoint
from distzo.runtime.units import counted

if TYPE_CHECKING:
    from distzo.job.checkpoint import Checkpointer
    from distzo.job.run_logs import RunLogs

logger = logging.getLogger("distzo.train")

EXIT_DIVERGED = 1  # a failure of the run, not bad input (2)
# The size of a weight an eps must be able to move: pretrained LLMs' matrices hold most of
# their entries below 0.1 (initialised at std 0.02), so a 0.05 ulp is a typical one.
TYPICAL_WEIGHT = 0.05


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


def cut_back(
    step: int, checkpointer: Checkpointer, logs: RunLogs | None, run_dir: Path
) -> tuple[int, Path | None]:
    """Keep a run that diverged at ``step`` as it was before the update that led to it: a
    checkpoint of more steps (in flight or complete) dropped, the logs (rank 0's) cut back
    and closed. Returns the steps kept and the latest checkpoint kept, if any."""
    kept = steps_kept(step)
    for path in checkpointer.discard_after(kept):
        logger.warning("checkpoint %s dropped: it holds the update that diverged", path)
    if logs is not None:
        logs.close_at(kept)  # the seed log synced, ending at step kept - 1
    return kept, latest_checkpoint(run_dir / "checkpoints", most_steps=kept)


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


def is_finite_eval(metrics: Mapping[str, float]) -> bool:
    """Whether every metric of an evaluation is finite (a metric read off NaN scores is
    NaN: ``distzo.job.evaluation``)."""
    return all(math.isfinite(v) for v in metrics.values())


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
    values = (
        f"loss {result.loss:.4g} ({sides[0]} {result.loss_plus:.4g}, {sides[1]} "
        f"{result.loss_minus:.4g}), {coefficients} {grads} at lr {result.lr:.3g}"
    )
    return _diverged(result.step, f"{values}; {dropped}", config, checkpoint)


def eval_diverged(
    done: int, metrics: Mapping[str, float], config: ZOConfig, checkpoint: str | None
) -> Diverged:
    """The error of a non-finite evaluation of the weights after ``done`` steps: those step
    ``done`` would train from, so it is that step's divergence (step ``done - 1``'s update
    led to it; the last step's is checked by the final evaluation alone). Before training
    it is the initial weights' or the forward's, which no --lr changes."""
    values = ", ".join(f"{name.removeprefix('eval_')} {v:.4g}" for name, v in metrics.items())
    if done == 0:
        return Diverged(
            0,
            0,
            f"the evaluation before training is not finite ({values}): the initial weights "
            "give NaN or infinite scores; check the model's weights, and use --compute-dtype "
            "fp32 if a half-precision forward overflows",
        )
    what = f"the evaluation of the weights after {counted(done, 'step')} gives {values}"
    dropped = f"step {done - 1}'s update, which led to it, is not kept"
    return _diverged(done, f"{what}; {dropped}", config, checkpoint)


def _diverged(step: int, what: str, config: ZOConfig, checkpoint: str | None) -> Diverged:
    """A divergence at ``step``: ``what`` went wrong, what is kept and what to try."""
    kept = steps_kept(step)
    return Diverged(
        step,
        kept,
        f"training diverged at step {step}: {what}; {_resumes(kept, checkpoint)}, with a "
        f"lower --lr ({config.lr:g} in this run) or a larger --eps ({config.eps:g}); if it "
        "persists, check the data",
    )


def warn_if_nothing_learns(config: ZOConfig, dtype: torch.dtype) -> None:
    """One warning line for ``--lr 0``: every step is taken and logged, and nothing moves;
    and one for an --eps the perturbed weights' ``dtype`` cannot resolve."""
    if config.lr == 0:
        logger.warning("--lr is 0: the parameters will not change, nothing learns")
    floor = eps_floor(dtype)
    if config.eps < floor:
        logger.warning(
            "--eps %g is below half a unit in the last place of a weight of %g in %s "
            "(%.2g), the dtype the perturbed weights are computed in: theta +- eps z rounds "
            "back to theta (or to its neighbours) for most weights, so g measures rounding, "
            "or is 0, and training learns nothing or goes astray; use a larger --eps "
            "(MeZO's 1e-3; 1e-2 with bf16 or fp16 compute)",
            config.eps,
            TYPICAL_WEIGHT,
            str(dtype).removeprefix("torch."),
            floor,
        )


def eps_floor(dtype: torch.dtype) -> float:
    """Half a unit in the last place of a ``TYPICAL_WEIGHT`` in ``dtype``: an eps z below
    it rounds away (fp32: 3e-9, which --eps 1e-12 is far below: g exactly 0; bf16: 2e-4,
    where --eps 1e-5 gave a g of noise that took the tiny job's loss from 4.2 to 4e7)."""
    return TYPICAL_WEIGHT * torch.finfo(dtype).eps / 2
