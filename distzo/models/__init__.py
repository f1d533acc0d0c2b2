"""Model adapters: split a Hugging Face causal LM into resident embed/head and streamed blocks."""

from distzo.models.family import BatchContext, ModelFamily
from distzo.models.opt import OPTFamily
from distzo.models.registry import (
    check_supported,
    family_for,
    load_model,
    model_from_config,
    supported_model_types,
)

__all__ = [
    "BatchContext",
    "ModelFamily",
    "OPTFamily",
    "family_for",
    "check_supported",
    "load_model",
    "model_from_config",
    "supported_model_types",
]
