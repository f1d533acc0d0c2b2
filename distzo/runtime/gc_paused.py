"""Python's cycle collector held off while a file's rows become objects.

Building a million Examples allocates millions of objects the collector tracks, and each
of its full passes walks every one built so far: 11 passes made a million SST-2 rows'
load take 19.3 s where it takes 7.5 s without them. The rows hold no reference cycles,
so nothing the pause defers is garbage; the collector runs again as it was after.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic collection inside the block; the collector enabled after it (a raise
    too) only where it was before, so a caller's own ``gc.disable()`` stands."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
