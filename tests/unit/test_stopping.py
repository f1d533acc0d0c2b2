"""How a step ends a run: a non-finite loss or any query's ``g`` is a divergence, and
SIGINT sets the stop vote once, then raises ``KeyboardInterrupt``."""

import math
import signal

import pytest

from distzo.engine import StepResult
from distzo.job.divergence import is_finite
from distzo.job.preemption import EXIT_INTERRUPTED, EXIT_PREEMPTED, Preempted, StopSignals


def result(losses: list[float], grads: tuple[float, ...]) -> StepResult:
    return StepResult.of(3, 1e-3, 16, losses, grads, 0.0)


@pytest.mark.parametrize(
    "losses, grads, finite",
    [
        ([1.0, 0.9, 1.1, 1.0], (50.0, 50.0), True),
        ([1.0, math.nan, 1.1, 1.0], (math.nan, 50.0), False),
        ([math.inf, 0.9, 1.1, 1.0], (math.inf, 50.0), False),
        ([1.0, 0.9, 1.1, 1.0], (50.0, -math.inf), False),  # one query's g alone
    ],
)
def test_a_step_is_finite_only_if_its_losses_and_every_g_are(losses, grads, finite):
    assert is_finite(result(losses, grads)) is finite


def test_a_first_sigint_asks_for_a_stop_and_a_second_stops_at_once():
    before = signal.getsignal(signal.SIGINT)
    with StopSignals() as signals:
        signal.raise_signal(signal.SIGINT)
        assert signals.received == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGTERM)  # a later notice changes nothing
        assert signals.received == "SIGINT"
    assert signal.getsignal(signal.SIGINT) is before
    assert Preempted(4, "SIGINT").exit_code == EXIT_INTERRUPTED == 130
    assert Preempted(4, "SIGTERM").exit_code == EXIT_PREEMPTED == 143
