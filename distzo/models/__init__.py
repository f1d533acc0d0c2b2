"""Model families: a Hugging Face causal LM (or an encoder as its masked LM, RoBERTa) split
into resident embed/head and streamed blocks; and where its weights come from
(checkpoints, named shapes, the hub, GGUF)."""

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
