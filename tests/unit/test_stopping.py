"""How a step ends a run: a non-finite loss or any query's ``g`` is a divergence, which
keeps the steps before the update that led to it, and SIGINT sets the stop vote once, then
raises ``KeyboardInterrupt``."""

import logging
import math
import signal
import threading
from typing import Any

import pytest
import torch

from distzo.config.engine_options import ZOConfig
from distzo.dist.collectives import Collectives
from distzo.engine import StepResult
from distzo.job.divergence import (
    diverged,
    eval_diverged,
    is_finite,
    is_finite_eval,
    steps_kept,
    warn_if_nothing_learns,
)
from distzo.job.preemption import (
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    Preempted,
    StopSignals,
    stop_voted,
)
from distzo.zo.estimators import FZOO, SPSA


def result(losses: list[float], grads: tuple[float, ...], step: int = 3) -> StepResult:
    return StepResult.of(step, 1e-3, 16, losses, SPSA().step_losses(losses), grads, 0.0)


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


def test_a_signal_before_the_steps_stops_at_once_and_after_them_waits_for_the_step():
    """The build loads a model for minutes and no step is under way: a preemption notice
    there stops the job at once; once the steps run, it waits for the step under way."""
    with StopSignals() as signals:
        with pytest.raises(Preempted, match="^stopped before training on SIGTERM$") as stopped:
            signal.raise_signal(signal.SIGTERM)
        assert stopped.value.before_training and stopped.value.exit_code == EXIT_PREEMPTED
        signals.received = None
        signals.defer()
        signal.raise_signal(signal.SIGTERM)
        assert signals.received == "SIGTERM"


def test_a_first_sigint_asks_for_a_stop_and_a_second_stops_at_once():
    before = signal.getsignal(signal.SIGINT)
    with StopSignals() as signals:
        signals.defer()
        signal.raise_signal(signal.SIGINT)
        assert signals.received == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGTERM)  # a later notice changes nothing
        assert signals.received == "SIGINT"
    assert signal.getsignal(signal.SIGINT) is before
    assert Preempted(4, "SIGINT").exit_code == EXIT_INTERRUPTED == 130
    assert Preempted(4, "SIGTERM").exit_code == EXIT_PREEMPTED == 143


@pytest.mark.parametrize(
    "sig, hint",
    [
        (signal.SIGUSR1, ""),  # SLURM's --signal=USR1 notice: not a kill
        (signal.SIGTERM, ""),
        (signal.SIGINT, " (Ctrl-C again stops at once, unsaved)"),
    ],
)
def test_each_stop_signal_is_noted_in_one_line_and_only_ctrl_c_offers_a_second(sig, hint, caplog):
    with caplog.at_level(logging.WARNING), StopSignals() as signals:
        signals.defer()
        signal.raise_signal(sig)
    assert signals.received == sig.name
    assert [r.getMessage() for r in caplog.records] == [
        f"{sig.name} received: stopping after the step under way{hint}"
    ]


def test_stop_signals_entered_off_the_main_thread_leave_the_handlers_alone():
    """Python installs handlers from the main thread only (ValueError elsewhere)."""
    before = signal.getsignal(signal.SIGTERM)
    failed: list[BaseException] = []

    def enter() -> None:
        try:
            with StopSignals():
                assert signal.getsignal(signal.SIGTERM) is before
        except BaseException as err:  # reported on the main thread
            failed.append(err)

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert failed == []


class Votes(Collectives):
    """One process standing in for a job whose other ranks voted ``others``."""

    def __init__(self, others: list[str | None]) -> None:
        super().__init__(torch.device("cpu"))
        self.others = others

    def all_gather_object(self, value: Any) -> list[Any]:
        return [value, *self.others]


@pytest.mark.parametrize(
    "mine, others, voted",
    [
        (None, [None, None], None),
        ("SIGTERM", [None], "SIGTERM"),
        ("SIGUSR1", ["SIGTERM"], "SIGUSR1"),  # this rank's own signal first
        (None, [None, "SIGTERM"], "a signal to another rank"),
    ],
)
def test_a_stop_vote_outside_the_steps_stops_every_rank_if_any_was_signalled(mine, others, voted):
    signals = StopSignals()
    signals.received = mine
    assert stop_voted(signals, Votes(others)) == voted


def test_a_rank_without_stop_signals_still_follows_the_others_vote():
    assert stop_voted(None, Votes([None])) is None
    assert stop_voted(None, Votes(["SIGTERM"])) == "a signal to another rank"


NAN = ([math.nan, math.nan], (math.nan,))
VALUES = "loss nan (L+ nan, L- nan), projected gradient nan at lr 0.001"
TRY = (
    "with a lower --lr (0.001 in this run) or a larger --eps (0.001); if it persists, check "
    "the data"
)


