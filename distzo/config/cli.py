"""How the command-line entry points report bad input: one line, one write, exit code 2."""

from __future__ import annotations

import errno
import sys
from pathlib import Path


def program(module: str) -> str:
    """The name to show in usage lines: the installed command (``distzo-train``) when the
    user ran that, else ``python -m distzo.train``."""
    script = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return script if script.startswith("distzo-") else f"python -m {module}"


def fail(message: str, code: int = 2) -> int:
    """Write ``error: message`` in a single write: ranks failing at once share stderr, and a
    line split into two writes (print's text, then its newline) can interleave with theirs.
    Returns ``code``: 2 for bad input, 1 for a failure (a full disk)."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    return code


def write_failure(err: OSError, where: Path | str) -> str:
    """One line for a write that failed under ``where`` (a run directory, a replay's --out):
    a full disk said in words and where, rather than a traceback ending in errno 28."""
    path = err.filename or where
    if err.errno == errno.ENOSPC:
        return (
            f"no space left on device writing {path} (under {where}); free space there or "
            "use another directory"
        )
    return f"cannot write {path} (under {where}): {err.strerror or err}"
