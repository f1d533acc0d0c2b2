"""Whether a folder can be written, asked before the work that fills it: a command's
``--out``, a run's ``--output-dir`` and a GGUF conversion's folder are refused in one line
naming the folder, not with the ``PermissionError`` of the first file, minutes later."""

from __future__ import annotations

import os
from pathlib import Path


def nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (what a mkdir of ``path`` would need to
    be a writable folder)."""
    while not path.exists():
        path = path.parent
    return path


def unwritable(folder: Path) -> str | None:
    """Why this process cannot make files in ``folder`` (an existing folder): a read-only
    mount, which no permission opens, or its permissions, which its owner can change; None
    where it can."""
    if os.access(folder, os.W_OK | os.X_OK):
        return None
    read_only = os.statvfs(folder).f_flag & os.ST_RDONLY
    return "a read-only file system" if read_only else "permission denied"
