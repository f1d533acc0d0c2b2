"""The commit each ``hf:`` data source was read at, recorded in the seed log's header
(``data_commits``) and read back by a resume: a hub dataset's ``main`` that moved after
the run started gave the resume other rows, which ``check_resumed_rows`` refused, leaving
``--overwrite`` the only way on, although the run had read one commit. A resume whose
spec names no revision (or the run's own) reads the recorded commit; one naming another
revision is refused before the hub is asked, as another ``--train-file`` is."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from distzo.config.job import JobConfig
from distzo.data.hub_spec import COMMIT, hub_spec
from distzo.job.seed_log import SEED_LOG, logged_header

logger = logging.getLogger("distzo.train")

FIELD = "data_commits"  # the header's field: {flag: {"source": spec, "commit": sha}}
FLAGS = {"--train-file": "train_file", "--eval-file": "eval_file"}


def data_commits_record(job: JobConfig, commits: dict[str, str]) -> dict[str, Any] | None:
    """The header's ``data_commits``: each ``hf:`` flag's source as given and the commit it
    was read at (``commits``, by flag); None where no source was read at a commit."""
    record = {
        flag: {"source": getattr(job.data, FLAGS[flag]), "commit": commit}
        for flag, commit in commits.items()
    }
    return record or None


def commits_by_source(record: dict[str, Any] | None) -> dict[str, str]:
    """A header's ``data_commits`` (``data_commits_record``'s) as each source -> its commit,
    as ``summary.json`` lists them."""
    return {entry["source"]: entry["commit"] for entry in (record or {}).values()}


def recorded_data_commits(run_dir: Path) -> dict[str, tuple[str, str]]:
    """The run's ``data_commits``, by flag: (the source as the run was given it, the
    commit it read); none for a run without a log or from before the record. A damaged
    one is one line."""
    log = run_dir / SEED_LOG
    header = logged_header(log) if log.is_file() else None
    record = header.get(FIELD) if header is not None else None
    if record is None:
        return {}
    read: dict[str, tuple[str, str]] = {}
    entries = record.items() if isinstance(record, dict) else [("", record)]
    for flag, entry in entries:
        source = entry.get("source") if isinstance(entry, dict) else None
        commit = entry.get("commit") if isinstance(entry, dict) else None
        if flag not in FLAGS or not isinstance(source, str) or not isinstance(commit, str):
            commit = None
        if commit is None or not COMMIT.fullmatch(commit):
            raise ValueError(
                f"{log}: its header's {FIELD} {record!r} does not name a source and a commit "
                "hash (40 hex digits) by flag; is the log damaged?"
            )
        read[flag] = (str(source), commit)
    return read


def resumed_commits(job: JobConfig, run_dir: Path, rank: int) -> dict[str, str]:
    """The commit each ``hf:`` source of a resume reads, by source: the run's recorded one
    where the resume names the same dataset, config and split and no revision, the run's
    own or its commit (said in one line on rank 0). Another revision is refused in one
    line; another dataset is left to be read as given (its rows digest decides)."""
    pinned: dict[str, str] = {}
    for flag, (recorded, commit) in recorded_data_commits(run_dir).items():
        source = getattr(job.data, FLAGS[flag])
        if not source or not source.startswith("hf:"):
            continue
        spec, run_spec = hub_spec(source), hub_spec(recorded)
        if (spec.path, spec.config, spec.split) != (run_spec.path, run_spec.config, run_spec.split):
            continue
        if spec.revision not in (None, run_spec.revision, commit):
            raise ValueError(
                f"--resume: {flag} {source} names revision {spec.revision}, and the run in "
                f"{run_dir} trained on {recorded} at commit {commit}; give {flag} {recorded} "
                "(the run's commit is read), or start afresh with --overwrite or another "
                "--output-dir"
            )
        if source != recorded:  # the run's commit, named: the run's own spec
            setattr(job.data, FLAGS[flag], recorded)
        pinned[recorded] = commit
        if rank == 0:
            logger.info(
                "--resume: %s %s is read at commit %s, the one the run started with, not at "
                "the hub's newest",
                flag,
                recorded,
                commit,
            )
    return pinned
