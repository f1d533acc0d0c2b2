"""Learning-rate schedules (MeZO used constant and linear decay)."""

from __future__ import annotations

SCHEDULES = ("constant", "linear")


def learning_rate(
    base_lr: float, step: int, schedule: str, warmup_steps: int = 0, max_steps: int | None = None
) -> float:
    """The lr of 0-based ``step``: linear warm-up from 0, then constant or linear decay to 0
    at ``max_steps``; the lr transformers' ``get_constant_schedule_with_warmup`` and
    ``get_linear_schedule_with_warmup`` give the step, as MeZO's runs read it (step 0 of a
    warm-up moves nothing).

    A pure function of the step, so a resumed run sees the same lr as an uninterrupted one.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr * step / warmup_steps
    if schedule == "constant":
        return base_lr
    if schedule == "linear":
        if max_steps is None:
            raise ValueError(
                "lr_schedule 'linear' needs max_steps; set max_steps or use lr_schedule 'constant'"
            )
        span = max(1, max_steps - warmup_steps)
        return base_lr * max(0.0, (max_steps - step) / span)
    raise ValueError(f"unknown lr_schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
