"""A file's state: what a read kept in a process is keyed by, so that a file read again and
again (a shard's header, a checkpoint's metadata) is read once per state of it, and again
once it is rewritten, even in place under its inode."""

from __future__ import annotations

import os


def file_state(found: os.stat_result) -> tuple[int, int, int, int]:
    """(device, inode, size, mtime_ns) of a ``stat`` or ``fstat``: every write or
    replacement of the file changes one of them."""
    return found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns
