"""The export options a replay of a run's seed log takes where its command names none: the
run's own, so that ``distzo.replay`` writes the export the run wrote (its shards, its adapter
merged or not) rather than ``distzo.train``'s defaults."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from distzo.config.field_types import is_of_type
from distzo.config.job import DEFAULT_MAX_SHARD_SIZE
from distzo.runtime.toml_file import UnreadableToml, read_toml

logger = logging.getLogger(__name__)

# Each option: its config.toml section and type (the header records it under its name too).
EXPORT_OPTIONS = {"export_shard_size": ("run", str), "merge_adapter": ("peft", bool)}


def run_export_options(log: Path, header: dict) -> dict[str, Any]:
    """``--export-shard-size`` and ``--merge-adapter`` as the run last took them: its
    ``config.toml`` beside the log (which a resume rewrites with the options it changed,
    and the run's ``export/`` was written with), else what the log's header recorded at
    the run's start (a log copied alone), else the defaults (a log from before the header
    recorded them)."""
    options: dict[str, Any] = {
        "export_shard_size": header.get("export_shard_size", DEFAULT_MAX_SHARD_SIZE),
        "merge_adapter": bool(header.get("merge_adapter")),
    }
    recorded = _config_toml(log.parent / "config.toml")
    for name, (section, kind) in EXPORT_OPTIONS.items():
        table = recorded.get(section)  # a hand-edited ``run = 1`` is no table
        value = table.get(name) if isinstance(table, dict) else None
        if is_of_type(value, kind):
            options[name] = value
    return options


def _config_toml(path: Path) -> dict[str, Any]:
    """The run's config.toml as read; none ({}) where there is none, and a warning, not a
    failure, where it cannot be read: the header holds what the replay needs."""
    if not path.exists():
        return {}
    try:
        return read_toml(path)
    except UnreadableToml as err:
        logger.warning("%s; the log's header gives the export options", err)
        return {}
