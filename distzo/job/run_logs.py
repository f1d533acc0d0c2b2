"""Rank 0's JSON-lines files in the run directory: per-step metrics, evaluations and the
seed log, kept consistent with the step a resumed run goes on from."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from distzo.config.cli import names_file
from distzo.config.field_types import is_of_type
from distzo.job.curves import LossCurve
from distzo.job.jsonl_text import line_record, log_lines, record_step
from distzo.job.records import eval_split
from distzo.job.reporting import Reporter
from distzo.job.seed_log import SEED_LOG, SeedLogWriter, in_order_as_kept, is_begun_log

logger = logging.getLogger("distzo.train")


def truncate_jsonl(
    path: Path, keep_below: int, each_kept: Callable[[dict[str, Any]], object] | None = None
) -> None:
    """Drop the records a resumed run will write again (those of step >= ``keep_below``),
    and a last line a crash tore (not JSON) or any other line that is not a record (a
    hostile or damaged file's), through a temporary file and a rename; ``each_kept`` is
    handed each record kept, in order (the loss curve, from this one parse). The file is
    rewritten only where that changes it: a resume that drops nothing (one from the step
    the logs end at) rewrote a long run's 100 MB at every restart."""
    if not path.exists():
        return
    raw = path.read_bytes()  # read once: the parse and the comparison that may skip the write
    kept = []
    for line in filter(None, log_lines(raw)):
        record = line_record(line)
        if record is None:
            continue
        # a record without a step is kept (the seed log's header); one whose step is no
        # step (``record_step``) is dropped, as every other reader skips it
        step = record_step(record) if "step" in record else -1
        if step is not None and step < keep_below:
            kept.append(line)
            if each_kept is not None:
                each_kept(record)
    _rewrite(path, b"".join(line + b"\n" for line in kept), raw)


def _rewrite(path: Path, data: bytes, raw: bytes) -> None:
    """``path`` holding ``data``, through a temporary file and a rename, unless it already
    does (its bytes are ``raw``; then a temporary file a crash left is removed). The kept
    lines are written back as they were read, byte for byte."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    if data == raw:
        tmp.unlink(missing_ok=True)
        return
    tmp.write_bytes(data)
    tmp.replace(path)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The step records of a JSON-lines log (none when it does not exist; a torn last line
    or any other that is no step record skipped), for what is drawn or summed up from the
    whole run."""
    return list(iter_records(path))


def iter_records(path: Path) -> Iterator[dict[str, Any]]:
    """``read_records``, one line at a time: the step records (``record_step``)."""
    if not path.is_file():
        return
    with open(path, "rb") as stream:
        for chunk in stream:  # cut at b"\n": an old Mac editor's "\r" ends lines too
            for line in log_lines(chunk):
                record = line_record(line)
                if record is not None and record_step(record) is not None:
                    yield record


def _record_key(line: bytes) -> tuple[int, str] | None:
    """(step, split) of an evaluation log's line; None for a line that is no step record."""
    record = line_record(line)
    step = record_step(record)
    if record is None or step is None:
        return None
    return step, eval_split(record)


def _close_quietly(seeds: SeedLogWriter) -> None:
    """Close the seed log of logs that failed to open: the failure under way is the one to
    report, not a second one of the same disk."""
    with contextlib.suppress(OSError):
        seeds.close()


class RunLogs:
    """metrics.jsonl, eval.jsonl (in ``log_dir``) and the seed log (in ``run_dir``), each
    record also sent to the dashboard (``reporter``) when there is one."""

    def __init__(
        self,
        run_dir: Path,
        log_dir: Path,
        resume_step: int,
        header: dict,
        sync_every: int = 1,
        reporter: Reporter | None = None,
    ) -> None:
        self.reporter = reporter  # the dashboard: every metrics and eval record's numbers
        if reporter is not None:
            reporter.start(resume_step)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.paths = {
            "metrics": log_dir / "metrics.jsonl",
            "eval": log_dir / "eval.jsonl",
            "seeds": run_dir / SEED_LOG,
        }
        # A resume from a checkpoint copied into a directory without its run's seed log
        # starts a log of its own, whose header says the step it begins at.
        seeds = self.paths["seeds"]
        headerless = not resume_step or not is_begun_log(seeds)
        # the training loss the curves redraw at each evaluation, kept from here on
        self.loss_curve = LossCurve()
        if resume_step:
            self._keep(resume_step, self.loss_curve.add)
        else:
            for path in self.paths.values():
                path.unlink(missing_ok=True)
        # A resumed run evaluates the state it starts from again where the uninterrupted run
        # evaluated it (for the flush): a record the log already holds is not repeated.
        evals = read_records(self.paths["eval"])
        self.kept_evals = {(r["step"], eval_split(r)): r for r in evals}
        self.closed = False
        # A failure from here (the header on a full disk) closes what was opened: the seed
        # log's syncer thread holds its file, and a Trainer retried in process kept both.
        with contextlib.ExitStack() as opened:
            self.files = {}
            for name, path in self.paths.items():
                if name != "seeds":
                    self.files[name] = open(path, "a")
                    opened.callback(self.files[name].close)
            self.seeds = SeedLogWriter(self.paths["seeds"], sync_every)
            opened.callback(_close_quietly, self.seeds)
            if headerless:
                first = {"first_step": resume_step} if resume_step else {}
                self.write("seeds", {"kind": "header", **header, **first})
            if reporter is not None and reporter.purges and resume_step:
                for record in evals:  # the purge took the kept evaluation of the resumed step
                    if record["step"] >= resume_step:
                        self._report("eval", record)
            opened.pop_all()  # open until close()

    def write(self, name: str, record: dict[str, Any]) -> None:
        """Append ``record`` to the log ``name`` (metrics, eval or seeds)."""
        if name == "seeds":
            self.seeds.write(record)
            return
        with names_file(self.paths[name]):
            self.files[name].write(json.dumps(record) + "\n")
            self.files[name].flush()
        if name == "metrics":
            self.loss_curve.add(record)
        self._report(name, record)

    def _report(self, name: str, record: dict[str, Any]) -> None:
        """``record``'s numbers to the dashboard, if any, as ``train/*`` or ``eval/*``."""
        if self.reporter is None:
            return
        prefix = "train" if name == "metrics" else "eval"
        scalars = {
            f"{prefix}/{key.removeprefix('eval_')}": float(value)
            for key, value in record.items()
            if key != "step" and is_of_type(value, float)
        }
        self.reporter.log(scalars, record["step"])

    def write_eval(self, step: int, metrics: dict[str, float]) -> None:
        """An evaluation of the state after ``step`` steps, one record per state and split
        (the dev rows' evaluation of a step is another): one the log already holds with
        these figures is not repeated (a resumed run evaluates the state it starts from
        again; --max-steps 0 evaluates step 0 before and after training), and one it holds
        with other figures is replaced, so that the log, the summary drawn from it and the
        next requeue's report give the figures of the latest evaluation (a requeue that
        changed --max-new-tokens scores its final state again)."""
        key, record = (step, eval_split(metrics)), {"step": step, **metrics}
        kept = self.kept_evals.get(key)
        self.kept_evals[key] = record
        if kept is None:
            self.write("eval", record)
        elif kept != record:
            self._replace_eval(key, record)
            self._report_replaced(key)

    def _replace_eval(self, key: tuple[int, str], record: dict[str, Any]) -> None:
        """``eval.jsonl`` with the record of ``key`` (step, split) replaced by ``record``
        where it stands, through a temporary file and a rename (a crash leaves the old log
        or the new one, whole); the append handle reopened on the new file."""
        path = self.paths["eval"]
        self.files["eval"].close()
        try:
            raw = path.read_bytes()
            lines = list(filter(None, log_lines(raw)))
            at = [i for i, line in enumerate(lines) if _record_key(line) == key]
            for i in at:  # one: this log writes a state's record of a split once
                lines[i] = json.dumps(record).encode()
            if not at:  # the file was cut by hand since the run opened it
                lines.append(json.dumps(record).encode())
            with names_file(path):
                _rewrite(path, b"".join(line + b"\n" for line in lines), raw)
        finally:
            self.files["eval"] = open(path, "a")

    def _report_replaced(self, key: tuple[int, str]) -> None:
        """A replaced evaluation to the dashboard, as the log now holds it. TensorBoard
        drops its events from that step on (the earlier figure, reported again when this
        session began, included) and is sent the step's evaluations again: one point per
        step and metric, the new one (no step after it is logged yet: a state is scored
        again before the run goes on from it). wandb cannot replace a step it logged: it
        keeps the earlier figure, which a warning says, rather than ignoring the new one
        with a warning of its own."""
        if self.reporter is None:
            return
        step, split = key
        if not self.reporter.purges:
            logger.warning(
                "--report-to: the dashboard keeps the earlier %s figures of step %d (it cannot "
                "replace a logged step); eval.jsonl and summary.json hold the new ones",
                split,
                step,
            )
            return
        self.reporter.drop_from(step)
        for (at, _), record in self.kept_evals.items():
            if at >= step:
                self._report("eval", record)

    def _keep(self, steps: int, loss: Callable[[dict[str, Any]], object] | None = None) -> None:
        """Cut every log back to the state after ``steps`` steps. Step records are 0-based
        steps taken; an evaluation "at step N" saw the state after N steps: it stays.
        ``loss`` is handed each metrics record kept. A seed log the resume found in order
        and ending there (``in_order_end``) is left unread."""
        for name, path in self.paths.items():
            below = steps + 1 if name == "eval" else steps
            if name == "seeds" and in_order_as_kept(path, below):
                continue
            truncate_jsonl(path, below, loss if name == "metrics" else None)

    def close_at(self, steps: int) -> None:
        """Close the logs cut back to the state after ``steps`` steps (a diverged run keeps
        fewer steps than it logged), so that they end where a resume goes on."""
        self.close()
        self._keep(steps)

    def close(self) -> None:
        """Close the files (the seed log synced) and the dashboard; once."""
        if self.closed:
            return
        self.closed = True
        with contextlib.ExitStack() as closing:  # each closed, even after one that failed
            for f in self.files.values():
                closing.callback(f.close)
            closing.callback(self.seeds.close)
            if self.reporter is not None:
                closing.callback(self.reporter.close)
