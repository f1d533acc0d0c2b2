"""A resume's ``--train-file`` or ``--eval-file`` at another path than its run's: the rows
copied to a local disk, or moved with the run's folder. The path alone was compared, so the
same rows at a new path were refused as a change of the run; what the steps draw from (and
what the evaluations score) is the rows, which the seed log's header digests (``train_rows``,
``eval_rows``). The same digest is the run's data, and the resume takes the new path (its
``config.toml`` then records it); another digest is refused naming both paths and digests.
A run's file gone from its path, no new one given, is named as the run's, with that way on."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from distzo.config.job import JobConfig
from distzo.data.task_data import LoadedRows
from distzo.job.seed_log import SEED_LOG, logged_header
from distzo.runtime.toml_file import UnreadableToml, read_toml

logger = logging.getLogger("distzo.train")

# each data file's option -> its flag and the header's digest of its rows
DATA_FILES = {
    "train_file": ("--train-file", "train_rows"),
    "eval_file": ("--eval-file", "eval_rows"),
}
AFRESH = "or start afresh with --overwrite or another --output-dir"


def moved_data_file(
    name: str, old: object, new: object, run_dir: Path, rows: LoadedRows | None
) -> str | None:
    """Whether data option ``name`` changed from the run's ``old`` path to ``new`` only in
    where its rows lie: the line that says so, or None where the seed log records
    no digest of them to compare (a log from before it; no log; generated data), so the
    change is refused as any other. Rows of another digest are refused here, in one line.
    An ``hf:`` spec stands for its rows as a path does: a hub split exported to a file (an
    offline cluster) holds the run's rows, and so may the file's split on the hub."""
    if name not in DATA_FILES or not isinstance(old, str) or not isinstance(new, str):
        return None
    if rows is None:
        return None
    flag, field = DATA_FILES[name]
    logged = logged_digest(run_dir, field)
    if logged is None:
        return None
    digest, same_file = rows.digests[flag], _same_file(old, new)
    if digest != logged:
        raise ValueError(_other_rows(flag, old, new, run_dir, digest, logged, same_file))
    recorded = f"reading {new}, which the run's config.toml now records"
    if same_file:
        return f"--resume: {flag} {new} is the run's {old}, named otherwise: {recorded}"
    if _is_hub(old) != _is_hub(new):
        return (
            f"--resume: {flag} {new} holds the rows the run read from {old} (rows digest "
            f"{digest}): {recorded}"
        )
    return (
        f"--resume: {flag} moved from {old} to {new}, with the run's rows (rows digest "
        f"{digest}): {recorded}"
    )


def _other_rows(
    flag: str, old: str, new: str, run_dir: Path, digest: str, logged: str, same_file: bool
) -> str:
    """The refusal of ``new``'s rows, which are not the run's; its fix fits what ``old`` is."""
    digests = f"rows digest {digest} of the task's examples, its seed log's {logged}"
    if same_file:  # the run's own file, edited since: no path to go back to
        return (
            f"--resume: {flag} {new} (the run's {old}, named otherwise) holds other rows than "
            f"the run in {run_dir} read ({digests}); restore the rows the run started with, "
            f"{AFRESH}"
        )
    copy = "its rows as a file" if _is_hub(old) else "a copy of that file"
    return (
        f"--resume: {flag} {new} holds other rows than {flag} {old}, which the run in "
        f"{run_dir} read ({digests}); give {flag} {old}, or {copy}, {AFRESH}"
    )


def check_resumed_files_exist(job: JobConfig, run_dir: Path) -> None:
    """A resume's data file that is gone from the path its run read it at (the one its
    ``config.toml`` records, given again, ``./x`` as ``x``): refused as the run's file,
    saying that its new path goes on (checked against the seed log's digest), before any
    row is read. The loader's line ("no such file; correct the path") did not say that the
    path was the run's, nor that a new one was allowed."""
    recorded = _recorded_data(run_dir)
    for name, (flag, field) in DATA_FILES.items():
        path = getattr(job.data, name)
        run_path = recorded.get(name)
        if not isinstance(path, str) or _is_hub(path) or not isinstance(run_path, str):
            continue
        if os.path.normpath(path) != os.path.normpath(run_path):  # ./x is x: the run's
            continue
        if Path(path).exists():
            continue
        link = f" (a link to {os.readlink(path)}, which is gone)" if Path(path).is_symlink() else ""
        here = "" if Path(path).is_absolute() else f" under {Path.cwd()}"  # run from elsewhere?
        gone = f"--resume: {flag} {path}: no such file{here}{link}, and the run in {run_dir} read"
        logged = logged_digest(run_dir, field)
        if logged is None:
            raise ValueError(
                f"{gone} its rows there; its seed log records no digest of them to check "
                f"another path against, so restore the file at that path, {AFRESH}"
            )
        raise ValueError(
            f"{gone} its rows there (rows digest {logged}); give {flag} with the file's new "
            f"path (its rows are checked against that digest), or restore it there, {AFRESH}"
        )


def logged_digest(run_dir: Path, field: str) -> str | None:
    """The seed log header's digest ``field`` of the run's rows, or None (no log, a log from
    before the field, generated data)."""
    log = run_dir / SEED_LOG
    header = logged_header(log) if log.is_file() else None
    logged = header.get(field) if header is not None else None
    return logged if isinstance(logged, str) else None


def _recorded_data(run_dir: Path) -> dict[str, object]:
    """The ``[data]`` table of the run's ``config.toml``; empty where there is none to read
    (the resume's check of its options names a damaged one)."""
    try:
        data = read_toml(run_dir / "config.toml").get("data", {})
    except UnreadableToml:
        return {}
    return data if isinstance(data, dict) else {}


def _is_hub(source: str) -> bool:
    return source.startswith("hf:")


def _same_file(old: str, new: str) -> bool:
    """Whether two paths name one file here (a symlink and its target, a relative path and
    its absolute one); a hub spec names none."""
    if _is_hub(old) or _is_hub(new):
        return False
    try:
        return os.path.samefile(old, new)
    except OSError:  # the run's path is gone: it moved
        return False
