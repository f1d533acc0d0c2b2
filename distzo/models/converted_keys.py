"""Checkpoint tensors that transformers renames or converts as it loads them, matched to the
model's parameters by transformers' own conversion mapping.

A mixture of experts holds each layer's experts as fused 3-D parameters
(``mlp.experts.gate_up_proj``: experts x 2 widths x hidden), while its checkpoints store
them one expert a key (``mlp.experts.3.gate_proj.weight``): the hub's, and what
``save_pretrained`` writes, since it converts back. Mixtral's also name the block
``block_sparse_moe``. A streamed read asks for a parameter by name, so here each such
parameter is given the keys it is made of and is built, when read, by the mapping's own
operations (stacking the experts, concatenating gate and up): the same tensor
``from_pretrained`` loads. A checkpoint whose keys are already the parameters' names (the
fused form) needs none of this."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel


@dataclass(frozen=True)
class Converted:
    """One parameter made of several checkpoint tensors (``parts``: each source pattern of
    the converter, in its order, and its keys in the experts' order)."""

    converter: Any  # transformers' WeightConverter
    parts: dict[str, list[str]]

    def keys(self) -> list[str]:
        return [key for keys in self.parts.values() for key in keys]

    def build(self, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The parameter from its parts, each ``read(key)`` (meta tensors give its shape)."""
        tensors: dict[str, Any] = {p: [read(k) for k in keys] for p, keys in self.parts.items()}
        for operation in self.converter.operations:
            tensors = operation.convert(
                tensors,
                source_patterns=self.converter.source_patterns,
                target_patterns=self.converter.target_patterns,
            )
        (tensor,) = tensors.values()
        return tensor


@dataclass(frozen=True)
class KeyConversions:
    """How a checkpoint's keys map onto a model's parameters where they differ."""

    renamed: dict[str, str]  # parameter name -> the one key it is stored under
    converted: dict[str, Converted]  # parameter name -> the keys it is built from

    def part_keys(self) -> set[str]:
        return {key for c in self.converted.values() for key in c.keys()}


def key_conversions(model: PreTrainedModel, keys: Collection[str]) -> KeyConversions:
    """Each of ``keys`` (a checkpoint's) that transformers would load under another name, or
    convert, into ``model`` (a skeleton): found by its own mapping for the model's type,
    keys sorted as it sorts them (layer 2 before layer 10), so experts stack in order."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    names = model.state_dict()  # transformers reads it as a mapping
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    prefix = model.base_model_prefix
    renamed: dict[str, str] = {}
    collected: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    for key in sorted(keys, key=dot_natural_key):
        if key in names:  # as transformers: a key already in place loads as it is
            continue
        for converter in converters:
            name, pattern = rename_source_key(key, renamings, [converter], prefix, names)
            if pattern is not None and name in names:
                parts = collected.setdefault(name, (converter, {}))[1]
                parts.setdefault(pattern, []).append(key)
                break
        else:
            name, _ = rename_source_key(key, renamings, [], prefix, names)
            if name != key and name in names:
                renamed[name] = key
    converted = {
        name: Converted(converter, {p: parts[p] for p in converter.source_patterns if p in parts})
        for name, (converter, parts) in collected.items()
    }
    return KeyConversions(renamed, converted)
