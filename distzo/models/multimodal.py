"""Multimodal checkpoints whose language model distzo trains: Gemma 3 4B, 12B and 27B (model
type ``gemma3``: a SigLIP vision tower, a projector and a Gemma 3 text model).

The engine trains the text model alone, as the text-only model of its family (a
``Gemma3ForCausalLM`` of the checkpoint's ``text_config``): the vision tower and the
projector are never built, read or moved to a device. The checkpoint's keys are matched to
the text model's parameters through transformers' own conversion mapping (the keys
transformers 4.x wrote, ``language_model.model.*``, and those of 5.x,
``model.language_model.*``), and the export writes the multimodal model back: the trained
text weights under the checkpoint's own keys, the vision tower and projector copied as they
are stored, and the checkpoint's config.json (``MultimodalOrigin``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForImageTextToText, PretrainedConfig

from distzo.models.registry import check_supported
from distzo.models.weights import HeaderChecked, WeightSource, open_checkpoint, skeleton

# Multimodal model types whose language model is a supported text family's.
MULTIMODAL_TYPES = ("gemma3",)
# The attribute of a text model built from a multimodal checkpoint that says where it came from.
ORIGIN_ATTRIBUTE = "distzo_multimodal"


def is_multimodal(config: PretrainedConfig) -> bool:
    return config.model_type in MULTIMODAL_TYPES and hasattr(config, "text_config")


def trained_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config of the model distzo trains: a multimodal config's text model, as a model
    of its own; any other config as it is. The multimodal class's head does not soft-cap
    its logits (a text model of the same config does), nor does the text model here; it
    ties its head as the multimodal model does."""
    if not is_multimodal(config):
        return config
    check_text_config(config)
    text = copy.deepcopy(config.text_config)
    if hasattr(text, "final_logit_softcapping"):
        text.final_logit_softcapping = None
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
    text.name_or_path = config.name_or_path
    return text


def check_text_config(config: PretrainedConfig) -> None:
    """Refuse, in one line, a multimodal config whose text_config names another family:
    transformers builds the multimodal class's own text model of it all the same, and the
    engine, which picks its family by model type, would run it as that other family's."""
    expected = type(config).sub_configs["text_config"].model_type
    found = getattr(config.text_config, "model_type", None)
    if found != expected:
        raise ValueError(
            f"{config.name_or_path or 'the model'}: config.json is a {config.model_type} "
            f"model whose text_config says model_type {found!r}, where a {config.model_type} "
            f"checkpoint's language model is {expected!r}: the config is damaged or of "
            "another model; download or copy the model again"
        )


@dataclass(frozen=True)
class MultimodalOrigin:
    """What an export of the text model needs to write its multimodal checkpoint back."""

    directory: Path
    config: PretrainedConfig  # the checkpoint's own (multimodal) config
    architecture: str  # its transformers class, as config.json names it
    language_prefix: str  # where the multimodal model holds the text model's body
    body_prefix: str  # where the text model holds it
    stored: dict[str, str]  # each text-model parameter -> its key in the checkpoint
    left_alone: tuple[str, ...]  # the checkpoint's keys outside the language model

    def canonical(self, name: str) -> str:
        """A text-model module or parameter name as the multimodal model names it (what
        peft finds on the multimodal base)."""
        body = self.body_prefix + "."
        return self.language_prefix + "." + name[len(body) :] if name.startswith(body) else name

    def exported(self, name: str) -> str:
        """The key the export writes a text-model parameter under: the checkpoint's own."""
        return self.stored.get(name, name)


# How the multimodal model names its text model's modules, which the text model that trains
# names without (an exported adapter_config.json lists them so, for peft on the multimodal base).
MULTIMODAL_NAMES = ("model.language_model.", "language_model.")


def checked_trained_config(
    config: PretrainedConfig, targets: tuple[str, ...] | None
) -> PretrainedConfig:
    """The config of the model that trains (a multimodal checkpoint's text model), its
    family supported and its config sane, and LoRA ``targets`` named as that model names
    its modules: what a training run and the exported step check before reading weights."""
    trained = trained_config(config)
    check_supported(trained.model_type).check_config(trained)
    if is_multimodal(config):
        check_multimodal_targets(targets)
    return trained


