"""A requeue of a finished scoring run (``--max-steps 0``, MeZO's zero-shot or in-context
baseline): the same command again, with ``--resume`` or ``--resume auto``, reports the
evaluation the run recorded rather than loading the model and scoring it again (on a large
generation eval the evaluation is the whole run), and touches none of its files.

The run is recognised by its ``summary.json`` of 0 steps: the summary is the last file a
run writes, renamed into place once its evaluation is in ``eval.jsonl``, so it stands for a
scoring run that ended (``eval.jsonl`` alone also holds the evaluation of a run killed
later on, and ``config.toml`` is written before anything is scored). Its record stands
where ``eval.jsonl`` holds the step-0 evaluation of every split the summary names and the
command evaluates as the run did (``evaluates_as_recorded``); else the run scores again.
Rank 0 reads the record and tells every rank (``agreed_recorded_score``), before any
process group: a ``--log-dir`` on rank 0's node alone holds ``eval.jsonl`` there only.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from distzo.config.job import JobConfig
from distzo.dist import LaunchEnv
from distzo.dist.launch_gate import rank_0_answers
from distzo.job.records import describe
from distzo.job.run_end import Evals, recorded_evals
from distzo.job.summary import SUMMARY, read_summary

logger = logging.getLogger("distzo.train")


def scoring_summary(run_dir: Path) -> dict[str, Any] | None:
    """The ``summary.json`` of the finished scoring run in ``run_dir`` (one of 0 steps),
    or None: no summary (the run died before its end), an unreadable one, or a summary of
    a run that trained."""
    summary = read_summary(run_dir)
    return summary if summary is not None and summary.get("steps") == 0 else None


def recorded_score(job: JobConfig, as_recorded: bool) -> Evals | None:
    """The evaluations, by split, that the finished scoring run in ``--output-dir`` recorded
    (its ``eval.jsonl``, in ``--log-dir`` where given), without their step: the result of
    this command too where it evaluates ``as_recorded``. None where the run did not finish,
    or a split its summary names has no step-0 record (a file cut short by hand)."""
    run_dir = Path(job.run.output_dir or ".")
    summary = scoring_summary(run_dir)
    if summary is None or not as_recorded:
        return None
    splits = ("dev", "eval") if "dev" in summary else ("eval",)
    return recorded_evals(Path(job.run.log_dir or run_dir) / "eval.jsonl", 0, splits)


def agreed_recorded_score(job: JobConfig, env: LaunchEnv, as_recorded: bool) -> Evals | None:
    """``recorded_score`` as rank 0 finds it, told to every rank before the process group
    forms: only rank 0 writes the logs, and a --log-dir on its node's disk is not on the
    others', whose own reading (no record: score again) would build a run that rank 0,
    which reported the record and exited, never joins."""
    told = rank_0_answers(
        env,
        "the scoring run's recorded evaluation",
        lambda: json.dumps(recorded_score(job, as_recorded)),
        job.parallel.dist_timeout,
    )
    recorded: Evals | None = json.loads(told)
    return recorded


def report_recorded_score(run_dir: Path, recorded: Evals) -> None:
    """The line a requeue of a finished scoring run ends with, as its run's did."""
    logger.info(
        "done: scored without training (--max-steps 0): eval %s, as the run in %s recorded "
        "it (a requeue of a finished run: nothing was loaded, scored or written again); "
        "summary %s, curves %s",
        describe(recorded["eval"]),
        run_dir,
        run_dir / SUMMARY,
        run_dir / "curves.png",
    )
