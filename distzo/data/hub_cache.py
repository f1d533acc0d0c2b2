"""The copy of an ``hf:`` dataset at one commit that this node's ``datasets`` cache holds.

A launch's ranks read an ``hf:`` dataset offline, from their node's cache, at the commit
rank 0 was told. ``datasets`` offline ignores the revision it is given: it reads the
cache's most recently modified prepared copy of the dataset, whatever its commit
(``packaged_modules.cache``), so a node whose cache held a copy of another commit prepared
later (an earlier run, a script at another revision) trained on that copy's rows without a
word. ``datasets`` keeps each prepared copy in a folder named by its commit
(``NAMESPACE___NAME/CONFIG/VERSION/COMMIT``); here that one folder is read, and where
the hub answers rank 0 nothing, the commit of the copy ``datasets`` would read on rank 0 is
the launch's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

# why a node's cache lacks the pinned copy, as a rank reading it finds, and as its first
# rank finds after the download (a hub silent to that node: datasets read its cache instead)
READ_MISSING = "and the node's first rank downloaded; give a node's ranks one HF_DATASETS_CACHE"
FILL_MISSING = (
    "and the hub did not give this node (its warning says why); let the node reach the hub, "
    "or download the dataset at that commit on it first"
)
# and the hub answered rank 0 nothing: the commit is that of the copy rank 0's cache holds
CACHE_MISSING = (
    "from its own cache (the hub did not answer it); give the nodes one HF_DATASETS_CACHE "
    "(a shared filesystem), or run with the hub reachable"
)


def pinned_folder(
    path: str,
    config: str | None,
    split: str,
    commit: str,
    source: str,
    missing: str = READ_MISSING,
) -> Path:
    """The folder of hub dataset ``path``'s copy at ``commit`` (``config``: None, its
    default) in this node's cache, found with no request; a cache that holds no copy at
    that commit (``missing``: why, and the fix), or copies of several configs where none
    was named, is a one-line error."""
    root = _dataset_root(path)
    copies = _prepared_copies(root, config, commit)
    if not copies:
        raise ValueError(
            f"{source}: this node's datasets cache ({root}) holds no copy at commit {commit}, "
            f"which rank 0 pinned {missing}"
        )
    configs = sorted({folder.parts[-3] for folder in copies})
    if len(configs) > 1:
        raise ValueError(
            f"{source}: the datasets cache holds configs {', '.join(configs)} at commit "
            f"{commit}; name one: hf:{path}:CONFIG:{split}"
        )
    return copies[-1]


def cached_commit(path: str, config: str | None) -> str:
    """The commit of the copy of hub dataset ``path`` (``config``: None, any) that
    ``datasets`` offline reads from this node's cache, its most recently modified prepared
    copy, or "" where it holds none: where the hub answers rank 0 nothing, a launch's nodes
    read this commit, rank 0's, not each its own cache's newest (two commits' rows)."""
    copies = _prepared_copies(_dataset_root(path), config, "*")
    commits = [folder for folder in copies if COMMIT_NAME.fullmatch(folder.name)]
    return max(commits, key=lambda folder: folder.stat().st_mtime).name if commits else ""


# a prepared copy's folder name where datasets prepared a hub dataset (``COMMIT.incomplete``
# is one being written)
COMMIT_NAME = re.compile("[0-9a-f]{40}")


def _dataset_root(path: str) -> Path:
    """The folder of hub dataset ``path``'s prepared copies in this node's cache."""
    import datasets.config
    from datasets.naming import camelcase_to_snakecase

    *namespace, name = path.split("/")
    root = Path(datasets.config.HF_DATASETS_CACHE).expanduser()
    return root / "___".join([*namespace, camelcase_to_snakecase(name)])


def _prepared_copies(root: Path, config: str | None, commit: str) -> list[Path]:
    """The prepared copies under ``root`` of ``config`` (None: any) at ``commit`` ("*":
    any), as ``datasets`` offline finds them: a folder whose info names its config."""
    return [
        folder
        for folder in sorted(root.glob(f"{config or '*'}/*/{commit}"))
        if folder.is_dir() and _config_name(folder) == folder.parts[-3]
    ]


def read_prepared(path: str, folder: Path, split: str) -> Any:
    """Split ``split`` of the copy of hub dataset ``path`` prepared in ``folder``, as
    ``datasets`` reads its cache offline once it has chosen the folder (memory-mapped)."""
    from datasets.packaged_modules.cache.cache import Cache

    builder = Cache(
        repo_id=path,
        dataset_name=path.split("/")[-1],
        config_name=folder.parts[-3],
        version=folder.parts[-2],
        hash=folder.parts[-1],
    )
    return builder.as_dataset(split=split)


def _config_name(folder: Path) -> str | None:
    """The config a prepared copy's ``dataset_info.json`` names (None: unreadable); a
    folder of a config made with other options has its own name (``datasets``' check)."""
    try:
        return str(json.loads((folder / "dataset_info.json").read_text("utf-8"))["config_name"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def holds_copy(path: str, config: str | None, commit: str) -> bool:
    """Whether this node's cache holds a prepared copy of hub dataset ``path`` (``config``:
    None, any) at ``commit``."""
    return bool(_prepared_copies(_dataset_root(path), config, commit))
