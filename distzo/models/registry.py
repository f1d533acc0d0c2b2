"""Choose an adapter from ``config.model_type``; load models from a path, a hub name or a
config."""

from __future__ import annotations

import os

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.models.auto.auto_factory import _BaseAutoModelClass

from distzo.models.family import CAUSAL, MASKED, ModelFamily
from distzo.models.gemma import GemmaFamily
from distzo.models.gpt2 import GPT2Family
from distzo.models.granite import GraniteFamily
from distzo.models.llama import LlamaFamily
from distzo.models.moe import MoEFamily
from distzo.models.opt import OPTFamily
from distzo.models.roberta import RobertaFamily
from distzo.runtime.argument_values import type_and_repr
from distzo.runtime.master_dtypes import MASTER_DTYPES

# Adding a family: one adapter file, its class here, and a blockwise == forward test.
ADAPTERS: dict[str, type[ModelFamily]] = {
    t: cls
    for cls in (
        OPTFamily,
        LlamaFamily,
        GemmaFamily,
        GraniteFamily,
        GPT2Family,
        MoEFamily,
        RobertaFamily,
    )
    for t in cls.model_types
}

# The class that loads each kind of family (``ModelFamily.lm_kind``): the only place that
# decides it, for a checkpoint, a config, a skeleton and a size count alike.
AUTO_CLASSES: dict[str, type[_BaseAutoModelClass]] = {
    CAUSAL: AutoModelForCausalLM,
    MASKED: AutoModelForMaskedLM,
}


# Multimodal models whose language model is a supported family's, under a type of its own:
# what the refusal tells a user who hands one to a text-model API (``--model`` trains the
# language model of such a checkpoint: ``distzo.models.multimodal``).
TEXT_MODELS = {
    "gemma3": "the language model of such a checkpoint given as --model, and Gemma 3's "
    "text-only models (1B, model type gemma3_text)"
}


OPTION = "model"  # what load_model's errors call its argument


def supported_model_types() -> list[str]:
    return sorted(ADAPTERS)


def check_supported(model_type: str) -> type[ModelFamily]:
    """The adapter class for ``model_type``, or a one-line error listing what is supported."""
    try:
        return ADAPTERS[model_type]
    except KeyError:
        text = TEXT_MODELS.get(model_type)
        hint = f" (a multimodal model: distzo trains {text})" if text else ""
        raise ValueError(
            f"unsupported model type {model_type!r}{hint}: distzo supports "
            f"{', '.join(supported_model_types())}; pick a model of one of these families"
        ) from None


def auto_class(model_type: str) -> type[_BaseAutoModelClass]:
    """The transformers Auto class that builds a model of ``model_type`` as distzo trains
    it: ``AutoModelForMaskedLM`` for an encoder (``RobertaForMaskedLM``), else
    ``AutoModelForCausalLM``."""
    return AUTO_CLASSES[check_supported(model_type).lm_kind]


def check_causal_lm(model_type: str, use: str, fix: str) -> None:
    """Refuse, in one line before any weights load, ``use`` (what needs a next token to
    predict) of a masked LM, whose head predicts the token under a mask."""
    if check_supported(model_type).lm_kind == MASKED:
        raise ValueError(
            f"{use} needs a causal LM, and model type {model_type!r} is a masked LM "
            f"(its head predicts the token under a <mask>, no next token); {fix}"
        )


def family_for(model: nn.Module) -> ModelFamily:
    return check_supported(getattr(model.config, "model_type", type(model).__name__))(model)


def model_dtype(dtype: torch.dtype | str, auto: bool = False) -> torch.dtype | str:
    """The dtype a model is built in: a floating torch dtype, a name ``--dtype`` takes
    (``fp32``, ``fp64``), a torch dtype's name (``"bfloat16"``, as transformers reads it), or
    with ``auto`` the checkpoint's own (``"auto"``). Transformers' answer to another name
    (``"bf16"``) was "module 'torch' has no attribute 'bf16'", naming neither the argument
    nor what it takes."""
    if isinstance(dtype, str):
        named = MASTER_DTYPES.get(dtype, getattr(torch, dtype, None))
        if isinstance(named, torch.dtype) and named.is_floating_point:
            return named
        if auto and dtype == "auto":
            return dtype
    elif isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    takes = ", ".join(MASTER_DTYPES) + (", auto" if auto else "")
    raise ValueError(
        f"dtype {dtype!r} is not a floating-point dtype: give a torch.dtype (torch.float32, "
        f"torch.bfloat16) or one of {takes}"
    )


def model_from_config(
    config: PretrainedConfig, dtype: torch.dtype | str = torch.float32
) -> PreTrainedModel:
    """A randomly initialised model of ``config``'s shape (tests, benchmarks, the default run).
    A dict or a hub name where the config belongs was "'dict' object has no attribute
    'model_type'", naming neither the argument nor what it takes."""
    if not isinstance(config, PretrainedConfig):
        raise TypeError(
            f"config must be a transformers PretrainedConfig, got {type_and_repr(config)}: "
            "AutoConfig.from_pretrained(name_or_path) or a family's own (OPTConfig(...))"
        )
    dtype = model_dtype(dtype)
    return auto_class(config.model_type).from_config(config, dtype=dtype)


def load_model(
    name_or_path: str | os.PathLike[str], dtype: torch.dtype | str = torch.float32
) -> PreTrainedModel:
    """Load a pretrained model of a supported family (a causal LM, or an encoder as its
    masked LM) from a local directory or a hub name.

    The config is read first so that an unsupported family fails before any weights load.
    A hub name is read as ``--model`` reads it: each request bounded, the cache (with one
    warning) where the hub does not answer or stalls, else one line; transformers' own
    loader waited on such a hub for minutes, or without a limit.
    """
    from distzo.models.config_file import read_config
    from distzo.models.hub import local_model_dir, snapshot

    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(
            f"load_model takes a hub name or a local folder (a str or a Path), got "
            f"{type(name_or_path).__name__} {name_or_path!r}"
        )
    name_or_path = os.fspath(name_or_path)  # a relative Path that is no folder: one line too
    dtype = model_dtype(dtype, auto=True)
    local = local_model_dir(name_or_path, OPTION)
    loader = auto_class(read_config(local or name_or_path, OPTION).model_type)
    source = local or snapshot(name_or_path, True, option=OPTION)
    model = loader.from_pretrained(source, dtype=dtype)
    if local is None:  # named as given, not as the cache folder it was read from
        model.name_or_path = model.config.name_or_path = name_or_path
    return model
