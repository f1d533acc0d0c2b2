"""Model adapters: split a Hugging Face causal LM into resident embed/head and streamed blocks."""

from distzo.models.adapter import BatchContext, BlockAdapter
from distzo.models.opt import OPTAdapter
from distzo.models.registry import adapter_for, check_supported, load_model, model_from_config, supported_model_types

__all__ = [
    "BatchContext",
    "BlockAdapter",
    "OPTAdapter",
    "adapter_for",
    "check_supported",
    "load_model",
    "model_from_config",
    "supported_model_types",
]
