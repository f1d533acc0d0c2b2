"""A hub model as a local directory, so that it streams like one (never loaded whole).

``from_pretrained`` would build the whole model in every rank's memory before the
engine copied it into its buckets (8 ranks x 26 GB for OPT-13B). Instead the
repository's files are downloaded once per node into the Hugging Face cache
(``huggingface_hub.snapshot_download``), and the engine reads the snapshot bucket by
bucket, exactly as for a local directory. Only what loading needs is fetched: the
configs, the tokenizer, and the weights in safetensors when the repository has them
(else its PyTorch ``.bin`` files, read with ``weights_only=True``); never code. How long
each question waits on the hub: ``distzo.models.hub_reads``.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from pathlib import Path
from typing import NamedTuple

from distzo.models.hub_reads import (
    bounded_reads,
    causes,
    first_line,
    hub_answers,
    hub_commit,
    note_stall,
    stalled,
)

# huggingface_hub's HTTP retries ("Retrying in 1s [Retry 1/5].", "HTTP Error 503 thrown
# while requesting ..."): every rank may ask the hub (a hub dataset's rows), so each would
# say each retry.
HUB_HTTP_LOGGER = "huggingface_hub.utils._http"
logger = logging.getLogger(__name__)
# what a write to a folder this process cannot write raises
READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)

METADATA = [
    "*.json",
    "*.txt",
    "*.model",
    "*.jinja",
    "*.tiktoken",
]  # configs, tokenizers, chat templates


def weight_patterns(files: list[str]) -> list[str]:
    """The files to fetch from a repository listing ``files``: safetensors if it has any."""
    if any(f.endswith(".safetensors") for f in files):
        return METADATA + ["*.safetensors"]
    return METADATA + ["*.bin"]


def local_model_dir(name: str, option: str = "--model") -> Path | None:
    """The directory a --model names when it is a path (one that exists, or one that looks
    like a path: absolute, ``./``, ``../``, ``~``); None for a hub name. A path that is not a
    directory is refused here: hub name parsing would call it a malformed repo id; so is a
    folder this user may not read (a colleague's, private to them), whose files would each
    fail later, in a traceback or as a failed write. ``option``: what the error calls the
    name (replay's ``--base``)."""
    path = Path(os.path.expanduser(name))  # ~user of no user stays as written, as in a shell
    if path.is_dir():
        if not os.access(path, os.R_OK | os.X_OK):
            raise ValueError(
                f"{option} {name}: no permission to read this folder; its owner can share it "
                "(chmod -R a+rX), or copy the model to a folder you may read"
            )
        return path
    looks_local = path.is_absolute() or name.startswith(("./", "../", "~", ".\\", "..\\"))
    if path.exists() or looks_local or name in (".", ".."):
        kind = "not a directory" if path.exists() else "no such directory"
        raise ValueError(f"{option} {name}: {kind} (a local model is a Hugging Face folder)")
    return None


def base_reference(name: str) -> str:
    """How a run names its ``--model`` to others (the seed log's base, an exported
    adapter's ``base_model_name_or_path``): a hub name as given, which loads on any machine,
    not the cache folder it was fetched into; a local folder as an absolute path, which
    loads from any working directory."""
    path = Path(os.path.expanduser(name))
    return str(path.absolute()) if path.is_dir() else name


COMMIT = re.compile(r"[0-9a-f]{40}")  # a hub commit hash: a snapshot folder's name


def snapshot_commit(folder: Path) -> str | None:
    """The commit a hub snapshot folder holds (``.../snapshots/<commit>``), which a run
    records so that its resume and replay read the same weights after the cache's
    ``main`` moved on; None for any other folder."""
    name = folder.name
    return name if folder.parent.name == "snapshots" and COMMIT.fullmatch(name) else None


def check_commit(revision: object, where: str) -> str:
    """``revision`` as a commit hash, or one line naming ``where`` it came from."""
    if not isinstance(revision, str) or not COMMIT.fullmatch(revision):
        raise ValueError(
            f"{where}: base_revision {revision!r} is not a commit hash (40 hex digits); is "
            "the log damaged?"
        )
    return revision


def unwritable_cache(err: BaseException, name: str) -> str | None:
    """Why a download of hub model ``name`` failed where ``err`` is the Hugging Face cache
    refusing its write: a group's cache on a read-only mount, or one this user may only
    read, whose copy is not the hub's ``main`` now (or that holds none). The library
    names only the folder it could not make (transformers: a lock file to remove, raised
    from the refusal); None for any other error."""
    from huggingface_hub import constants

    cache = Path(constants.HF_HUB_CACHE).absolute()
    refusal = next((c for c in causes(err) if _refused_in(c, cache)), None)
    if not isinstance(refusal, OSError):
        return None
    return (
        f"the Hugging Face cache {cache} cannot be written ({refusal.strerror}) and does not hold "
        f"{name} at the hub's main now: HF_HUB_OFFLINE=1 reads the copy it holds, or set "
        "HF_HUB_CACHE to a folder you may write"
    )


def _refused_in(error: BaseException, cache: Path) -> bool:
    """Whether ``error`` is a write refused in ``cache`` or a folder of it."""
    if not (isinstance(error, OSError) and error.errno in READ_ONLY and error.filename):
        return False
    refused = Path(os.fsdecode(error.filename)).absolute()
    return refused == cache or cache in refused.parents


def snapshot(
    name: str,
    download: bool,
    revision: str | None = None,
    option: str = "--model",
    pinned_by: str = "the one the run trained on",
) -> Path:
    """The local directory of hub model ``name`` (at commit ``revision``: a resumed or
    replayed run's, or rank 0's on several nodes; else the repository's ``main``).
    ``download``: fetch what is missing (one rank per node); otherwise the cached snapshot
    that rank made (the node's other ranks, after it), with no network access. ``option``:
    what the error calls the name; ``pinned_by``: why it is read at ``revision``. A hub
    that stalls after answering the probe: its cache, with a warning, where it holds the
    snapshot; else one line naming the hub and the timeout."""
    from huggingface_hub import constants, snapshot_download

    try:
        if not download or not hub_answers():
            return Path(snapshot_download(name, revision=revision, local_files_only=True))
        with bounded_reads():
            return _download(name, revision)
    except Exception as err:  # network, authentication, a name that is not a repository
        reason = unwritable_cache(err, name) or first_line(err)
        if stalled(err):
            reason = (
                f"the hub ({constants.ENDPOINT}) sent nothing for "
                f"{constants.HF_HUB_DOWNLOAD_TIMEOUT} s (HF_HUB_DOWNLOAD_TIMEOUT; a larger "
                "one waits longer, HF_HUB_OFFLINE=1 reads the cache where it holds the model)"
            )
        if revision is None:
            raise ValueError(f"cannot download {option} {name!r}: {reason}") from None
        raise ValueError(
            f"cannot download {option} {name!r} at commit {revision}, {pinned_by} ({reason}); "
            "fetch it into this cache where the hub is reachable: hf download "
            f"{name} --revision {revision}"
        ) from None


def _download(name: str, revision: str | None) -> Path:
    """The snapshot, fetching what the repository's listing names. The listing is one
    request, which the library does not retry (``list_repo_files`` retried a stalled
    listing five times, over a minute): where it stalls, the cache's snapshot with a
    warning, or the stall raised where the cache has none. Any other failure of the
    listing is left to ``snapshot_download``: the cache, or its own error."""
    from huggingface_hub import HfApi, snapshot_download

    api = HfApi()  # of now's endpoint, as snapshot_download makes (not the import's)
    patterns: list[str] | None
    try:
        siblings = api.model_info(name, revision=revision).siblings
        files = [s.rfilename for s in siblings] if siblings is not None else None
        patterns = weight_patterns(files or api.list_repo_files(name, revision=revision))
    except Exception as err:  # offline (HF_HUB_OFFLINE), no listing, a stall
        if not stalled(err):
            patterns = None
        else:
            try:
                cached = snapshot_download(name, revision=revision, local_files_only=True)
            except Exception:  # not in the cache: the stall is the reason
                raise err from None
            note_stall(err)
            return Path(cached)
    return Path(snapshot_download(name, revision=revision, allow_patterns=patterns))


class MainCommit(NamedTuple):
    """The commit a model's ``main`` is, and whether the hub said so now (not a cache)."""

    commit: str
    hubs: bool


def main_commit(name: str, option: str = "--model") -> MainCommit:
    """The commit hub model ``name``'s ``main`` is now: the hub's answer, or where the hub
    does not answer, the cache's. On several nodes rank 0's is the one every node reads:
    each node's own cache may hold another ``main`` (one filled last week, one today). A
    hub that stalls on it is taken as one that does not answer (``note_stall``)."""
    from huggingface_hub import repo_info, snapshot_download

    try:
        commit = hub_commit(lambda: repo_info(name).sha)
        hubs = commit is not None
        if commit is None:
            commit = Path(snapshot_download(name, local_files_only=True)).name
    except Exception as err:  # network, authentication, a name that is not a repository
        raise ValueError(f"cannot download {option} {name!r}: {first_line(err)}") from None
    if not isinstance(commit, str) or not COMMIT.fullmatch(commit):
        raise ValueError(f"cannot download {option} {name!r}: its main names no commit")
    return MainCommit(commit, hubs)


def point_main(folder: Path) -> None:
    """The cache's ``main`` of the model whose snapshot ``folder`` is names its commit, as
    huggingface_hub's download of ``main`` does: a download of the hub's ``main`` by its
    hash (every node's, rank 0's answer) left it at an older commit, or none, and an offline
    ``from_pretrained(name)`` on that node read the older model, or failed. Written whole
    (a temporary file renamed); a cache this user may not write keeps its own."""
    commit = snapshot_commit(folder)
    if commit is None:
        return
    ref = folder.parent.parent / "refs" / "main"
    try:
        if ref.is_file() and ref.read_text() == commit:
            return
        ref.parent.mkdir(exist_ok=True)
        partial = ref.with_name(f"main.{os.getpid()}.tmp")
        partial.write_text(commit)
        os.replace(partial, ref)
    except OSError as err:  # a group's read-only cache: its main is its owners' to move
        logger.debug("cannot point %s at %s: %s", ref, commit, err)


class OnceOnFirstLocalRank(logging.Filter):
    """Lets a record through on the node's first local rank only, and each message once."""

    def __init__(self, local_rank: int) -> None:
        super().__init__()
        self.local_rank = local_rank
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.local_rank != 0 or message in self.seen:
            return False
        self.seen.add(message)
        return True


def quiet_hub_retries(local_rank: int) -> OnceOnFirstLocalRank:
    """Say each of huggingface_hub's retry warnings once per node (its first local rank,
    which also downloads) instead of once per rank and again per retry of the same
    request. Installed once per process, on that logger alone; returns the filter."""
    logger = logging.getLogger(HUB_HTTP_LOGGER)
    for existing in logger.filters:
        if isinstance(existing, OnceOnFirstLocalRank):
            existing.local_rank = local_rank
            return existing
    once = OnceOnFirstLocalRank(local_rank)
    logger.addFilter(once)
    return once
