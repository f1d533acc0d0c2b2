"""The run directory as the job finds it: whether it already holds a run, what
``--overwrite`` deletes, whether a resume's checkpoint is one its seed log leads up to,
and which options a resume may change.

Every check reads only files every rank can see and runs before any process group, so
every rank takes the same decision (a refusal on one rank and not another would leave a
peer waiting in a collective); the one check that parses the whole seed log, for a gap,
is rank 0's alone, whose refusal the others learn through the launch gate. A run's own
files are the names below and nothing else: ``--overwrite`` never deletes what a user put
beside them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import logging
import re
import shutil
from pathlib import Path
from typing import Any

from distzo.config.job import RUN_ACTIONS, JobConfig
from distzo.data.column_map import parse_columns
from distzo.data.task_data import LoadedRows
from distzo.dist import LaunchEnv
from distzo.dist.collectives import Collectives
from distzo.job.checkpoint import latest_checkpoint
from distzo.job.curves import CURVES
from distzo.job.jsonl_text import line_record, log_lines, record_step
from distzo.job.moved_data import DATA_FILES, moved_data_file
from distzo.job.run_lock import RunLock
from distzo.job.seed_log import (
    SEED_LOG,
    checked_log,
    first_step,
    is_begun_log,
    last_logged_step,
    logged_header,
    logged_twice,
)
from distzo.job.summary import SUMMARY
from distzo.runtime.toml_file import UnreadableToml, read_toml
from distzo.runtime.units import counted

logger = logging.getLogger("distzo.train")

# What a run writes into its directory (each also under a ``.tmp`` name while written).
RUN_FILES = ("config.toml", SEED_LOG, "metrics.jsonl", "eval.jsonl", SUMMARY, CURVES)
BEST_EXPORT = "export-best"  # --export-best's model of the best dev step, beside export/
RUN_FOLDERS = ("checkpoints", "export", BEST_EXPORT, "base", "tensorboard", "wandb")
LOG_FILES = ("metrics.jsonl", "eval.jsonl")  # what goes to --log-dir instead, when given
_RANK_SUMMARY = re.compile(r"^rank\d+\.json$")

# Options a resumed run may change: they change how or how long the run goes, what it
# records or where, never the weights after a given step (the layout, the device and the
# schedule of saves and evaluations are all bit for bit; docs/checkpoints.md). Every other
# option changes the trajectory and a resume refuses a change to it.
RESUME_MAY_CHANGE = (
    "max_steps",
    "eval_steps",
    "eval_batch_size",
    "max_new_tokens",
    "save_steps",
    "save_async",
    "save_on_signal",
    "log_every",
    "log_dir",
    "log_sync_steps",
    "keep_checkpoints",
    "report_to",
    "export_shard_size",
    "export_best",
    "merge_adapter",
    "force",
    "mode",
    "num_slots",
    "transfer",
    "transfer_chunks",
    "low_bit_master",
    "perturb_scope",
    "device",
    "dp",
    "pert",
    "backend",
    "dist_timeout",
    "threads",
)
# Options that change the steps after the resume, and only those, on purpose (lowering the
# lr part-way). The seed log records each step's lr and g, so the catch-up and a replay of
# the steps before the resume stay exact.
RESUME_MAY_RETUNE = ("lr", "eps")
# How this command treats its directory, not what the run is: never compared.
INVOCATION = ("output_dir", *RUN_ACTIONS)


def new_run_dir(root: Path = Path("runs")) -> Path:
    """The default run directory (no --output-dir): ``root/<timestamp>``, made here with
    ``mkdir(exist_ok=False)``, which is atomic: when another run took it (two jobs, or a
    script's loop, started in the same second), ``<timestamp>-2``, ``-3``, ... instead, so
    no run writes into another's. One process decides (rank 0, which hands it to the
    others): the name depends on what is on disk when it is made."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    root.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        path = root / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise AssertionError("unreachable")


def shared_run_dir(comm: Collectives, rank: int) -> Path:
    """The default run directory, made by rank 0 (``new_run_dir``: unique, even for runs
    started in the same second) and handed to every rank; a failure to make it, too, so
    that every rank fails alike and none waits."""
    made: str | OSError | None = None
    if rank == 0:
        try:
            made = str(new_run_dir())
        except OSError as err:
            made = err
    made = comm.broadcast_object(made)
    if isinstance(made, OSError):
        raise made
    assert made is not None
    return Path(made)


