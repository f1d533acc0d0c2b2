"""Argument types the benchmark scripts share, so that a bad count, rate or size is
refused by argparse in one line before any measurement starts: a count of 0 or -1 must
not become the default silently, nor a traceback after a GPU lease's minutes are spent."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

# decimal units (a link's GB/s) and binary ones (a GPU's GiB), case-insensitive
SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9}
SIZE_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # what argparse names in its messages
    return parse


def counts(minimum: int) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated integers >= ``minimum`` ("1,2,4"; "" is none), each
    refused as ``at_least`` refuses one."""
    one = at_least(minimum)

    def parse(text: str) -> list[int]:
        return [one(part) for part in text.split(",") if part.strip()]

    parse.__name__ = f"integers >= {minimum}"
    return parse


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (a rate, a bandwidth)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def byte_size(text: str) -> int:
    """``"64MB"``, ``"1GiB"``, ``"4096"`` -> bytes (> 0); ValueError naming the units."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in SIZE_UNITS:
        raise ValueError(
            f"{text!r} is not a size; write e.g. 64MB, 1GB (10^9 bytes), 1GiB (2^30) or 4096"
        )
    size = int(float(match.group(1)) * SIZE_UNITS[unit])
    if size < 1:
        raise ValueError(f"{text!r} is not a size of at least one byte")
    return size
