"""``Trainer``: one training job, from its options to its exported model.

``python -m distzo.train`` is ``Trainer(job).train()`` with the command line's options;
from Python the same job runs in process. The trainer checks the options when it is
made (every rank alike, before any process group or model), builds the parts on
``build()`` (``distzo.job.run_build``; the first ``train()`` does), runs the loop,
evaluates and checkpoints, ends the run (``distzo.job.run_finish``: the final checkpoint,
evaluation and export), and keeps its state readable: ``step`` (steps done), ``engine``,
``last_metrics`` (the last step's record), ``eval_before``/``eval_after``.

Callbacks (``TrainerCallback``) see each step start and end and each checkpoint save;
they are how a tool watches or steers a run from Python (the tests inject their
failures through them).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NoReturn

import torch

from distzo.config.engine_options import ZOConfig
from distzo.config.job import JobConfig
from distzo.dist import LaunchEnv, ParallelContext
from distzo.dist.launch_gate import report_refusal
from distzo.engine import StepResult, ZOEngine
from distzo.job import preemption
from distzo.job.build import (
    TaskData,
)
from distzo.job.checkpoint import Checkpointer
from distzo.job.divergence import (
    Diverged,
    cut_back,
    diverged,
    eval_diverged,
    is_finite,
    is_finite_eval,
    warn_if_nothing_learns,
)
from distzo.job.evaluation import EvaluationStopped, StopVote, evaluate, has_dev
from distzo.job.preemption import Preempted, StopSignals, expect, stop_voted
from distzo.job.progress import Progress
from distzo.job.records import StepMeter, describe, seed_record
from distzo.job.reporting import Reporter
from distzo.job.run_build import build_run
from distzo.job.run_end import draw_run_curves
from distzo.job.run_finish import RunFinish
from distzo.job.run_logs import RunLogs
from distzo.job.run_resources import RunResources
from distzo.job.scoring_requeue import report_recorded_score
from distzo.job.validation import validate
from distzo.models.hub import quiet_hub_retries
from distzo.objectives import Objective
from distzo.runtime.units import counted

logger = logging.getLogger("distzo.train")


class TrainerCallback:
    """Hook points of a run; each is a no-op here, a subclass overrides those it needs."""

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        """Before step ``step`` (0-based) draws its batch."""

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        """After step ``step`` is taken and its records written."""

    def on_save(self, trainer: Trainer, step: int, asynchronous: bool) -> None:
        """After the checkpoint of ``step`` steps was written, or, ``asynchronous``, while a
        background thread writes it."""


class Trainer:
    """One training job (see the module's docstring). The parts (``RunParts``'s fields)
    exist after ``build()``."""

    device: torch.device
    parallel: ParallelContext
    seed: int  # the run seed, drawn by rank 0 when the options asked for a random one
    run_dir: Path
    reporter: Reporter | None  # rank 0's dashboard, which its logs feed
    tokenizer: Any
    data: TaskData
    objective: Objective
    engine: ZOEngine
    header: dict[str, Any]  # the seed log's
    start_step: int  # where this process's training began (a resume: after 0)
    meter: StepMeter
    progress: Progress  # the current train()'s

    def __init__(
        self,
        job: JobConfig,
        env: LaunchEnv | None = None,
        callbacks: Iterable[TrainerCallback] = (),
    ) -> None:
        self.job = job
        self.env = env if env is not None else LaunchEnv.from_environ()
        self.callbacks = list(callbacks)
        quiet_hub_retries(self.env.local_rank)  # validation may reach the hub, on every rank
        try:
            checked = validate(job, self.env)  # bad input fails here, one line, on every rank
        except Exception as err:
            report_refusal(self.env, err)  # another node's ranks learn it at once
            raise
        self.checked = checked
        self.config: ZOConfig = checked.config
        self.step = 0  # steps done
        self.last_metrics: dict[str, Any] | None = None
        self.eval_before: dict[str, float] | None = None
        self.eval_after: dict[str, float] | None = None
        self.held = RunResources()  # what the run takes and gives back when it ends
        self.built = False
        self.failed = False  # train() raised: a new Trainer goes on (resume=yes)

    @property
    def logs(self) -> RunLogs | None:
        """Rank 0's logs, from ``build()`` (None on the other ranks)."""
        return self.held.logs

    @property
    def checkpointer(self) -> Checkpointer:
        """The run's checkpoints, from ``build()``."""
        if self.held.checkpointer is None:
            raise AttributeError("Trainer.checkpointer: build() makes it")
        return self.held.checkpointer

    @property
    def closed(self) -> bool:
        """Whether the run's logs are closed: a finished or failed run, or ``close()``."""
        return self.held.closed

    # -- building

    def build(self) -> None:
        """Make every part (``distzo.job.run_build``): the process group, the model and its
        data, the engine, the restored state of a resumed run, the logs. Once; ``train``
        calls it. A requeue of a finished scoring run builds nothing: a resume of no steps
        opened its logs afresh, deleting the record that ``train`` reports."""
        if self.built or self.checked.recorded_score is not None:
            return
        try:
            parts = build_run(self.checked, self.env, self.held)
        except BaseException:
            # A start that failed leaves the process as it found it: a retried train()
            # would otherwise take the run's count for the caller's and give that back.
            self.held.cpu_threads.give_back()
            raise
        for field in dataclasses.fields(parts):  # trainer.engine, trainer.run_dir, ...
            setattr(self, field.name, getattr(parts, field.name))
        self.step = self.start_step
        self.built = True

    # -- training

    def train(self, signals: StopSignals | None = None) -> dict[str, float]:
        """Train to --max-steps, then save, evaluate and export; returns the final
        evaluation. ``signals``: a preemption notice or Ctrl-C stops every rank after the
        same step (``Preempted``); a non-finite loss or ``g`` stops every rank at that step,
        which is not kept (``Diverged``). A requeue of a finished scoring run (--max-steps 0)
        returns the evaluation it recorded, with nothing built (``distzo.job.scoring_requeue``)."""
        # A run that failed mid-way would go on from its first step with the engine where it
        # stopped: every step logged twice, the weights trained further.
        self._refuse_when_over("train()", built=True)
        if self.checked.recorded_score is not None:
            return self._report_recorded_score(self.checked.recorded_score)
        self.build()
        try:
            return self._train(signals)
        except BaseException as exc:
            self.failed = True
            self.held.end_failed(isinstance(exc, Preempted) and exc.before_training)
            raise

    def _report_recorded_score(self, recorded: dict[str, dict[str, float]]) -> dict[str, float]:
        """A requeue of a finished scoring run (``distzo.job.scoring_requeue``): its recorded
        evaluation, with nothing built, loaded or written; the run is over."""
        self.run_dir = Path(self.job.run.output_dir or ".")
        self.eval_before = self.eval_after = recorded["eval"]
        if self.env.rank == 0:
            report_recorded_score(self.run_dir, recorded)
        self.held.close()
        return recorded["eval"]

    def _train(self, signals: StopSignals | None) -> dict[str, float]:
        if self.env.rank == 0:
            warn_if_nothing_learns(self.config, self.engine.block_scratch.dtype)
        # An evaluation applies the pending update (a flush), and with a low-bit transfer a
        # flush moves a rounding point: a resumed run evaluates where it starts only where the
        # uninterrupted run did (a periodic evaluation a preemption or the end of a shorter
        # run came before), so its trajectory stays that run's.
        if self.start_step == 0:
            self.eval_before = self._evaluate(0)
            logger.info("eval before training: %s", describe(self.eval_before))
            if self.logs:
                self.logs.write_eval(0, self.eval_before)
        elif self._evaluates_at(self.start_step):
            self._periodic_eval(self.start_step)
        if signals is not None:
            signals.defer()  # a stop waits for the step under way from here on
        started = time.perf_counter()
        max_steps = self.job.optim.max_steps
        self.progress = Progress(self.start_step, max_steps, show=self.env.rank == 0)
        try:
            for step in range(self.start_step, max_steps):
                result = self._train_step(step, signals)
                self.progress.update(
                    step + 1,
                    loss=f"{result.loss:.4f}",
                    g=f"{result.projected_grad:+.3g}",
                    tok_s=f"{self.meter.tokens_per_s:.0f}",
                )
                self._after_step(step, result, signals)
        finally:
            self.progress.close()
        return RunFinish(self, signals).run(time.perf_counter() - started)

    def _train_step(self, step: int, signals: StopSignals | None) -> StepResult:
        """One ZO step on the global batch (the same rows on every rank), and its records."""
        for callback in self.callbacks:
            callback.on_step_start(self, step)
        self.meter.start()
        batch = self.data.batch(self.job.data.batch_size, step)
        result = self.engine.step(
            self.parallel.shard_batch(batch),
            num_items=self.objective.num_items(batch),  # label tokens or examples, global
            stop=signals is not None and signals.requested,
        )
        if not is_finite(result):  # the same reduced values on every rank: all stop here
            self._diverge(step, lambda last: diverged(result, self.config, last))
        self.checkpointer.confirm(step)  # a checkpoint of ``step`` steps did not diverge
        self.last_metrics = self.meter.record(step, result, batch["input_ids"].numel())
        self.step = step + 1
        if self.logs:
            self.logs.write("metrics", self.last_metrics)
            self.logs.write("seeds", seed_record(step, result, self.engine.run_seed))
        for callback in self.callbacks:
            callback.on_step_end(self, step, self.last_metrics)
        return result

    def _after_step(self, step: int, result: StepResult, signals: StopSignals | None) -> None:
        """A preemption's stop, the log line, the periodic evaluation and checkpoint."""
        if result.stop:  # a rank was signalled: every rank stops here, after this step's records
            self._stop(signals.received if signals else None)
        run, max_steps, done = self.job.run, self.job.optim.max_steps, step + 1
        self.progress.log_step(step, result, run.log_every)
        if self._evaluates_at(done):
            self._periodic_eval(done, signals)
        if run.save_steps and done % run.save_steps == 0 and done < max_steps:
            expect(signals, preemption.AFTER_SAVE)
            self.save(asynchronous=run.save_async)
            # A signal during a save of minutes stops the run here, rather than after one
            # more step and, with --save-on-signal, a second save: this one holds every step.
            self._stop_if_voted(signals)
            expect(signals, preemption.AFTER_STEP)
        self.checkpointer.poll()

    def _evaluates_at(self, done: int) -> bool:
        """Whether the run evaluates the state after ``done`` steps before going on."""
        every, max_steps = self.job.run.eval_steps, self.job.optim.max_steps
        return bool(every) and done % every == 0 and 0 < done < max_steps

    def _evaluate(
        self, done: int, stop: StopVote | None = None, split: str = "eval"
    ) -> dict[str, float]:
        """The evaluation of the weights after ``done`` steps on the ``split`` rows; a
        non-finite one (reduced: the same on every rank) is step ``done``'s divergence,
        before it is logged. ``stop``: voted on before each forward call
        (``EvaluationStopped``)."""
        metrics = evaluate(self.engine, self.data, self.parallel, stop, split)
        if not is_finite_eval(metrics):
            self._diverge(done, lambda last: eval_diverged(done, metrics, self.config, last))
        self.checkpointer.confirm(done)
        return metrics

    def _periodic_eval(self, done: int, signals: StopSignals | None = None) -> None:
        """The evaluation every --eval-steps; a signal stops it (and the run) between two
        forward calls, as the kill at a grace period's end would not wait for its end."""
        expect(signals, preemption.IN_EVALUATION)
        split = "dev" if has_dev(self.data) else "eval"  # MeZO's: the dev rows, where given
        try:
            metrics = self._evaluate(done, self._stop_vote(signals), split)
        except EvaluationStopped as stopped:
            self._stop(stopped.received)  # nothing logged: a resume evaluates here again
        expect(signals, preemption.AFTER_STEP)
        self._record_eval(done, split, metrics)
        if self.logs:
            draw_run_curves(self.run_dir, self.logs)

    def _record_eval(self, done: int, split: str, metrics: dict[str, float]) -> None:
        """An evaluation of the state after ``done`` steps on the ``split`` rows: its log
        line and (rank 0) its record, once (``RunLogs.write_eval``)."""
        logger.info("%s at step %d: %s", split, done, describe(metrics))
        if self.logs:
            self.logs.write_eval(done, metrics)

    def save(self, asynchronous: bool = False) -> None:
        """Checkpoint the state after ``step`` steps (``asynchronous``: written by a thread
        while training goes on). Refused before ``build()`` (nothing to save) and after the
        run failed or closed: its directory is released to the next job, and after
        ``Diverged`` the engine holds the update that diverged, whose checkpoint a resume
        would take as the latest (and refuse, the seed log ending before it)."""
        self._refuse_when_over("save()", built=self.built)
        self.checkpointer.save(asynchronous=asynchronous)
        for callback in self.callbacks:
            callback.on_save(self, self.engine.step_index, asynchronous)

    def _refuse_when_over(self, call: str, built: bool) -> None:
        """One line for ``call`` on a run that failed or closed (or is not ``built``)."""
        if not built:  # a fresh Trainer: nothing to save yet, and nothing over
            raise RuntimeError(
                f"Trainer.{call}: this Trainer's run is not built yet, nothing to save; "
                "save() runs while it trains (from a callback given to Trainer, after train() "
                "starts)"
            )
        state = "failed" if self.failed else "is closed"
        if self.failed or self.closed:
            raise RuntimeError(
                f"Trainer.{call}: this Trainer's run {state} after {counted(self.step, 'step')}; "
                "make a new Trainer to go on (resume=yes goes on from its checkpoint); save() runs "
                "while it trains (from a callback)"
            )

    def _stop(self, received: str | None) -> NoReturn:
        """End a preempted run at a step boundary: a checkpoint of the steps done with
        ``--save-on-signal`` (else the synced seed log is what a restart catches up from),
        an asynchronous save in flight completed, the logs closed; then ``Preempted``."""
        if self.job.run.save_on_signal:
            self.save(asynchronous=False)
        else:
            self.checkpointer.wait()
        self._preempted(received or "a signal to another rank")

    def _preempted(self, received: str) -> NoReturn:
        """Close the run (the seed log synced) and raise ``Preempted`` after its steps."""
        self.close()
        raise Preempted(self.step, received)

    def _stop_vote(self, signals: StopSignals | None) -> StopVote | None:
        """The vote an evaluation under way takes before each forward call (one gather on
        every rank alike), or None where no signal can stop the run (no ``signals``)."""
        if signals is None:
            return None
        return lambda: stop_voted(signals, self.parallel.comm)

    def _stop_if_voted(self, signals: StopSignals | None) -> None:
        """End the run here if any rank was signalled since its last step: its checkpoint
        holds every step, so a resume only evaluates and exports (``stop_voted``). No
        vote without ``signals``: no rank can be stopped."""
        received = stop_voted(signals, self.parallel.comm) if signals is not None else None
        if received is not None:
            self._preempted(received)

    def _diverge(self, step: int, error: Callable[[str | None], Diverged]) -> NoReturn:
        """End a run at its first non-finite step, keeping the state before the update that
        led to it (``distzo.job.divergence``): neither that step's pending update nor the
        one before it is applied again (no flush, evaluation, save or export follows), a
        checkpoint of more steps (in flight or complete) is dropped, the logs are cut back
        and closed (``cut_back``); then ``error`` of the latest checkpoint kept, if any."""
        self.step, last = cut_back(step, self.checkpointer, self.logs, self.run_dir)
        raise error(str(last) if last is not None else None)

    def close(self) -> None:
        """Complete an asynchronous save still in flight, then close the logs (the seed log
        synced); the trainer's state stays readable. A run that fails mid-way so keeps the
        checkpoint it had started: the state was copied when the save began. The wait has no
        bound of its own (``Checkpointer.wait``): a failure that took a peer's process ends
        it within --dist-timeout, and a Ctrl-C abandons the save. The run directory is
        unlocked for the next job, and torch's CPU thread count (``--threads``) is the
        caller's again."""
        self.held.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
