"""What a Python API refusal says about the value it got, and the check of a flag: one
wording for every argument refusal, below every layer that refuses one."""

from __future__ import annotations

import reprlib
from typing import Any


def type_and_repr(value: Any) -> str:
    """What an argument refusal says it got: the type, then a short repr (a model's or a
    long list's would be pages), one wording for every refusal of a Python API argument."""
    return f"{type(value).__name__} {reprlib.repr(value)}"


def check_flag(value: Any, argument: str, meaning: str) -> None:
    """A flag is a bool: a string where one belongs is truthy (``overwrite="no"`` replaced the
    folder it meant to keep), a number half a vote. A one-line TypeError naming ``argument``,
    what it got, and ``meaning``, what it does."""
    if not isinstance(value, bool):
        got = type_and_repr(value)
        raise TypeError(f"{argument} must be True or False, got {got}: {meaning}")