def run_contents(run_dir: Path, log_dir: Path | None = None) -> list[Path]:
    """The run's own files and folders in ``run_dir`` (and its logs in ``log_dir``)."""
    names = {*RUN_FILES, *RUN_FOLDERS}
    names |= {f"{name}.tmp" for name in names}
    found = []
    if run_dir.is_dir():
        found = [p for p in run_dir.iterdir() if p.name in names or _RANK_SUMMARY.match(p.name)]
    if log_dir is not None and log_dir.resolve() != run_dir.resolve():
        found += _log_files(log_dir)
    return sorted(found)


def _log_files(log_dir: Path) -> list[Path]:
    logs = {*LOG_FILES, *(f"{name}.tmp" for name in LOG_FILES)}
    return [p for p in log_dir.iterdir() if p.name in logs] if log_dir.is_dir() else []


def _dirs(job: JobConfig) -> tuple[Path, Path | None]:
    run = job.run
    return Path(run.output_dir or "."), Path(run.log_dir) if run.log_dir else None


def _existing_run(job: JobConfig) -> list[Path]:
    """What of an earlier run a fresh start would overwrite: the run directory's own files
    and the --log-dir's logs; without --output-dir the run goes to a new directory, so only
    a --log-dir can hold one."""
    run_dir, log_dir = _dirs(job)
    if job.run.output_dir is None:
        return sorted(_log_files(log_dir)) if log_dir is not None else []
    return run_contents(run_dir, log_dir)


def _names(paths: list[Path]) -> str:
    shown = [p.name + ("/" if p.is_dir() else "") for p in paths[:4]]
    return ", ".join(shown) + (", ..." if len(paths) > 4 else "")


def check_fresh(job: JobConfig) -> None:
    """A run that starts afresh (no resume) into a directory holding a run would overwrite
    its logs and export and leave its checkpoints for a later resume to mix in: refused
    unless ``--overwrite`` (which deletes the old run's files first)."""
    if job.run.overwrite:
        return
    found = _existing_run(job)
    if found:
        where = (
            f"--output-dir {job.run.output_dir}"
            if job.run.output_dir is not None and any(p.parent == _dirs(job)[0] for p in found)
            else f"--log-dir {job.run.log_dir}"
        )
        raise ValueError(
            f"{where} already holds a run ({_names(found)}): add "
            "--resume to go on with it, --overwrite to delete it and start afresh, or give "
            "another --output-dir"
        )


def clear_run(job: JobConfig) -> None:
    """``--overwrite``: delete the old run's own files and folders (see ``run_contents``),
    nothing else. Rank 0 only, before any rank writes into the directory. Without
    --output-dir the run goes to a new directory: only a --log-dir's logs to delete."""
    found = _existing_run(job)
    names = _names(found)
    _delete(found)
    if found:
        where = job.run.output_dir if job.run.output_dir is not None else job.run.log_dir
        logger.warning("deleted the old run in %s (%s) to start afresh", where, names)


def _delete(paths: list[Path], ignore_errors: bool = False) -> None:
    """A run's files and folders (a link to a folder is removed, not followed)."""
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=ignore_errors)
        else:
            path.unlink(missing_ok=True)


def discard_unstarted_run(run_dir: Path, made: bool, lock: RunLock | None = None) -> None:
    """Rank 0, a fresh run that failed before its first step: delete what it wrote (its
    directory held no run's files when it started, ``check_fresh``), so that the corrected
    command is not refused as a run to resume or overwrite; the directory itself too when
    the run ``made`` it (``runs/<timestamp>``) and that leaves it empty (``lock``, the run's
    lock, let go first: its file goes with it)."""
    _delete(run_contents(run_dir), ignore_errors=True)  # never hides the build's failure
    if lock is not None:
        lock.release()
    if made:
        with contextlib.suppress(OSError):  # not empty: someone's files stay with it
            run_dir.rmdir()


_AFRESH = "start afresh with --overwrite or another --output-dir"


def logged_steps_of(raw: bytes) -> list[tuple[int, int]]:
    """The line number and step of each complete record of a seed log's bytes, as written
    (gaps kept; a torn last line, a header or a line that is not a step record skipped)."""
    lines = enumerate(log_lines(raw)[:-1], 1)
    steps = ((number, record_step(line_record(line))) for number, line in lines)
    return [(number, step) for number, step in steps if step is not None]


def _out_of_order(
    log: Path, raw: bytes, steps: list[tuple[int, int]], gap: int, first: int, start: str
) -> str:
    """The resume's refusal where a log's ``steps`` (``logged_steps_of`` of its bytes,
    ``raw``), in order from ``first`` before ``gap``, first leave it: a step logged again,
    or a jump. A step's record written twice by one run needs its repeats deleted, not the
    run started over."""
    line, step = steps[gap]
    if first <= step < first + gap:  # its first record is at steps[step - first]
        first_line = steps[step - first][0]
        lines = log_lines(raw)
        records = (line_record(lines[first_line - 1]), line_record(lines[line - 1]))
        twice = logged_twice(step, first_line, line, *records)
        if records[0] == records[1]:
            return f"--resume: {log} {twice}, then resume again"
        return f"--resume: {log} {twice}, so it does not go on from {start}; {_AFRESH}"
    after = f"step {first + gap - 1}" if gap else "its header"
    return (
        f"--resume: {log} jumps from {after} to step {step}, so it does not go on from "
        f"{start}; the two are not one run; {_AFRESH}"
    )


