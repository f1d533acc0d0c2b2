"""Triton's kernel cache, in a folder this process can write.

Triton compiles a kernel on its first launch into ``~/.triton/cache`` (``TRITON_CACHE_DIR``,
or ``TRITON_HOME``'s ``.triton/cache``) and raises where it cannot make that folder. On a
cluster whose home is read-only (or a container's user with no home, whose ``~`` stays
``~``: a folder of that name in the working directory), a GPU run failed at its first
step, after its model was built, with ``Read-only file system: '.../.triton'``. Such a
process compiles into a private temporary folder instead, removed as it exits, and says
how to keep the kernels across runs, as matplotlib does for its own cache.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)


def cache_problem(folder: str) -> str | None:
    """Why Triton cannot cache its kernels in ``folder``; None where it can."""
    if folder.startswith("~"):
        return "no home folder to hold it"
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryDirectory(dir=folder).cleanup()  # what Triton writes: a folder
    except OSError as err:
        return err.strerror or str(err)
    return None


def writable_kernel_cache() -> str:
    """Triton's cache folder, moved to a temporary one for this process where the
    configured one cannot be written (a warning names it and the fix). Returns the
    folder Triton caches in."""
    from triton import knobs

    folder = knobs.cache.dir
    problem = cache_problem(folder)
    if problem is None:
        return folder
    private = tempfile.mkdtemp(prefix="distzo-triton-")
    atexit.register(shutil.rmtree, private, ignore_errors=True)
    knobs.cache.dir = private
    logger.warning(
        "Triton's kernel cache %s cannot be written (%s): this run compiles its kernels "
        "into %s, removed at its end; set TRITON_CACHE_DIR to a writable folder to keep "
        "them across runs",
        folder,
        problem,
        private,
    )
    return private
