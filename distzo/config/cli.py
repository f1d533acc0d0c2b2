"""How the command-line entry points report bad input: one line, one write, exit code 2."""

from __future__ import annotations

import sys
from pathlib import Path


def program(module: str) -> str:
    """The name to show in usage lines: the installed command (``distzo-train``) when the
    user ran that, else ``python -m distzo.train``."""
    script = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return script if script.startswith("distzo-") else f"python -m {module}"


def fail(message: str) -> int:
    """Write ``error: message`` in a single write: ranks failing at once share stderr, and a
    line split into two writes (print's text, then its newline) can interleave with theirs."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    return 2
