"""The copy of an ``hf:`` dataset at one commit that this node's ``datasets`` cache holds.

A launch's ranks read an ``hf:`` dataset offline, from their node's cache, at the commit
rank 0 was told. ``datasets`` offline ignores the revision it is given: it reads the
cache's most recently modified prepared copy of the dataset, whatever its commit
(``packaged_modules.cache``), so a node whose cache held a copy of another commit prepared
later (an earlier run, a script at another revision) trained on that copy's rows without a
word. ``datasets`` keeps each prepared copy in a folder named by its commit
(``NAMESPACE___NAME/CONFIG/VERSION/COMMIT``); here that one folder is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# why a node's cache lacks the pinned copy, as a rank reading it finds, and as its first
# rank finds after the download (a hub silent to that node: datasets read its cache instead)
READ_MISSING = "and the node's first rank downloaded; give a node's ranks one HF_DATASETS_CACHE"
FILL_MISSING = (
    "and the hub did not give this node (its warning says why); let the node reach the hub, "
    "or download the dataset at that commit on it first"
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
    import datasets.config
    from datasets.naming import camelcase_to_snakecase

    *namespace, name = path.split("/")
    root = Path(datasets.config.HF_DATASETS_CACHE).expanduser()
    root /= "___".join([*namespace, camelcase_to_snakecase(name)])
    copies = [
        folder
        for folder in sorted(root.glob(f"{config or '*'}/*/{commit}"))
        if folder.is_dir() and _config_name(folder) == folder.parts[-3]
    ]
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
