"""Checks that every rank of a launch runs one job, in one run directory.

torchrun starts the ranks of each node from that node's own command line, so on several
nodes nothing makes the nodes' options equal, nor their run directories one. A node with
another ``--lr`` or ``--max-steps`` would train other weights, or wait for steps its peers
never take (until --dist-timeout), with no error; a node whose ``--output-dir`` is not the
directory rank 0 writes (another path, or a local disk) would leave every checkpoint
missing its files; a node with another distzo (another commit's noise or update) or
another torch would train other weights. All are refused once the process group exists,
in one line on every rank, before any model is built. A node's data files are compared by
the rows read from them, not by their paths: each node may read its own copy (a node-local
disk) at a path of its own, where every node read rank 0's rows. So is a node whose copy of the
``--model`` folder is another model (another config.json, tokenizer or checkpoint): its
ranks would tokenize the rows into other ids, or compute with other weights, without a
word.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import secrets
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch
import transformers

from distzo.config.job import JobConfig
from distzo.dist.agreement import agreed
from distzo.dist.collectives import Collectives
from distzo.dist.launch_env import LaunchEnv
from distzo.models import hub

# Options a node may set its own way: paths that may be spelled differently on another
# node (the run directory itself is checked by ``check_shared_run_dir``; the logs are rank
# 0's), and the CPU threads of a node's ranks.
PER_NODE_OPTIONS = ("output_dir", "log_dir", "threads")
# The data files, whose path on several nodes may be each node's own copy's where every
# node's rows digest is rank 0's (``check_same_rows``): a local file, not an ``hf:`` spec.
DATA_FILE_FLAGS = ("--train-file", "--eval-file")
A_NODES_OWN_FILE = "a local file at each node's own path"
# How long a rank looks for rank 0's probe: a network filesystem may show a new file to
# another node a moment late.
PROBE_WAIT_S = 5.0
PROBE_PREFIX = ".distzo-shared-"
PACKAGE = Path(__file__).resolve().parents[1]  # distzo's own source, digested
# A model folder's files up to this size are digested whole (configs, tokenizers, a small
# checkpoint); a larger one (a checkpoint shard) by its size and SAMPLES pieces of SAMPLE
# bytes spread evenly from its start (a safetensors header) to its end: reading a whole
# checkpoint on every rank would cost as much as a pass over the model.
WHOLE_BYTES = 64 << 20
SAMPLES, SAMPLE = 32, 64 << 10


def _values(job: JobConfig) -> dict[str, str]:
    """Every option that must be equal on every rank, as ``--flag`` -> its value's repr
    (repr: a nan reads as equal to a nan)."""
    return {
        f"--{f.name.replace('_', '-')}": repr(getattr(section, f.name))
        for section in job.sections().values()
        for f in dataclasses.fields(section)
        if f.name not in PER_NODE_OPTIONS
    }


def check_one_job(
    job: JobConfig,
    run_dir: Path,
    comm: Collectives,
    env: LaunchEnv,
    data: Mapping[str, str] | None = None,
) -> None:
    """Each node's ranks were started from that node's own command line: one run directory
    (first: a node that cannot see it also resolves --resume auto its own way), one set
    of options and the same rows in its data files (``data``: each file's rows digest, by
    its flag), or a one-line refusal on every rank."""
    several_nodes = env.local_world_size < env.world_size
    if several_nodes:  # one node's ranks share one install, and read one copy of the files
        check_same_software(comm)
    check_shared_run_dir(run_dir, comm, env.rank, several_nodes)
    check_same_options(job, comm, node_data_paths=several_nodes and bool(data))
    if several_nodes and data:
        check_same_rows(job, data, comm)


def software() -> dict[str, str]:
    """What this rank runs: the packages whose code decides the weights, distzo by its
    source's digest too (two commits share a version number)."""
    return {
        "distzo": f"{importlib.metadata.version('distzo')} (source {source_digest()})",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


@functools.cache
def source_digest() -> str:
    """The first 12 hex digits of the SHA-256 of distzo's Python files (a wheel holds no C
    source: its compiled noise kernel has no file to digest)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in PACKAGE.rglob("*") if p.suffix == ".py"):
        digest.update(path.relative_to(PACKAGE).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def check_same_software(comm: Collectives) -> None:
    """Refuse a launch whose nodes run other versions of distzo, torch or transformers."""
    if not comm.distributed:
        return
    everyone: list[dict[str, str]] = comm.all_gather_object(software())
    for rank, differ in _differences(everyone):
        name = differ[0]
        raise ValueError(
            f"rank {rank} runs {name} {everyone[rank].get(name)}, rank 0 {name} "
            f"{everyone[0].get(name)}; install the same {name} on every node"
        )


def check_same_options(job: JobConfig, comm: Collectives, node_data_paths: bool = False) -> None:
    """Refuse a launch whose ranks were started with different options; every rank sees
    every rank's options and raises the same line. ``node_data_paths``: each node's data
    files may lie at paths of its own (their rows are compared, ``check_same_rows``)."""
    if not comm.distributed:
        return
    everyone: list[dict[str, str]] = comm.all_gather_object(_values(job))
    compared = [_compared(values, node_data_paths) for values in everyone]
    for rank, differ in _differences(compared):
        flag, theirs, first = differ[0], everyone[rank], everyone[0]
        raise ValueError(
            f"rank {rank} was started with {_shown(flag, theirs.get(flag))}, rank 0 with "
            f"{_shown(flag, first[flag])}{_more(differ, 'options')}; start every node with "
            "the same options"
        )


def _compared(values: dict[str, str], node_data_paths: bool) -> dict[str, str]:
    """A rank's options as they must equal rank 0's: with ``node_data_paths``, a data file
    that is a local file stands for any such path (an ``hf:`` spec, or none, still differs
    from a file, and from another spec)."""
    if not node_data_paths:
        return values
    local = [flag for flag in DATA_FILE_FLAGS if _is_local_file(values.get(flag))]
    return values | dict.fromkeys(local, A_NODES_OWN_FILE)


def _is_local_file(shown: str | None) -> bool:
    """Whether an option's repr (``_values``) is a path, not None nor an ``hf:`` spec."""
    return shown is not None and shown[:1] in ("'", '"') and not shown[1:].startswith("hf:")


def rows_read(job: JobConfig, data: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Each data file's rows digest (``data``, by flag) beside where this rank read them."""
    train = job.data.train_file
    paths = {"--train-file": train, "--eval-file": job.data.eval_file}
    where = {flag: str(paths.get(flag, f"rows of {train}")) for flag in data}  # --num-dev
    return {flag: (where[flag], digest) for flag, digest in data.items()}


def check_same_rows(job: JobConfig, data: Mapping[str, str], comm: Collectives) -> None:
    """Refuse a launch whose nodes read other rows from their data files (a node-local copy
    that is stale or another version): each rank would take its share of another global
    batch, and score its share of another evaluation set, without a word. The line names
    each rank's own path where the two differ, and is the same on every rank."""
    everyone: list[dict[str, tuple[str, str]]] = comm.all_gather_object(rows_read(job, data))
    digests = [{flag: read[1] for flag, read in ranks.items()} for ranks in everyone]
    for rank, differ in _differences(digests):
        flag = differ[0]
        theirs, digest = everyone[rank].get(flag, ("no file", "none"))
        first, rank0s = everyone[0].get(flag, ("no file", "none"))
        read = f"{flag} {theirs} than rank 0" + ("" if theirs == first else f" from {first}")
        fix = "the same file" if theirs == first else "a copy of rank 0's file"
        raise ValueError(
            f"rank {rank} read other rows from {read} (rows digest {digest}, rank 0's "
            f"{rank0s}); give every node {fix}"
        )


def _differences(everyone: Sequence[Mapping[str, object]]) -> Iterator[tuple[int, list[str]]]:
    """Each rank whose entries are not rank 0's, with the keys that differ: rank 0's in its
    order, then those that rank alone has."""
    first = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        keys = [*first, *(key for key in theirs if key not in first)]
        differ = [key for key in keys if theirs.get(key) != first.get(key)]
        if differ:
            yield rank, differ


def _more(differ: list[str], what: str) -> str:
    return f" (and {len(differ) - 1} more {what})" if len(differ) > 1 else ""


def _shown(flag: str, value: str | None) -> str:
    """An option as a command line gives it; unset (None) as the default it stands for."""
    return f"{flag} unset (its default)" if value in (None, "None") else f"{flag} {value}"


def check_shared_run_dir(run_dir: Path, comm: Collectives, rank: int, several_nodes: bool) -> None:
    """On several nodes, refuse a run directory that is not one directory for every rank:
    rank 0 writes a probe file into it and every rank must read it back. Each rank writes
    its part of every checkpoint there, and rank 0 publishes them; a node that cannot see
    rank 0's files would leave every checkpoint without its part."""
    if not (comm.distributed and several_nodes):
        return
    name = comm.broadcast_object(PROBE_PREFIX + secrets.token_hex(8) if rank == 0 else None)
    probe = run_dir / name

    def write() -> None:
        if rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            probe.write_text(name)

    try:
        agreed(comm, write)
        agreed(comm, lambda: _find_probe(probe, name))
    finally:
        if rank == 0:  # every rank has looked: agreed gathered every verdict
            probe.unlink(missing_ok=True)


def _find_probe(probe: Path, name: str) -> None:
    deadline = time.monotonic() + PROBE_WAIT_S
    while True:
        try:
            if probe.read_text() == name:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise ValueError(
                f"the run directory {probe.parent} does not hold the file rank 0 just wrote "
                "there: on several nodes every rank writes its part of each checkpoint "
                "into rank 0's run directory, so it must be on a filesystem every node "
                "shares, at a path (--output-dir) that names it on every node"
            )
        time.sleep(0.2)


def check_same_model(name: str, source: Path, comm: Collectives, env: LaunchEnv) -> None:
    """On several nodes, refuse a ``--model`` folder (``source``, where ``name`` resolved)
    whose files differ from rank 0's, naming the first that differs; every rank raises the
    same line. A folder one rank cannot read ends every rank (``agreed``)."""
    if not (comm.distributed and env.local_world_size < env.world_size):
        return
    everyone: list[dict[str, str]] = comm.all_gather_object(
        agreed(comm, lambda: folder_digests(source))
    )
    for rank, differ in _differences(everyone):
        state = _file_state(differ[0], everyone[rank], everyone[0])
        raise ValueError(
            f"rank {rank} read another model from --model {name} than rank 0: its "
            f"{differ[0]} {state}{_more(differ, 'files')}; {_same_model_fix(name, source)}"
        )


def _same_model_fix(name: str, source: Path) -> str:
    """What makes the nodes' copies one: a folder is copied, but a hub name is already read
    at one commit on every node (rank 0's), so its copies differ only where one node's
    download of that commit is partial (an ``--include``) or damaged."""
    commit = hub.snapshot_commit(source) if hub.local_model_dir(name) is None else None
    if commit is None:
        return "give every node the same model folder"
    return (
        f"one node's download of commit {commit} is partial or damaged; on the node whose "
        f"copy is wrong: hf download {name} --revision {commit} --force-download"
    )


def _file_state(name: str, theirs: Mapping[str, str], rank0s: Mapping[str, str]) -> str:
    if name not in theirs:
        return "is missing"
    return "is not in rank 0's folder" if name not in rank0s else "differs from rank 0's"


def folder_digests(folder: Path) -> dict[str, str]:
    """Each file of a model folder (hidden ones aside: a download's cache) by its path
    in the folder -> its digest (``file_digest``)."""
    return {
        path.relative_to(folder).as_posix(): file_digest(path)
        for path in sorted(folder.rglob("*"))
        if path.is_file() and not any(p.startswith(".") for p in path.relative_to(folder).parts)
    }


def file_digest(path: Path) -> str:
    """The first 16 hex digits of the SHA-256 of a file, or for one over ``WHOLE_BYTES``
    of its size and ``SAMPLES`` evenly spread pieces."""
    size = path.stat().st_size
    if size <= WHOLE_BYTES:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        for i in range(SAMPLES):
            f.seek(i * (size - SAMPLE) // (SAMPLES - 1))
            digest.update(f.read(SAMPLE))
    return digest.hexdigest()[:16]
