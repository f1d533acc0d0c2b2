"""How the command-line entry points report bad input: one line, one write, exit code 2."""

from __future__ import annotations

import sys


def fail(message: str) -> int:
    """Write ``error: message`` in a single write: ranks failing at once share stderr, and a
    line split into two writes (print's text, then its newline) can interleave with theirs."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    return 2
