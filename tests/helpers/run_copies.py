"""A copy of a finished run directory that a test may change, shared by module-scoped runs."""

from __future__ import annotations

import shutil
from pathlib import Path


def copied_run(run: Path, to: Path) -> Path:
    """``run`` copied to ``to``, its ``config.toml`` naming ``to`` (it names the directory
    it was written in, which a resume checks)."""
    shutil.copytree(run, to)
    config = to / "config.toml"
    config.write_text(config.read_text().replace(str(run), str(to)))
    return to
