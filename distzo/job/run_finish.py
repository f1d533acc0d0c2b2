"""A run's finish: what a trained run does once its steps are done, on every rank.

``Trainer.train()`` ends in ``RunFinish``: the final checkpoint (or, for a requeue of a
finished run, what its checkpoint, ``export/`` and ``eval.jsonl`` already hold), the dev
rows' last evaluation and the final one, every rank's ``rankN.json`` (agreed on), the
export, and rank 0's report (``distzo.job.run_end``). Every rank takes the same path
through the same collectives; a stop voted after the checkpoint or the evaluation ends
the run there (a resume evaluates and exports). Kept apart from the ``Trainer`` as the
build is (``distzo.job.run_build``): the steps are the trainer's, their end is one
concept of its own.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distzo.dist.agreement import agreed
from distzo.export.hf_model import export_model
from distzo.job import preemption
from distzo.job.evaluation import EvaluationStopped, has_dev
from distzo.job.hub_data_commits import commits_by_source
from distzo.job.preemption import StopSignals, expect
from distzo.job.records import rank_summary
from distzo.job.run_end import (
    Evals,
    Session,
    export_options,
    kept_export,
    recorded_final_evals,
    report_run_end,
)
from distzo.job.summary import key_options

if TYPE_CHECKING:
    from distzo.job.trainer import Trainer

logger = logging.getLogger("distzo.train")


class RunFinish:
    """The end of ``trainer``'s run under ``signals`` (see the module's docstring); the
    trainer's state (``eval_after``, its logs and resources) is left as a finished run's.
    It uses the trainer's own step-boundary tools (``_evaluate``, ``_record_eval``,
    ``_stop_vote``, ``_stop_if_voted``, ``_preempted``), which the periodic evaluations
    share: one path for a divergence, a stop vote and an evaluation's record."""

    def __init__(self, trainer: Trainer, signals: StopSignals | None) -> None:
        self.trainer = trainer
        self.signals = signals

    def run(self, elapsed: float) -> dict[str, float]:
        """The final checkpoint, evaluation and export, and this rank's summary; a stop
        asked for by then ends the run after the checkpoint or the evaluation. ``elapsed``:
        the seconds this process's steps took. Returns the final evaluation."""
        trainer, signals = self.trainer, self.signals
        # Saved before the final evaluation, whose flush a longer run would not make here.
        expect(signals, preemption.AFTER_FINAL_SAVE)
        kept, recorded = False, None  # what a finished run resumed (a requeue) has already
        scoring = trainer.step == 0  # --max-steps 0: the model loaded is scored, nothing trained
        if scoring:  # nothing to keep that the run did not load: no checkpoint, no export
            pass
        elif trainer.step != trainer.checkpointer.loaded_step:
            trainer.save(asynchronous=False)
        else:  # its checkpoint holds this state already, its export and evaluation may
            kept, recorded = self._requeued_end()
        trainer._stop_if_voted(signals)
        expect(signals, preemption.IN_FINAL_EVALUATION)
        after = self._final_evaluation(scoring, recorded)
        trainer.eval_after = after
        if trainer.logs:
            trainer.logs.write_eval(trainer.job.optim.max_steps, after)
        trainer._stop_if_voted(signals)
        expect(signals, preemption.IN_EXPORT)
        # Before the export, and agreed on: a rank whose disk is full (another node's, say)
        # ends every rank with its line, and no export stands for a run that failed.
        self._write_rank_summary(after)
        export = None if scoring else self._final_export(kept)
        trainer.held.close_logs()  # the run directory stays locked until its summary is written
        if trainer.logs:
            self._report(elapsed, after, export)
        trainer.held.release_at_end()
        return after

    def _final_evaluation(self, scoring: bool, recorded: Evals | None) -> dict[str, float]:
        """The dev rows' last evaluation (with --num-dev, as MeZO's run.py scores), then the
        final one, which checks the last step's update: ``recorded`` by the finished run a
        requeue resumed, else evaluated (a run of no steps: the evaluation before it)."""
        trainer = self.trainer
        max_steps, vote = trainer.job.optim.max_steps, trainer._stop_vote(self.signals)
        if recorded is not None:  # finite, or the run would have ended at its divergence
            if "dev" in recorded:
                trainer._record_eval(max_steps, "dev", recorded["dev"])
            return recorded["eval"]
        try:
            if has_dev(trainer.data):
                dev = trainer._evaluate(max_steps, vote, "dev")
                trainer._record_eval(max_steps, "dev", dev)
            if scoring and trainer.eval_before is not None:  # the weights it scored already
                return trainer.eval_before
            return trainer._evaluate(max_steps, vote)
        except EvaluationStopped as stopped:  # the checkpoint holds every step
            trainer._preempted(stopped.received)

    def _requeued_end(self) -> tuple[bool, Evals | None]:
        """What a finished run resumed (a requeue) keeps, as rank 0 finds it and every rank
        acts on alike: whether its ``export/`` is complete and of this state
        (``kept_export``), and its final evaluations as ``eval.jsonl`` records them, by
        split (``recorded_final_evals``; None where a record is missing, or this command
        evaluates otherwise than the run did). Either spares the run's end its minutes."""
        trainer = self.trainer
        found: tuple[bool, Evals | None] = (False, None)
        if trainer.env.rank == 0:
            splits = ("dev", "eval") if has_dev(trainer.data) else ("eval",)
            evals = recorded_final_evals(trainer.logs, trainer.step, splits)
            kept = kept_export(trainer.run_dir, trainer.step, self.export_options) is not None
            found = (kept, evals if trainer.checked.evaluates_as_recorded else None)
        kept, recorded = trainer.parallel.comm.broadcast_object(found)
        logger.info(
            "no steps left: the run's checkpoint of step %d %s%s",
            trainer.step,
            "and its export/ are kept as they are" if kept else "is kept as it is",
            "; its final evaluation is the one eval.jsonl records" if recorded else "",
        )
        return kept, recorded

    def _write_rank_summary(self, after: dict[str, float]) -> None:
        """This rank's ``rankN.json``, agreed on (a rank that cannot write it ends all)."""
        trainer = self.trainer
        summary = trainer.run_dir / f"rank{trainer.env.rank}.json"
        own = rank_summary(
            trainer.engine,
            trainer.parallel,
            trainer.device,
            trainer.job.peft.peft,
            trainer.eval_before,
            after,
        )
        agreed(trainer.parallel.comm, lambda: summary.write_text(json.dumps(own)))

    @property
    def export_options(self) -> dict[str, Any]:
        """The options that make one export of a state differ from another (a resume may
        change them)."""
        return export_options(self.trainer.job)

    def _final_export(self, kept: bool) -> Path | None:
        """The run's ``export/`` (on rank 0): ``kept`` as a requeue found it, else written
        (collective; the directory on rank 0)."""
        trainer = self.trainer
        if kept:
            return trainer.run_dir / "export" if trainer.env.rank == 0 else None
        return export_model(
            trainer.engine,
            trainer.run_dir / "export",
            trainer.tokenizer,
            trainer.job.run.export_shard_size,
            trainer.job.peft.merge_adapter,
            overwrite=True,  # the run's own export/, written again by a resumed run
        )

    def _report(self, elapsed: float, after: dict[str, float], export: Path | None) -> None:
        """Rank 0's curves, summary and last log line, once its logs are closed."""
        trainer = self.trainer
        assert trainer.logs is not None  # rank 0's
        session = Session(
            trainer.start_step, trainer.step - trainer.start_step, elapsed, trainer.meter.tokens
        )
        options = key_options(
            trainer.job,
            trainer.config,
            trainer.objective.name,
            trainer.engine.transfer,
            str(trainer.device),
            trainer.env.world_size,
            commits_by_source(trainer.header.get("data_commits")),
        )
        evals = (trainer.eval_before, after)
        report_run_end(
            trainer.run_dir, trainer.logs, options, session, evals, export, self.export_options
        )