def check_multimodal_targets(targets: tuple[str, ...] | None) -> None:
    """Refuse, in one line before anything is built, LoRA targets named as in the
    multimodal model, which the text model that trains does not hold (peft's own refusal
    says only that they were not found). A prefix needs nothing of the kind: peft sizes
    its table from the multimodal config's text config, the text model's own."""
    multimodal = [t for t in targets or () if t.startswith(MULTIMODAL_NAMES)]
    if multimodal:
        first = multimodal[0]
        inner = first.removeprefix("model.").removeprefix("language_model.")
        raise ValueError(
            f"--lora-targets {first}: the multimodal model's name of a text-model module; "
            f"name it as the text model that trains does ({inner}, or a suffix such as "
            f"{inner.rsplit('.', 1)[-1]}): the export names it as the multimodal model does"
        )


def origin_of(model: nn.Module) -> MultimodalOrigin | None:
    """The multimodal checkpoint ``model`` (a text model) was built from, or None."""
    origin = getattr(model, ORIGIN_ATTRIBUTE, None)
    return origin if isinstance(origin, MultimodalOrigin) else None


def checkpoint_model(
    source: Path, config: PretrainedConfig, dtype: torch.dtype
) -> tuple[nn.Module, WeightSource]:
    """(skeleton, weight source) of the model in folder ``source`` (whose config is
    ``config``): a multimodal checkpoint's text model, reading only its tensors."""
    weights = open_checkpoint(source)
    if not is_multimodal(config):
        model = skeleton(config, dtype)
        if isinstance(weights, HeaderChecked):
            weights.convert_keys(model)  # a mixture's experts, stored one expert a key
        return model, weights
    model = skeleton(trained_config(config), dtype)
    if not isinstance(weights, HeaderChecked):
        raise TypeError(f"{source}: a multimodal checkpoint's keys are read from its files")
    origin, shapes = _origin(source, config, model, weights.files)
    weights.language_model(origin.stored, set(origin.left_alone))
    # the vision tower and projector, which only the export reads: checked now, not after
    # training (transformers refuses to load tensors whose shapes disagree with config.json)
    weights.check_stored(shapes)
    setattr(model, ORIGIN_ATTRIBUTE, origin)
    return model, weights


def _origin(
    source: Path, config: PretrainedConfig, text_model: Any, keys: dict[str, str]
) -> tuple[MultimodalOrigin, dict[str, tuple[int, ...]]]:
    """Each checkpoint key's place: renamed by transformers' own mapping (as
    ``from_pretrained`` loads it) onto the multimodal model, then the text model's; with
    the shape the multimodal model built from ``config`` has for each key left alone."""
    from accelerate import init_empty_weights
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    with init_empty_weights():
        multimodal: Any = AutoModelForImageTextToText.from_config(config)
    names = multimodal.state_dict()  # transformers reads it as a mapping
    mapping = get_model_conversion_mapping(multimodal)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    prefix = multimodal.base_model_prefix
    language_prefix = _module_name(multimodal, multimodal.get_decoder())
    body_prefix = _module_name(text_model, text_model.get_decoder())
    body = body_prefix + "."
    canonical_of_text = {
        language_prefix + "." + n[len(body) :] if n.startswith(body) else n: n
        for n in text_model.state_dict()
    }
    stored: dict[str, str] = {}
    left_alone: dict[str, tuple[int, ...]] = {}
    for key in keys:
        name, _ = rename_source_key(key, renamings, converters, prefix, names)
        if name not in names and key in names:  # as transformers: a key already in place
            name = key
        if name in canonical_of_text:
            stored[canonical_of_text[name]] = key
        elif name in names and not name.startswith(language_prefix + "."):
            left_alone[key] = tuple(names[name].shape)  # the vision tower, the projector
    architecture = type(multimodal).__name__
    origin = MultimodalOrigin(
        source, config, architecture, language_prefix, body_prefix, stored, tuple(left_alone)
    )
    return origin, left_alone


def _module_name(model: nn.Module, module: nn.Module) -> str:
    """``module``'s name inside ``model``."""
    return next(name for name, m in model.named_modules() if m is module)
