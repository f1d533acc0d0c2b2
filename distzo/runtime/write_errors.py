"""A write through safetensors that fails, raised as the ``OSError`` it is.

safetensors reports a failed write (a full disk, a file-size limit) as a
``SafetensorError`` whose message ends in ``I/O error: No space left on device (os error
28)``, no ``OSError``: the job's one-line report of a failed write, and the export's
removal of its half-written ``export.tmp/``, both wait for an ``OSError``, so a full disk
during an export (or the default model's ``base/``) ended in a traceback and left the
half-written folder on the full disk.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

from safetensors import SafetensorError

_OS_ERROR = re.compile(r"I/O error: .*\(os error (\d+)\)")


@contextlib.contextmanager
def safetensors_os_errors(path: Path | str) -> Iterator[None]:
    """Inside, a safetensors write to ``path`` (a file, or the folder ``save_pretrained``
    writes) that fails for the operating system's reason raises that reason as an
    ``OSError`` naming ``path``; any other ``SafetensorError`` stays as it is."""
    try:
        yield
    except SafetensorError as err:
        found = _OS_ERROR.search(str(err))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from err
