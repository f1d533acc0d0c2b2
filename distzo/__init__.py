"""distzo: zeroth-order fine-tuning of LLMs with blocks streamed from host memory."""

from distzo.config.engine_options import ZOConfig
from distzo.engine import PendingUpdate, StepResult, ZOEngine
from distzo.models import family_for, load_model, model_from_config

__version__ = "0.1.0"

__all__ = [
    "ZOConfig",
    "ZOEngine",
    "StepResult",
    "PendingUpdate",
    "family_for",
    "load_model",
    "model_from_config",
]
