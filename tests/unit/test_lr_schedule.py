"""The lr of each step is the one transformers' schedules give it (MeZO's runs use them):
warm-up from 0, then constant or linear decay to 0 at the last step."""

from __future__ import annotations

import pytest
import torch
from transformers import get_constant_schedule_with_warmup, get_linear_schedule_with_warmup

from distzo.zo.schedule import learning_rate


@pytest.mark.parametrize("schedule", ["constant", "linear"])
@pytest.mark.parametrize("warmup", [0, 1, 4, 12])
def test_each_steps_lr_is_transformers(schedule, warmup):
    max_steps, lr = 10, 0.5
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    if schedule == "linear":
        hf = get_linear_schedule_with_warmup(optimizer, warmup, max_steps)
    else:
        hf = get_constant_schedule_with_warmup(optimizer, warmup)
    theirs = []
    for _ in range(max_steps):  # the lr a step runs with, read before the scheduler steps
        theirs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        hf.step()
    ours = [learning_rate(lr, step, schedule, warmup, max_steps) for step in range(max_steps)]
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-15)
