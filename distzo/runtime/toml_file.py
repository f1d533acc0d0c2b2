"""A TOML file someone wrote (a ``--config`` file, a run's ``config.toml``), read with one
kind of one-line error whatever is wrong with it.

``tomllib.load`` fails four ways besides ``TOMLDecodeError``: ``OSError`` (no file, a
folder), ``RecursionError`` (nesting past the recursion limit) and ``UnicodeDecodeError``
(bytes that are not UTF-8, raised before parsing, naming neither the file nor the line).
Each reader caught its own subset and worded it its own way; non-UTF-8 bytes escaped all
three as a bare codec message. ``read_toml`` turns each into ``UnreadableToml``, naming the
file and, where there is one, the line and column; a caller adds its fix, and decides
whether to raise or to fall back.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any


class UnreadableToml(ValueError):
    """A TOML file that could not be read or parsed: ``str`` is ``"<path>: <problem>"``."""

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


def read_toml(path: str | Path) -> dict[str, Any]:
    """The file's tables, or ``UnreadableToml`` saying in one line what is wrong and where."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise UnreadableToml(path, "no such file") from None
    except OSError as err:  # a folder, a file it may not read
        raise UnreadableToml(path, f"cannot read it ({err.strerror or err})") from None
    try:
        text = data.decode()
    except UnicodeDecodeError as err:
        line, column = _line_and_column(data, err.start)
        raise UnreadableToml(
            path,
            f"not valid TOML (not UTF-8: byte {data[err.start]:#04x} at line {line}, "
            f"column {column})",
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:  # its text ends "(at line L, column C)"
        raise UnreadableToml(path, f"not valid TOML ({err})") from None
    except RecursionError:  # tomllib recurses once per level of nesting
        raise UnreadableToml(path, "not valid TOML (nested too deeply)") from None


def _line_and_column(data: bytes, offset: int) -> tuple[int, int]:
    """The 1-based line and column (in bytes) of ``offset`` in ``data``."""
    line_start = data.rfind(b"\n", 0, offset) + 1
    return data.count(b"\n", 0, offset) + 1, offset - line_start + 1
