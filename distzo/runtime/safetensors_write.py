"""A write through safetensors done as an ordinary file write: its failure an ``OSError``,
its file readable as the umask allows.

safetensors reports a failed write (a full disk, a file-size limit) as a
``SafetensorError`` whose message ends in ``I/O error: No space left on device (os error
28)``, no ``OSError``: the job's one-line report of a failed write, and the export's
removal of its half-written ``export.tmp/``, both wait for an ``OSError``, so a full disk
during an export (or the default model's ``base/``) ended in a traceback and left the
half-written folder on the full disk.

And since safetensors 0.8 writes through a temporary file that it renames, its files are
private (mode 0600, whatever the umask: safetensors/safetensors#782), where ``config.json``
beside them is 0644: an exported model or adapter that another user, a serving container or
a group on a shared filesystem loads failed there as a missing file.
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
def safetensors_write(path: Path | str) -> Iterator[None]:
    """Around a safetensors write to ``path`` (a file, or the folder ``save_pretrained``
    writes): a failure for the operating system's reason raises that reason as an
    ``OSError`` naming ``path`` (any other ``SafetensorError`` stays as it is); on success
    the safetensors files written have the mode an ordinary new file has."""
    try:
        yield
    except SafetensorError as err:
        found = _OS_ERROR.search(str(err))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from err
    path = Path(path)
    for file in sorted(path.glob("*.safetensors")) if path.is_dir() else [path]:
        file.chmod(ordinary_mode())


def ordinary_mode(directory: bool = False) -> int:
    """The permission bits ``open()`` (``mkdir``) gives a new file (directory) under this
    process's umask."""
    return (0o777 if directory else 0o666) & ~_umask()


def _umask() -> int:
    """This process's umask, read without setting it where Linux shows it: ``os.umask``
    is the only other reader, and it sets the mask for a moment, when a thread of the run
    (an asynchronous checkpoint's writer) may be creating a file."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
