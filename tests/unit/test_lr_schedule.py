"""The lr of each step is the one transformers' schedules give it (MeZO's runs use them):
warm-up from 0, then constant or linear decay to 0 at the last step."""

from __future__ import annotations

import pytest
import torch
from transformers import get_constant_schedule_with_warmup, get_linear_schedule_with_warmup

from distzo.zo.schedule import learning_rate
from tests.helpers.engines import engine_for
from tests.helpers.models import base_model, random_batch


def transformers_lrs(lr: float, schedule: str, warmup: int, max_steps: int) -> list[float]:
    """The lr each step runs with under transformers' schedule, read before it steps."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    if schedule == "linear":
        hf = get_linear_schedule_with_warmup(optimizer, warmup, max_steps)
    else:
        hf = get_constant_schedule_with_warmup(optimizer, warmup)
    theirs = []
    for _ in range(max_steps):
        theirs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        hf.step()
    return theirs


@pytest.mark.parametrize("schedule", ["constant", "linear"])
@pytest.mark.parametrize("warmup", [0, 1, 4, 12])
def test_each_steps_lr_is_transformers(schedule, warmup):
    max_steps, lr = 10, 0.5
    ours = [learning_rate(lr, step, schedule, warmup, max_steps) for step in range(max_steps)]
    theirs = transformers_lrs(lr, schedule, warmup, max_steps)
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("warmup", [0, 4, 12])
def test_a_step_past_max_steps_has_lr_0_as_transformers(warmup):
    """An engine stepped past ``max_steps`` through the Python API decays no further:
    transformers clamps the linear schedule at 0, where a negative lr would climb the loss."""
    lrs = [learning_rate(0.5, step, "linear", warmup, 10) for step in range(12, 16)]
    assert lrs == [0.0] * 4


def test_a_direct_call_refuses_a_schedule_it_cannot_compute():
    """``distzo.zo.learning_rate`` is public: no config check stands before it there."""
    with pytest.raises(ValueError, match="^unknown lr_schedule 'cosine'; choose one of "):
        learning_rate(0.5, 3, "cosine", 0, 10)
    with pytest.raises(ValueError, match="^lr_schedule 'linear' needs max_steps; "):
        learning_rate(0.5, 3, "linear")


def test_the_engine_steps_with_its_steps_lr_so_warm_up_step_0_moves_nothing():
    """Step t runs with the schedule's lr of t, not of t + 1: the first step of a warm-up
    leaves the weights as they were, bit for bit."""
    max_steps, lr = 5, 1e-2
    engine = engine_for(
        base_model("opt"), lr=lr, lr_schedule="linear", warmup_steps=2, max_steps=max_steps
    )
    initial = engine.named_parameters()
    first = engine.step(random_batch(64, pad="left", seed=0))
    assert all(
        torch.equal(value, initial[name]) for name, value in engine.named_parameters().items()
    )
    rest = [engine.step(random_batch(64, pad="left", seed=t)) for t in range(1, max_steps)]
    lrs = [r.lr for r in (first, *rest)]
    assert lrs == pytest.approx(transformers_lrs(lr, "linear", 2, max_steps), rel=1e-12, abs=0)