def check_log_leads_to_checkpoint(run_dir: Path, every_record: bool = True) -> int:
    """A resume loads the latest checkpoint and catches up with the seed log's later steps:
    that is the run only if the log holds every step 0..N-1 before a checkpoint of N steps
    (a checkpoint ahead of the log, or a log with a gap, is of another run in the same
    directory). Refused in one line naming both. A directory with no seed log (a checkpoint
    copied there to resume), or an empty one (``is_begun_log``), has nothing to check: the
    run starts a log of its own. Returns the steps the resume goes on
    from. Where the log ends is read from its tail; ``every_record`` (rank 0's check)
    also reads every record for a gap, which the other ranks, that learn a refusal through
    the launch gate, need not parse again (seconds per rank at a million steps); rank 0's
    one read and parse, ``checked_log``, also serves its catch-up and truncation, and a
    damaged log's scan and refusal."""
    log = run_dir / SEED_LOG
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    done = int(checkpoint.name.removeprefix("step-")) if checkpoint is not None else 0
    if not is_begun_log(log):
        return done
    start = "the initial weights"
    if checkpoint is not None:
        start = f"{checkpoint} ({counted(done, 'step')})"
    fix = f"the two are not one run; {_AFRESH}"
    header = logged_header(log)
    if header is None:
        raise ValueError(
            f"--resume: {log} does not begin with a seed log's header (damaged, or not "
            f"distzo's); {_damaged_log_fix(start)}"
        )
    first = first_step(header)  # its line read once: each read is an open on a shared mount
    checked = checked_log(log) if every_record else None
    damaged = checked is not None and checked.end is None
    if checked is not None and damaged:  # not whole and in order: say where
        steps = logged_steps_of(checked.raw)
        gap = next((i for i, (_, step) in enumerate(steps) if step != first + i), None)
        if gap is not None:
            raise ValueError(_out_of_order(log, checked.raw, steps, gap, first, start))
    if checkpoint is None and first > 0:  # "None holds 0 steps" was all it said
        raise ValueError(
            f"--resume: {log} begins at step {first} (its run went on from a checkpoint), but "
            f"{run_dir / 'checkpoints'} holds none to go on from; restore the run's "
            "checkpoints, or start afresh with --overwrite or another --output-dir"
        )
    last = last_logged_step(log)
    end = first if last is None else last + 1
    if end < done or done < first:
        ends = f"step {last}" if last is not None else "its header"
        raise ValueError(
            f"--resume: {checkpoint} holds {counted(done, 'step')} but {log} ends at {ends}; {fix}"
        )
    if checked is not None and checked.refusal is not None:  # in order, a line no record
        _refuse_damaged_line(checked.refusal, start)
    return end


def _damaged_log_fix(start: str) -> str:
    """What a resume whose seed log is damaged can do, going on from ``start``."""
    return (
        f"restore it, move it aside to resume from {start} alone (a replay then cannot "
        "rebuild the run), or start afresh with --overwrite or another --output-dir"
    )


def _refuse_damaged_line(refusal: str, start: str) -> None:
    """Refuse a log without a gap that ``read_seed_log`` refuses all the same, in its
    ``refusal`` (a line that is not JSON, or a step record whose update is no finite one):
    the catch-up read it so after the model was built and the checkpoint loaded, and failed
    on a replay's ``--log`` words that named no fix."""
    where = refusal.removeprefix("--log ")
    raise ValueError(f"--resume: {where} (damaged); {_damaged_log_fix(start)}")


# What a config.toml without an option that every run now records meant, where that is
# not the option's default: before --objective, every task trained on teacher forcing.
RECORDED_BEFORE: dict[str, Any] = {"objective": "lm"}


