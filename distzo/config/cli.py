"""How the command-line entry points report bad input: one line, one write, exit code 2."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path


def program(module: str) -> str:
    """The name to show in usage lines: the installed command (``distzo-train``) when the
    user ran that, else ``python -m distzo.train``."""
    script = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return script if script.startswith("distzo-") else f"python -m {module}"


# Python 3.11's argparse reads only "-1" and "-.5" as negative numbers, so "--lr -1e-3" was
# "expected one argument" rather than the option's own range check.
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def takes_negative_exponents(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser``, reading "-1e-3" as a value: none of its options looks like a number."""
    parser._negative_number_matcher = NEGATIVE_NUMBER
    return parser


class _Versions(argparse.Action):
    """``--version``: distzo's version and those of the libraries a bug report needs, read
    from their installed metadata (importing torch would take seconds)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the versions and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        sys.stdout.write(versions() + "\n")  # stdout, as argparse's own version action
        parser.exit()


def versions() -> str:
    """``distzo 0.1.0 (torch 2.13.0, transformers 4.57.1, peft ..., python 3.11.9)``."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            return f"{name} not installed"

    libraries = ", ".join(installed(n) for n in ("torch", "transformers", "peft", "triton"))
    python = ".".join(map(str, sys.version_info[:3]))
    return f"{installed('distzo')} ({libraries}, python {python})"


def add_version_flag(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` with ``--version`` (``versions()``), as ``pip --version`` answers."""
    parser.add_argument("--version", action=_Versions)
    return parser


def home_path(value: str) -> Path:
    """A command's path argument with a leading ``~`` read as the home folder, as a shell
    reads it (``--out=~/x`` reaches the command as written); ``~name`` of no such user stays
    as written, as in a shell, where ``Path.expanduser`` raises a RuntimeError."""
    return Path(os.path.expanduser(value))


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
    under = f" (under {where})" if Path(where) in Path(os.fsdecode(path)).parents else ""
    # a failure of one rank's that every rank raises (``distzo.dist.agreement``) names it
    rank, said = _rank_said(err.strerror or str(err))
    if err.errno == errno.ENOSPC:
        return (
            f"{rank}no space left on device writing {path}{under}; free space there or use "
            "another directory"
        )
    return f"{rank}cannot write {path}{under}: {said}"


def _rank_said(strerror: str) -> tuple[str, str]:
    """(``"rank N: "`` or "", the rest) of an ``OSError``'s text."""
    named = re.match(r"rank \d+: ", strerror)
    return (named.group(), strerror[named.end() :]) if named else ("", strerror)


@contextlib.contextmanager
def names_file(path: Path | str) -> Iterator[None]:
    """An ``OSError`` raised inside, named after ``path`` when it names no file (a write or
    an fsync on an open file names none), so that ``write_failure`` says which file it was
    rather than the run directory, whose disk may not be the full one (``--log-dir``)."""
    try:
        yield
    except OSError as err:
        if err.filename is not None:
            raise
        raise OSError(err.errno, err.strerror, str(path)) from err
