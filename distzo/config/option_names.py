"""How an error names an option: by the engine's field (``state_dtype bf16``) for a caller
of the Python API, by its flag (``--state-dtype bf16``) for a user of the command line,
whose options are the same fields with dashes (``distzo.config.job``). The engine's
checks run in both worlds; the job builds its config inside ``named_as_flags``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_AS_FLAGS: ContextVar[bool] = ContextVar("distzo_options_named_as_flags", default=False)


@contextmanager
def named_as_flags() -> Iterator[None]:
    """Within it, ``option_name`` gives command-line flags."""
    token = _AS_FLAGS.set(True)
    try:
        yield
    finally:
        _AS_FLAGS.reset(token)


def option_name(field: str) -> str:
    """``field`` as the user who set it wrote it: ``state_dtype`` or ``--state-dtype``."""
    return "--" + field.replace("_", "-") if _AS_FLAGS.get() else field