def _recorded(job: JobConfig, path: Path) -> tuple[dict[str, Any], set[str]]:
    """The options ``config.toml`` records, by name, and those it does not name: each ran
    with its default (a file from an earlier version: ``RECORDED_BEFORE``) or was unset
    (None)."""
    try:
        data = read_toml(path)
    except UnreadableToml as err:
        raise ValueError(f"--resume: {err}; repair or remove it") from None
    recorded, absent = {}, set()
    for section, values in JobConfig().sections().items():
        saved = data.get(section, {})
        if not isinstance(saved, dict):
            raise ValueError(
                f"--resume: {path} records {section} = {saved!r}, not a [{section}] table; "
                "repair or remove it"
            )
        for f in dataclasses.fields(values):
            before = RECORDED_BEFORE.get(f.name, getattr(values, f.name))
            recorded[f.name] = saved.get(f.name, before)
            if f.name not in saved:
                absent.add(f.name)
    return recorded, absent


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _shown(value: Any) -> str:
    """An option's value as a resume's line names it: an unset one (None) as unset, which is
    what the user did (no flag), not Python's None."""
    return "unset" if value is None else str(value)


def _same(old: Any, new: Any) -> bool:
    if isinstance(new, float) and isinstance(old, int) and not isinstance(old, bool):
        old = float(old)
    return bool(old == new)


def _same_columns(old: Any, new: Any) -> bool:
    """Whether two ``--columns`` give one mapping: its pairs, however spaced or ordered
    (the text of the option compared refused a resume of the run's own mapping)."""
    try:
        return dict(parse_columns(old)) == dict(parse_columns(new))
    except (ValueError, AttributeError):  # a hand-edited config.toml's: as text
        return _same(old, new)


# Options a resume may change that change what the final evaluation measures (the rows,
# the model and its weights cannot change): a finished run's recorded figures stand only
# where this command evaluates as the run did.
EVALUATION_OPTIONS = ("max_new_tokens",)


def evaluates_as_recorded(job: JobConfig) -> bool:
    """Whether a resumed run evaluates as its ``config.toml`` records (False without one),
    so that a requeue of the finished run may report its recorded final evaluation."""
    path = Path(job.run.output_dir or ".") / "config.toml"
    if not path.is_file():
        return False
    recorded, _ = _recorded(job, path)
    return all(
        _same(recorded[f.name], getattr(values, f.name))
        for values in job.sections().values()
        for f in dataclasses.fields(values)
        if f.name in EVALUATION_OPTIONS
    )


def check_resumed_options(job: JobConfig, env: LaunchEnv, rows: LoadedRows | None = None) -> None:
    """A resume goes on with the options its run started with (its ``config.toml``, the
    resolved tree): a change that alters the trajectory is refused, naming each option with
    the run's value and the new one; the others are accepted, named in one warning. A data
    file at another path holding the run's rows (``rows``, this session's: their digest is
    the seed log's) is the run's file moved, said in one line (``moved_data``). A run
    seed of -1 (draw one) takes the run's, and an unset noise the checkpoint's (checked
    after this). Resolves ``job`` in place."""
    path = Path(job.run.output_dir or ".") / "config.toml"
    if not path.is_file():
        return
    recorded, absent = _recorded(job, path)
    if job.run.seed == -1 and isinstance(recorded["seed"], int):
        job.run.seed = recorded["seed"]  # the seed that run drew
    refused, allowed, retuned, unwritten, moved = [], [], [], [], []
    for values in job.sections().values():
        for f in dataclasses.fields(values):
            name, new = f.name, getattr(values, f.name)
            same = _same_columns if name == "columns" else _same
            if name in INVOCATION or same(recorded[name], new) or (name, new) == ("noise", None):
                continue
            change = f"{_flag(name)} {_shown(recorded[name])} -> {_shown(new)}"
            # the linear schedule decays the lr to 0 at --max-steps
            decays_to = name == "max_steps" and job.optim.lr_schedule == "linear"
            if name in RESUME_MAY_RETUNE or decays_to:
                retuned.append(change)
            elif name in DATA_FILES and (
                line := moved_data_file(name, recorded[name], new, path.parent, rows)
            ):
                moved.append(line)
            elif name not in RESUME_MAY_CHANGE:
                refused.append(change)
                if name in absent and name in RECORDED_BEFORE:  # --config cannot give it
                    unwritten.append(f"{_flag(name)} {recorded[name]} ")
            elif new is not None:  # None: resolved again as the run did (num_slots)
                allowed.append(change)
    if refused:
        raise ValueError(
            f"--resume: {', '.join(refused)} would change the trajectory of the run in "
            f"{path.parent} (its config.toml); resume with its values (--config {path} "
            f"{''.join(unwritten)}--resume gives all of them), or start afresh with "
            "--overwrite or another --output-dir"
        )
    for line in moved if env.rank == 0 else []:
        logger.info("%s", line)
    if allowed and env.rank == 0:
        logger.warning("--resume: changed since the run started: %s", ", ".join(allowed))
    if retuned and env.rank == 0:
        logger.warning(
            "--resume: %s: the steps from here on differ from the run's (the logged ones stay)",
            ", ".join(retuned),
        )
