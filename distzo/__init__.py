"""distzo: zeroth-order fine-tuning of LLMs with blocks streamed from host memory.

The public names load on first use (PEP 562), so that ``python -m distzo.train --help``
and a mistyped flag answer before torch's and transformers' seconds of imports."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distzo.config.engine_options import ZOConfig
    from distzo.engine import PendingUpdate, StepResult, ZOEngine
    from distzo.models import family_for, load_model, model_from_config

__version__ = "0.1.0"

_HOMES = {
    "ZOConfig": "distzo.config.engine_options",
    "ZOEngine": "distzo.engine",
    "StepResult": "distzo.engine",
    "PendingUpdate": "distzo.engine",
    "family_for": "distzo.models",
    "load_model": "distzo.models",
    "model_from_config": "distzo.models",
}

__all__ = [
    "ZOConfig",
    "ZOEngine",
    "StepResult",
    "PendingUpdate",
    "family_for",
    "load_model",
    "model_from_config",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'distzo' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once loaded, a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
