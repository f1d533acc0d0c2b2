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


def options_are_flags() -> bool:
    """Whether the caller is the command line (within ``named_as_flags``), whose defaults
    differ: there ``--noise`` and ``--num-queries`` follow the estimator."""
    return _AS_FLAGS.get()


def option_name(field: str, python: str | None = None) -> str:
    """``field`` as the user who set it wrote it: ``state_dtype`` or ``--state-dtype``;
    ``python`` is the Python caller's own name for a job option that is no ``ZOConfig``
    field (``--lora-targets``: the ``LoraConfig``'s ``target_modules``)."""
    if _AS_FLAGS.get():
        return "--" + field.replace("_", "-")
    return field if python is None else python
