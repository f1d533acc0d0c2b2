"""One job at a time in a run directory.

Two jobs in one directory (a job requeued while the old one still runs, a command started
twice) would each pass the run directory's checks, then write one seed log, one
``checkpoints/`` and one ``export/`` between them: a resume rewrites the seed log by a
rename, so the other job's later steps go to a deleted file while its checkpoints land,
and the directory ends with a checkpoint ahead of its log, which no resume accepts. Rank
0 therefore holds an exclusive ``flock`` on ``.distzo.lock`` in the run directory while
its job runs, and deletes the file before it lets go (a lock taken on a file deleted
meanwhile is let go and taken again on the new one, so no two jobs ever hold two files of
one name). The kernel drops the lock when the process ends, however it ends, so a killed
job never leaves a stale one, only the file, which the next job locks.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import time
from pathlib import Path
from typing import TextIO

logger = logging.getLogger("distzo.train")

LOCK_FILE = ".distzo.lock"
# What a filesystem without locks (some network mounts) answers: the job runs unlocked.
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_RETRY_S = 0.05  # how often ``acquire(wait_s=...)`` asks again


class DirectoryLocked(ValueError):
    """The one-line refusal of a run directory that another job (``holder``: what its lock
    file says, "a process" where it says nothing) holds."""

    def __init__(self, message: str, holder: str) -> None:
        super().__init__(message)
        self.holder = holder


class RunLock:
    """Rank 0's lock on a run directory, from ``acquire`` to ``release`` (or its exit)."""

    def __init__(self, run_dir: Path, flag: str = "--output-dir") -> None:
        self.run_dir = run_dir
        self.flag = flag  # how the user named the directory, for the refusal
        self._file: TextIO | None = None
        self._made = False  # whether acquire made the directory (removed again if left empty)

    @property
    def held(self) -> bool:
        return self._file is not None

    @property
    def path(self) -> Path:
        return self.run_dir / LOCK_FILE

    def acquire(self, wait_s: float = 0.0) -> None:
        """Take the lock, or refuse in one line naming the job that holds it
        (``DirectoryLocked``); ``wait_s``: asked again for that long first, for a lock
        held an instant (another job's start-up check, ``check_not_running``)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return self._acquire()
            except DirectoryLocked:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(_RETRY_S)

    def _acquire(self) -> None:
        if self._file is not None:
            return
        self._made = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        while self._file is None:
            handle = open(self.path, "a+")
            if not self._lock(handle):
                return  # a filesystem without locks: said once, the job runs unlocked
            if _same_file(handle, self.path):
                handle.truncate(0)
                handle.write(_holder() + "\n")
                handle.flush()
                self._file = handle
            else:  # its holder deleted it as it let go: lock the file that is there now
                handle.close()

    def _lock(self, handle: TextIO) -> bool:
        """Whether ``handle`` is locked now (False: locks are not supported there)."""
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read()
            handle.close()
            refusal = _refusal(holder, self.run_dir, self.flag)
            raise DirectoryLocked(refusal, holder.strip() or "a process") from None
        except OSError as err:
            handle.close()
            if err.errno not in _NO_LOCKS:
                raise
            logger.warning(
                "%s cannot be locked (%s): a second job started in it would not be refused",
                self.run_dir,
                err.strerror,
            )
            return False
        return True

    def release(self) -> None:
        """Delete the lock file, then let go (once; a lock not held is a no-op); the
        directory too where ``acquire`` made it and the job wrote nothing there (it failed
        before), so that a failed start leaves no trace."""
        if self._file is None:
            return
        self.path.unlink(missing_ok=True)
        self._file.close()  # closing the file drops its flock
        self._file = None
        if self._made:
            with contextlib.suppress(OSError):  # not empty: the run's files
                self.run_dir.rmdir()


def check_not_running(run_dir: Path, flag: str = "--output-dir") -> None:
    """Refuse a directory another job's rank 0 (or an unclosed Trainer of this process)
    holds, before the run directory's checks read that job's files half-written and
    answer with advice for a run at rest (``--resume``, ``--resume auto``). Takes and drops
    a shared lock and writes nothing. Every rank's validation makes it: a job's rank 0
    locks only after the all-gather of every rank's options, so no rank finds its own
    job's lock."""
    try:
        handle = open(run_dir / LOCK_FILE)
    except OSError:  # no lock file, nothing runs there (or acquire says why later)
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(_refusal(handle.read(), run_dir, flag)) from None
        except OSError:  # a filesystem without locks: acquire warns
            return
        fcntl.flock(handle, fcntl.LOCK_UN)


def _refusal(holder: str, run_dir: Path, flag: str) -> str:
    """The one line that refuses a directory whose lock ``holder`` (the lock file's text)
    holds."""
    holder = holder.strip() or "a process"
    if holder == _holder():  # a notebook's earlier Trainer, built and never closed
        return (
            f"{flag} {run_dir}: another Trainer of this process holds it (built, not closed); "
            f"call its close(), or give another {flag}"
        )
    return (
        f"{flag} {run_dir}: another job is running in it ({holder}); wait for it to end or "
        f"stop it, or give another {flag}"
    )


def _holder() -> str:
    """What the lock file says of the job holding it: this process."""
    return f"pid {os.getpid()} on {socket.gethostname()}"


def _same_file(handle: TextIO, path: Path) -> bool:
    """Whether ``handle`` is still the file at ``path`` (not one deleted since it opened)."""
    try:
        named = path.stat()
    except FileNotFoundError:
        return False
    opened = os.fstat(handle.fileno())
    return (opened.st_dev, opened.st_ino) == (named.st_dev, named.st_ino)
