"""The end of a run, on rank 0: the training curves drawn from the whole run's logs,
``summary.json``, and the one line that says what the run did and where its files are.

The run's finish (``distzo.job.run_finish``) hands over what it measured (``Session``)
and where the files went; what is read back (every step's loss, every evaluation) comes
from the logs, so a resumed run's curves and summary cover the whole run.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from distzo.config.job import JobConfig
from distzo.job.checkpoint import latest_checkpoint
from distzo.job.curves import CURVES, draw_curves
from distzo.job.records import describe, eval_split
from distzo.job.run_logs import RunLogs, read_records
from distzo.job.summary import SUMMARY, read_summary, run_summary, write_summary
from distzo.runtime.units import counted

logger = logging.getLogger("distzo.train")

Evals = dict[str, dict[str, float]]  # evaluations by split ("dev", "eval")


@dataclasses.dataclass(frozen=True)
class Session:
    """This process's share of the run: the step it started from, the steps it took, its
    time and the tokens its steps read."""

    start_step: int
    steps: int
    seconds: float
    tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    def record(self) -> dict[str, Any]:
        """The summary's ``session`` entry."""
        return {
            "start_step": self.start_step,
            "steps": self.steps,
            "seconds": self.seconds,
            "tokens_per_s": self.tokens_per_s,
        }


def draw_run_curves(run_dir: Path, logs: RunLogs) -> Path:
    """``curves.png`` in ``run_dir`` from the whole run's loss (the logs keep it: no
    metrics.jsonl read back at each evaluation) and evaluations."""
    curve = logs.loss_curve
    return draw_curves(
        run_dir / CURVES, curve.steps, curve.losses, read_records(logs.paths["eval"])
    )


def report_run_end(
    run_dir: Path,
    logs: RunLogs,
    options: dict[str, Any],
    session: Session,
    evals: tuple[dict[str, float] | None, dict[str, float]],
    export: Path | None,
    export_options: dict[str, Any],
) -> None:
    """The closed run's curves and summary, and its last log line. ``options``: the
    summary's key options; ``evals``: the evaluation before this session's training (none
    on a resume) and the final one; ``export``: None for a run of no steps (--max-steps 0:
    a scoring run, which saves nothing); ``export_options``: those the export was written
    with (``export_record``)."""
    # the whole run's loss, kept by the logs (a million steps' metrics.jsonl read back as
    # dicts was a gigabyte), and its evaluations, read once for the picture and the summary
    loss, eval_records = logs.loss_curve, read_records(logs.paths["eval"])
    curves = draw_curves(run_dir / CURVES, loss.steps, loss.losses, eval_records)
    steps = session.start_step + session.steps
    files = {
        "checkpoint": latest_checkpoint(run_dir / "checkpoints"),
        "export": export,
        "curves": curves,
        "config": run_dir / "config.toml",
        "metrics": logs.paths["metrics"],
        "eval_log": logs.paths["eval"],
    }
    record = run_summary(options, steps, session.record(), loss.losses, eval_records, files)
    if export is not None:
        record["export_written"] = export_record(export, export_options)
    summary = write_summary(run_dir / SUMMARY, {**record, **later_records(run_dir)})
    before, after = evals
    if export is None:  # --max-steps 0 (rank 0 has the export of a run that trained)
        logger.info(
            "done: scored without training (--max-steps 0): eval %s; nothing was trained, so "
            "no checkpoint or export/ was written (the model is the one loaded); summary %s, "
            "curves %s",
            describe(after),
            summary,
            curves,
        )
        return
    logger.info(
        "done: %s in %.1f s (%.0f tokens/s); eval %s%s; model exported to %s; "
        "summary %s, curves %s",
        counted(session.steps, "step"),
        session.seconds,
        session.tokens_per_s,
        f"{describe(before)} -> " if before else f"(resumed at step {session.start_step}) ",
        describe(after),
        export,
        summary,
        curves,
    )


# What the command adds to the summary once the run has ended: ``--export-best``'s record
# of export-best/ (its step, export options and files' sizes), as export_written's.
BEST_WRITTEN = "export_best_written"


def later_records(run_dir: Path) -> dict[str, Any]:
    """The records the command added to an earlier session's summary after its end, which
    a requeue of the finished run (whose summary a run with steps left has removed) keeps
    for that command to judge: ``--export-best`` keeps the folder they describe where they
    still hold, rather than replaying the whole seed log to write it again."""
    summary = read_summary(run_dir) or {}
    return {key: summary[key] for key in (BEST_WRITTEN,) if key in summary}


def export_record(export: Path, options: dict[str, Any]) -> dict[str, Any]:
    """What the summary keeps of the export: the options it was written with and the size
    of each of its files, which a requeue of the finished run checks (``kept_export``)."""
    files = sorted(p for p in export.rglob("*") if p.is_file())
    return {**options, "files": {str(p.relative_to(export)): p.stat().st_size for p in files}}


def kept_export(run_dir: Path, steps: int, options: dict[str, Any]) -> Path | None:
    """The ``export/`` a finished run resumed keeps as it is (rewriting it is all of a
    large model's weights again): the one its ``summary.json`` (written after the export
    was renamed into place) records for ``steps`` steps with these ``options``, each of
    its files there at its size. None where the run died before its summary, or while
    ``export/`` was being replaced (missing, or partly deleted), or the options changed."""
    summary = read_summary(run_dir)
    if summary is None or summary.get("steps") != steps:
        return None
    export = run_dir / "export"
    return export if complete_export(export, summary.get("export_written"), options) else None


def complete_export(folder: Path, written: Any, options: dict[str, Any]) -> bool:
    """Whether ``folder`` holds the export that ``written`` (an ``export_record``) describes
    and it was written with ``options``: each of its files there at its size. A kill while
    the folder was being replaced leaves it missing or partly deleted, never half-written
    (exports are renamed into place), so the sizes tell a complete one."""
    if not isinstance(written, dict):
        return False
    recorded = {k: v for k, v in written.items() if k != "files"}
    files = written.get("files")
    if recorded != options or not isinstance(files, dict) or not files:
        return False
    for name, size in files.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            return False
    return True


def export_options(job: JobConfig) -> dict[str, Any]:
    """The options that make one export of a state differ from another (a resume may
    change them): the summary records them, and a requeue keeps an export only of these."""
    return {"export_shard_size": job.run.export_shard_size, "merge_adapter": job.peft.merge_adapter}


def recorded_final_evals(logs: RunLogs | None, steps: int, splits: tuple[str, ...]) -> Evals | None:
    """The evaluations of the state after ``steps`` steps that the run's ``eval.jsonl``
    records (``recorded_evals``): the final ones a finished run wrote, which a requeue
    reports again rather than evaluating again. None without ``logs`` (only rank 0 has
    them)."""
    return None if logs is None else recorded_evals(logs.paths["eval"], steps, splits)


def recorded_evals(eval_log: Path, steps: int, splits: tuple[str, ...]) -> Evals | None:
    """The evaluations of the state after ``steps`` steps that ``eval_log`` records, one
    per split of ``splits``, without their step; None where one is missing (the run died
    before it)."""
    found = {}
    for record in read_records(eval_log):
        if record.get("step") == steps and eval_split(record) in splits:
            found[eval_split(record)] = {k: v for k, v in record.items() if k != "step"}
    return found if len(found) == len(splits) else None
