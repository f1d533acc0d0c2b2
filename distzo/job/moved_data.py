"""A resume's ``--train-file`` or ``--eval-file`` at another path than its run's: the rows
copied to a local disk, or moved with the run's folder. The path alone was compared, so the
same rows at a new path were refused as a change of the run; what the steps draw from (and
what the evaluations score) is the rows, which the seed log's header digests (``train_rows``,
``eval_rows``). The same digest is the run's data, and the resume takes the new path (its
``config.toml`` then records it); another digest is refused naming both paths and digests."""

from __future__ import annotations

import logging
from pathlib import Path

from distzo.data.task_data import LoadedRows
from distzo.job.seed_log import SEED_LOG, logged_header

logger = logging.getLogger("distzo.train")

# each data file's option -> its flag and the header's digest of its rows
DATA_FILES = {
    "train_file": ("--train-file", "train_rows"),
    "eval_file": ("--eval-file", "eval_rows"),
}


def moved_data_file(
    name: str, old: object, new: object, run_dir: Path, rows: LoadedRows | None
) -> str | None:
    """Whether data option ``name`` changed from the run's ``old`` path to ``new`` only in
    where its rows lie: the line that says so, or None where the seed log records
    no digest of them to compare (a log from before it; no log; generated data), so the
    change is refused as any other. Rows of another digest are refused here, in one line."""
    paths = isinstance(old, str) and isinstance(new, str)
    if name not in DATA_FILES or not paths or rows is None:
        return None
    flag, field = DATA_FILES[name]
    log = run_dir / SEED_LOG
    header = logged_header(log) if log.is_file() else None
    logged = header.get(field) if header is not None else None
    if not isinstance(logged, str):
        return None
    digest = rows.digests[flag]
    if digest != logged:
        raise ValueError(
            f"--resume: {flag} {new} holds other rows than {flag} {old}, which the run in "
            f"{run_dir} read (rows digest {digest} of the task's examples, its seed log's "
            f"{logged}); give {flag} {old}, or a copy of that file, or start afresh with "
            "--overwrite or another --output-dir"
        )
    return (
        f"--resume: {flag} moved from {old} to {new}, with the run's rows (rows digest "
        f"{digest}): reading {new}, which the run's config.toml now records"
    )
