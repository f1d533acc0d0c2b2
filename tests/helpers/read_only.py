"""A folder as a user sees one it may only read (a group's shared cache), for root too."""

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT


@contextlib.contextmanager
def read_only(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``folder`` as a group member sees a cache it may only read: its modes without write
    bits, and, since root ignores them, creating a file or folder in it refused, and
    ``os.access`` answering, as the kernel does for that member."""
    real_open, real_mkdir, real_access = os.open, os.mkdir, os.access

    def inside(path: str) -> bool:
        return Path(os.path.abspath(path)).is_relative_to(folder)

    def refused(path: str) -> OSError:
        return PermissionError(errno.EACCES, "Permission denied", os.fspath(path))

    def open_(path, flags, *args, **kwargs):
        if flags & WRITES and inside(path):
            raise refused(path)
        return real_open(path, flags, *args, **kwargs)

    def mkdir(path, *args, **kwargs):
        if inside(path) and not os.path.isdir(path):
            raise refused(path)
        return real_mkdir(path, *args, **kwargs)

    def access(path, mode, *args, **kwargs):
        if mode & os.W_OK and inside(path):
            return False
        return real_access(path, mode, *args, **kwargs)

    modes = {p: p.stat().st_mode for p in [folder, *folder.rglob("*")]}
    for path, mode in modes.items():
        path.chmod(mode & ~0o222)
    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "access", access)
    try:
        yield
    finally:
        monkeypatch.setattr(os, "open", real_open)
        monkeypatch.setattr(os, "mkdir", real_mkdir)
        monkeypatch.setattr(os, "access", real_access)
        for path, mode in modes.items():
            path.chmod(mode)
