"""A ``datasets`` cache this process cannot write, read as it stands.

A cluster's group shares one Hugging Face cache on a read-only mount (or one the group may
only read). ``load_dataset`` locks the cache (a ``.lock`` file beside the prepared dataset)
even to read a dataset an earlier load prepared, so on such a cache it failed with
``Read-only file system``, offline too, where the rows were all there. A lock file that
cannot be made, in a folder this process may not write, guards nothing this process could
write: the builder then reads the prepared dataset unlocked, as ``datasets`` does on a
remote filesystem. A dataset the cache does not hold still fails where ``datasets``
writes it, with its own error.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from distzo.models.hub import READ_ONLY  # what a write refused in a folder raises


class LockUnlessReadOnly:
    """``datasets``' ``FileLock``, or no lock where the lock file cannot be created in a
    folder this process may not write. A lock refused in a folder it may write (another
    user's lock file, private to them) is raised as before: a second writer there could
    prepare the dataset beside the first."""

    def __init__(self, lock_class: Any, lock_file: str, *args: Any, **kwargs: Any) -> None:
        self.lock = lock_class(lock_file, *args, **kwargs)
        self.folder = os.path.dirname(os.path.abspath(lock_file))
        self.held = False

    def __enter__(self) -> LockUnlessReadOnly:
        try:
            self.lock.acquire()
        except OSError as err:
            if err.errno not in READ_ONLY or os.access(self.folder, os.W_OK):
                raise
        else:
            self.held = True
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        err: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self.held:
            self.held = False
            self.lock.release()


@contextlib.contextmanager
def unlocked_where_read_only() -> Iterator[None]:
    """Within the block, ``datasets``' builder takes its cache locks where it can and reads
    without them where the cache is read-only; its own lock class restored after."""
    import datasets.builder

    original = datasets.builder.FileLock
    datasets.builder.FileLock = functools.partial(LockUnlessReadOnly, original)
    try:
        yield
    finally:
        datasets.builder.FileLock = original
