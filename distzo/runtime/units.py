"""Sizes and counts in a log line, in the unit that fits: ``1.50 GB``, ``25.41 K``.

Bytes are decimal (1 KB = 1000 B, 1 GB = 1e9 B), as everywhere else in distzo: the
metrics' ``*_gb`` fields, the docs' figures and ``--export-shard-size 5GB`` (which
Hugging Face reads as 5e9 bytes). One helper for every logged byte figure keeps them
comparable, and neither a small model's ``0.00 GB`` nor its ``0.000 B parameters``.
"""

from __future__ import annotations

_BYTE_UNITS = ("B", "KB", "MB", "GB", "TB", "PB")
_COUNT_UNITS = ("", "K", "M", "B", "T")


def _scaled(value: float, units: tuple[str, ...]) -> str:
    """``value`` divided by 1000 until below 1000 (after rounding to 2 decimals), with its
    unit; below 1000 the plain integer."""
    if abs(round(value)) < 1000:
        return f"{int(round(value))} {units[0]}".rstrip()
    for unit in units[1:]:
        value /= 1000
        if abs(round(value, 2)) < 1000 or unit == units[-1]:
            return f"{value:.2f} {unit}"
    raise AssertionError("unreachable: the last unit takes any value")


def format_bytes(n: float) -> str:
    """``0 B``, ``999 B``, ``1.02 KB``, ``1.50 GB``: decimal units (see the module)."""
    return _scaled(n, _BYTE_UNITS)


def format_count(n: float) -> str:
    """A parameter count: ``0``, ``999``, ``1.20 M``, ``7.00 B`` (thousands, millions,
    billions; decimal)."""
    return _scaled(n, _COUNT_UNITS)


def counted(n: int, noun: str) -> str:
    """``n`` and its noun, singular for one (``1 step``, ``2 steps``): a line a user reads
    says "done: 1 step", not "1 steps"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
