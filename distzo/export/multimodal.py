"""The export of a multimodal checkpoint's text model (``distzo.models.multimodal``) as the
multimodal model it came from: the trained text weights under the checkpoint's own keys,
the vision tower and projector copied from the checkpoint as they are stored (dtype and
bits), so that transformers loads the export as the checkpoint's own class; an adapter
named as peft finds its modules on the multimodal base."""

from __future__ import annotations

import copy
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from distzo.adapters.peft_adapters import PEFT_PREFIX
from distzo.models.multimodal import MultimodalOrigin
from distzo.models.weights import HeaderChecked, open_checkpoint

# What a multimodal checkpoint holds for its processor beside the tokenizer's files: the
# image processor's settings, the processor's and its chat template.
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "chat_template.json",
    "chat_template.jinja",
)


def _source(origin: MultimodalOrigin) -> HeaderChecked:
    """The checkpoint the text model was read from, to copy the rest of it: where it is
    no longer there (moved or deleted during a run of hours), one line saying so and how
    to write the export still, not the bare "holds no model" of a folder that is gone."""
    try:
        source = open_checkpoint(origin.directory)
    except ValueError as err:
        raise ValueError(
            f"the export copies the vision tower and projector from {origin.directory}, "
            f"which no longer holds the checkpoint ({err}): put it back there and resume "
            "the run (--resume) to write the export"
        ) from None
    assert isinstance(source, HeaderChecked)  # checkpoint_model read its keys from files
    return source


def multimodal_shapes(
    origin: MultimodalOrigin, shapes: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The export's tensors by key (meta): the text model's renamed, and the left-alone
    ones in their stored shape and dtype (from the files' headers)."""
    out = {origin.exported(name): value for name, value in shapes.items()}
    source = _source(origin)
    for key in origin.left_alone:
        out[key] = source.stored_meta(key)
    return out


def multimodal_tensors(
    origin: MultimodalOrigin, tensors: Iterator[tuple[str, torch.Tensor]], materialize: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` (the text model's) under the checkpoint's keys, then, where this rank
    writes (``materialize``), the checkpoint's other tensors as they are stored."""
    for name, value in tensors:
        yield origin.exported(name), value
    if materialize:
        source = _source(origin)
        for key in origin.left_alone:
            yield key, source.stored_tensor(key)


def multimodal_adapter(
    origin: MultimodalOrigin, state: dict[str, torch.Tensor], config: Any
) -> tuple[dict[str, torch.Tensor], Any]:
    """A LoRA adapter's state and config as on the multimodal base: its keys renamed, and
    its targets the exact modules it adapts (a name such as ``q_proj`` would match the
    vision tower's projections too)."""
    renamed = {_canonical(origin, key): value for key, value in state.items()}
    config = copy.deepcopy(config)
    config.target_modules = sorted(
        {key[len(PEFT_PREFIX) :].partition(".lora_")[0] for key in renamed if ".lora_" in key}
    )
    return renamed, config


def _canonical(origin: MultimodalOrigin, key: str) -> str:
    if not key.startswith(PEFT_PREFIX):
        return key
    return PEFT_PREFIX + origin.canonical(key[len(PEFT_PREFIX) :])


def copy_processor_files(origin: MultimodalOrigin, directory: Path) -> None:
    """The checkpoint's processor files the export's tokenizer did not write: with them,
    ``AutoProcessor`` loads the export as it loaded the checkpoint, and the fine-tuned
    model takes images as the original did."""
    for name in PROCESSOR_FILES:
        source = origin.directory / name
        if source.is_file() and not (directory / name).exists():
            shutil.copyfile(source, directory / name)
