"""The value type of each field of an options dataclass, read from its annotations (an
optional one's ``X | None`` as ``X``), and whether a value is of it: one reading for the
command line's parser, the TOML reader and ``ZOConfig``'s own check."""

from __future__ import annotations

import dataclasses
import operator
import types
import typing
from typing import Any

# read once per dataclass: ZOConfig checks its fields at every validate()
_READ: dict[type, dict[str, tuple[type, bool]]] = {}


def field_types(cls: type) -> dict[str, tuple[type, bool]]:
    """Each field of the dataclass ``cls``: (its value type, whether it may be None)."""
    if cls in _READ:
        return _READ[cls]
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        hint, optional = hints[f.name], False
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
            args = typing.get_args(hint)
            optional = type(None) in args
            hint = next(a for a in args if a is not type(None))
        out[f.name] = (hint, optional)
    _READ[cls] = out
    return out


def is_of_type(value: Any, kind: type) -> bool:
    """``isinstance(value, kind)``, but a boolean is not a number, and an int is a float."""
    if isinstance(value, bool) and kind is not bool:
        return False
    return isinstance(value, (int, float) if kind is float else kind)


def whole_number(value: Any) -> int | None:
    """``value`` as an int where it is a whole number without rounding (an int, a numpy
    integer, a 0-dim integer tensor), else None: a bool is no count, a float not a whole
    one (``operator.index`` takes exactly these)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