@pytest.mark.parametrize(
    "step, checkpoint, kept, says",
    [
        (
            3,
            "runs/a/checkpoints/step-2",
            2,
            "neither this step nor step 2, whose update led to it, is kept; the run keeps "
            "runs/a/checkpoints/step-2 and the seed log up to step 1: --resume goes on from "
            "step 2",
        ),
        (
            3,
            None,
            2,
            "neither this step nor step 2, whose update led to it, is kept; the run keeps the "
            "seed log up to step 1 and no checkpoint: --resume auto catches up with it from the "
            "initial weights and goes on from step 2",
        ),
        (
            1,
            None,
            0,
            "neither this step nor step 0, whose update led to it, is kept; no step is kept: "
            "start afresh (--overwrite)",
        ),
        (0, None, 0, "the initial weights give it; no step is kept: start afresh (--overwrite)"),
    ],
)
def test_a_divergence_keeps_the_steps_before_the_update_that_led_to_it(
    step, checkpoint, kept, says
):
    """Step N's loss is measured after step N-1's update: N-1 steps are kept (none at 0)."""
    assert steps_kept(step) == kept
    error = diverged(result(*NAN, step=step), ZOConfig(lr=1e-3, eps=1e-3), checkpoint)
    assert (error.step, error.kept) == (step, kept)
    assert str(error) == f"training diverged at step {step}: {VALUES}; {says}, {TRY}"


def test_an_fzoo_divergence_names_its_own_losses_and_coefficients():
    losses = [math.nan, 1.0, 2.0]  # L_1, L_2, then L_0 = L(theta)
    step = StepResult.of(3, 1e-3, 16, losses, FZOO().step_losses(losses), (math.nan, 0.5), 0.0)
    config = ZOConfig(lr=1e-3, eps=1e-3, estimator="fzoo", num_queries=2, noise="rademacher")
    assert not is_finite(step)
    assert str(diverged(step, config, None)).startswith(
        "training diverged at step 3: loss 2 (mean L(theta + eps z) nan, L(theta) 2), update "
        "coefficients nan, 0.5 at lr 0.001; "
    )


def test_a_nan_evaluation_names_the_update_that_led_to_it_or_the_initial_weights():
    """An evaluation after N steps reads the weights step N would train from."""
    assert is_finite_eval({"eval_loss": 1.0, "eval_accuracy": 0.5})
    assert not is_finite_eval({"eval_loss": 1.0, "eval_accuracy": math.nan})
    config = ZOConfig(lr=1e-3, eps=1e-3)
    after = eval_diverged(2, {"eval_accuracy": math.nan}, config, "runs/a/checkpoints/step-1")
    assert (after.step, after.kept) == (2, 1)
    assert str(after) == (
        "training diverged at step 2: the evaluation of the weights after 2 steps gives "
        "accuracy nan; step 1's update, which led to it, is not kept; the run keeps "
        "runs/a/checkpoints/step-1 and the seed log up to step 0: --resume goes on from step "
        "1, with a lower --lr (0.001 in this run) or a larger --eps (0.001); if it persists, "
        "check the data"
    )
    first = eval_diverged(1, {"eval_loss": math.nan}, config, None)  # step 0's update
    assert (first.step, first.kept) == (1, 0)
    assert str(first).startswith(
        "training diverged at step 1: the evaluation of the weights after 1 step gives loss "
        "nan; step 0's update, which led to it, is not kept; no step is kept: start afresh "
        "(--overwrite), with a lower --lr (0.001 in this run)"
    )
    before = eval_diverged(0, {"eval_loss": math.inf, "eval_accuracy": math.nan}, config, None)
    assert (before.step, before.kept) == (0, 0)
    assert str(before) == (
        "the evaluation before training is not finite (loss inf, accuracy nan): the initial "
        "weights give NaN or infinite scores; check the model's weights, and use "
        "--compute-dtype fp32 if a half-precision forward overflows"
    )


@pytest.mark.parametrize(
    "eps, dtype, warns",
    [
        (1e-12, torch.float32, True),  # theta + eps z == theta: g exactly 0
        (1e-8, torch.float32, False),
        (1e-5, torch.bfloat16, True),  # g is rounding noise
        (1e-3, torch.bfloat16, False),  # the docs' measured 2% error of g
        (1e-5, torch.float16, True),
        (1e-4, torch.float16, False),
        (1e-12, torch.float64, False),
    ],
)
def test_an_eps_the_perturbed_weights_cannot_resolve_warns_in_one_line(eps, dtype, warns, caplog):
    with caplog.at_level(logging.WARNING, logger="distzo.train"):
        warn_if_nothing_learns(ZOConfig(lr=1e-3, eps=eps), dtype)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == warns
    if warns:
        assert said[0].startswith(f"--eps {eps:g} is below half a unit in the last place of ")
        assert "use a larger --eps" in said[0]
