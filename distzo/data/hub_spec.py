"""An ``hf:`` source as written: ``hf:PATH[@REVISION][:CONFIG]:SPLIT``.

``REVISION`` pins a hub dataset to a tag, a branch or a commit, as ``datasets.load_dataset``'s
``revision`` does. A hub repository id holds no ``@`` (huggingface_hub's ``validate_repo_id``),
so the first ``@`` of PATH ends a hub name; a local folder (a clone of a dataset's
repository, which ``datasets`` reads before any hub name) may hold one, and is told apart by
being a folder here. A folder whose name also reads as a hub name at a revision is refused
as ambiguous, with the spelling that says which (``./NAME@REV``), and so is an empty
revision: each one line, before the hub is asked anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

FORMAT = "hf:PATH[@REVISION][:CONFIG]:SPLIT"
COMMIT = re.compile("[0-9a-f]{40}")  # a full commit hash, as the hub gives one


@dataclass(frozen=True)
class HubSpec:
    """An ``hf:`` source's parts: ``path``, a hub name or a local folder; ``revision``, the
    tag, branch or commit the spec names (None: the hub's ``main``, or a folder's files)."""

    path: str
    config: str | None
    split: str
    revision: str | None = None

    def at(self, revision: str | None) -> str:
        """The source as written with ``revision`` (None: none named)."""
        named = f"@{revision}" if revision else ""
        config = f":{self.config}" if self.config else ""
        return f"hf:{self.path}{named}{config}:{self.split}"


def hub_spec(source: str) -> HubSpec:
    """``source``'s parts, or one line naming what is wrong and the spelling to write."""
    parts = source[3:].split(":")
    if "" in parts:
        parts = []  # an empty name would reach the hub, or be taken for no config
    if len(parts) not in (2, 3):
        raise ValueError(
            f"{source}: write a hub dataset as {FORMAT}, e.g. hf:nyu-mll/glue:sst2:train"
        )
    config, split = (None, parts[1]) if len(parts) == 2 else (parts[1], parts[2])
    path, revision = _revision(source, parts[0])
    return HubSpec(path, config, split, revision)


def _revision(source: str, written: str) -> tuple[str, str | None]:
    """PATH and REVISION of ``written`` (``source``'s PATH[@REVISION])."""
    if "@" not in written:
        return written, None
    name, _, revision = written.partition("@")
    if Path(written).is_dir():  # a local folder whose name holds an @
        # imported here: the models package loads transformers, which --help must not wait on
        from distzo.models.hub_reads import is_repo_id

        if is_repo_id(name) and revision:
            raise ValueError(
                f"{source}: {written} is a local folder, and also reads as hub dataset {name} "
                f"at revision {revision}; write hf:./{written}:... for the folder, or run where "
                "no such folder is"
            )
        return written, None
    if not name or not revision:
        missing = "name before" if not name else "revision after"
        raise ValueError(
            f"{source}: the {missing} @ is empty; write {FORMAT} (a tag, a branch or a "
            "commit), or drop the @"
        )
    if "@" in revision:
        raise ValueError(
            f"{source}: a hub dataset's name holds no @ and a spec names one revision; "
            f"write {FORMAT}"
        )
    if Path(name).is_dir():
        raise ValueError(
            f"{source}: {name} is a local folder, which has no revision; drop @{revision} "
            "(check the revision out in the folder)"
        )
    return name, revision
