"""The trained model as a Hugging Face directory, written one block at a time.

``save_pretrained`` wants the whole state dict in memory: for a model that lives in
host memory only as rank-owned slices (and may be several times the size of any one
rank's share), that is the model twice. Here the engine streams its parameters bucket
by bucket, rank 0 collects them into Hugging Face's own shard plan
(``split_torch_state_dict_into_shards``, computed from shapes alone) and writes each
safetensors shard as soon as its last tensor arrives, so the peak is about one shard
plus one block. The tensors are under the keys ``save_pretrained`` writes (a mixture's
experts one a key, ``original_format``). The directory is the format ``from_pretrained``
reads: config, generation config, ``model.safetensors`` or
``model-XXXXX-of-YYYYY.safetensors`` with ``model.safetensors.index.json``, and the
tokenizer when one is given. It is written under ``<name>.tmp`` and renamed when complete.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedModel

from distzo.adapters.peft_adapters import (
    ADAPTER_NAME,
    PEFT_PREFIX,
    as_peft_model,
    base_name,
    check_mergeable,
    is_adapter_name,
    prefix_embedding,
    prefix_table,
)
from distzo.config.job import DEFAULT_MAX_SHARD_SIZE
from distzo.dist.collectives import world_rank
from distzo.engine import ZOEngine
from distzo.export.multimodal import (
    copy_processor_files,
    multimodal_adapter,
    multimodal_shapes,
    multimodal_tensors,
)
from distzo.export.original_format import original_keys, original_tensors
from distzo.export.out_dir import check_replaceable, publish, staging_dir
from distzo.models.multimodal import origin_of
from distzo.offload.bucket import BucketLayout
from distzo.runtime.argument_values import check_flag
from distzo.runtime.safetensors_write import safetensors_write

logger = logging.getLogger(__name__)

WEIGHTS_PATTERN = "model{suffix}.safetensors"  # transformers' SAFE_WEIGHTS_NAME, sharded
INDEX_NAME = "model.safetensors.index.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's SAFETENSORS_WEIGHTS_NAME


def _is_rank0() -> bool:
    return world_rank()[0] == 0


def check_shard_size(size: int | str, name: str = "--export-shard-size") -> None:
    """A one-line error, before any work, for a size Hugging Face's shard planner cannot read,
    or one of no bytes (which it takes as a shard per tensor); ``name`` is how the caller
    gave it (the flag, or ``export_hf``'s ``max_shard_size``)."""
    probes = {key: torch.empty(1, device="meta") for key in ("a", "b")}  # 4 bytes each
    try:
        if str(size).strip().startswith("-"):
            raise ValueError(size)
        if split_torch_state_dict_into_shards(probes, max_shard_size=size).is_sharded:
            raise ValueError(size)  # under 8 bytes: 0GB, the smallest a unit can write but 0
    except (ValueError, TypeError):
        raise ValueError(f"{name} {size!r} is not a size; write e.g. 5GB or 500MB") from None


def check_tokenizer(tokenizer: object) -> None:
    """A tokenizer is written beside the model by its own ``save_pretrained``; anything else
    (a hub name) is refused before the shards are written, not after them."""
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise TypeError(
            "tokenizer must be a transformers tokenizer (its save_pretrained writes it), got a "
            f"{type(tokenizer).__name__}: load it with AutoTokenizer.from_pretrained(...)"
        )


def _shapes(engine: ZOEngine, merged: bool) -> dict[str, torch.Tensor]:
    """Meta tensors of what the export holds, by name: the trained parameters, or for a
    merged adapter the base model's own parameters (adapter folded in)."""
    base = [engine.resident_base_layout, *engine.base_layouts] if merged else []
    shapes = export_shapes([engine.resident_layout, *engine.block_layouts, *base], merged)
    origin = origin_of(engine.model)
    return shapes if origin is None else multimodal_shapes(origin, shapes)


def export_shapes(layouts: list[BucketLayout], merged: bool) -> dict[str, torch.Tensor]:
    """Meta tensors of the parameters of ``layouts`` as an export names them (``merged``:
    the adapter's own left out, the base's under their original names); the memory plan
    sizes the export's largest shard from them."""
    shapes = {}
    for layout in layouts:
        for e in layout.entries:
            if merged and is_adapter_name(e.names[0]):
                continue
            name = base_name(e.names[0]) if merged else e.names[0]
            shapes[name] = torch.empty(e.shape, dtype=layout.dtype, device="meta")
    return shapes


def shard_plan(shapes: dict[str, torch.Tensor], max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE):
    """Hugging Face's split of the model's tensors into files, from shapes alone."""
    return split_torch_state_dict_into_shards(
        shapes, filename_pattern=WEIGHTS_PATTERN, max_shard_size=max_shard_size
    )


def export_model(
    engine: ZOEngine,
    directory: Path,
    tokenizer=None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    merge_adapter: bool = False,
    overwrite: bool = False,
) -> Path | None:
    """The run's ``export/``: the model in the Hugging Face format, or for an adapter run
    the peft adapter (``merge_adapter``: the base with the adapter merged in, a plain
    model). An existing ``directory`` with files in it is replaced only with ``overwrite``.
    Collective: call on every rank; returns the directory on rank 0."""
    check_replaceable(Path(directory), overwrite)
    check_flag(merge_adapter, "merge_adapter", "True writes the base with the adapter merged in")
    if merge_adapter and engine.peft_model is None:
        raise ValueError(
            "merge_adapter=True merges a peft adapter into its base, and this engine's model "
            "has none: export it with merge_adapter=False"
        )
    if engine.peft_model is None:  # a plain model, some of it perhaps frozen: every parameter
        return export_hf(
            engine, directory, tokenizer, max_shard_size, merged=engine.frozen_base, overwrite=True
        )
    if merge_adapter and engine.prefixes:
        raise ValueError(
            "a prefix cannot be merged into the weights; export the peft adapter "
            "(merge_adapter=False)"
        )
    if merge_adapter:
        check_mergeable(engine.peft_model)
        return export_hf(engine, directory, tokenizer, max_shard_size, merged=True, overwrite=True)
    return export_adapter(engine, directory, tokenizer, overwrite=True)


def _merged_parameters(engine: ZOEngine, materialize: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The base's parameters with each LoRA delta ``scaling * B @ A`` added, as peft's
    ``merge_and_unload`` computes it, block by block."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.utils import transpose

    def lora_linear(module: nn.Module) -> LoraLinear:
        if not isinstance(module, LoraLinear):
            raise ValueError(
                f"a LoRA {type(module).__name__} does not merge: only LoRA on linear layers does"
            )
        return module

    canonical = _canonical(engine)
    for values in engine.stream_buckets(materialize):
        for name, value in values.items():
            if is_adapter_name(name) or name not in canonical:
                continue
            if ".base_layer." in name:
                module_name = name[: name.index(".base_layer.")]
                module = lora_linear(engine.model.get_submodule(module_name))
                if name.endswith(".weight") and ADAPTER_NAME in module.lora_A:
                    a = values[f"{module_name}.lora_A.{ADAPTER_NAME}.weight"]
                    b = values[f"{module_name}.lora_B.{ADAPTER_NAME}.weight"]
                    delta = transpose(b @ a, module.fan_in_fan_out) * module.scaling[ADAPTER_NAME]
                    value = value + delta.to(value.dtype)
            yield base_name(name), value


def _canonical(engine: ZOEngine) -> set[str]:
    layouts = [
        engine.resident_layout,
        *engine.block_layouts,
        engine.resident_base_layout,
        *engine.base_layouts,
    ]
    return {e.names[0] for layout in layouts for e in layout.entries}


def export_hf(
    engine: ZOEngine,
    directory: Path,
    tokenizer=None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    merged: bool = False,
    overwrite: bool = False,
) -> Path | None:
    """Write the flushed model to ``directory`` in the Hugging Face format; returns it on
    rank 0 (None elsewhere). Collective: call on every rank. ``merged``: an adapter run's
    base with the adapter merged in. An existing ``directory`` with files in it is replaced
    only with ``overwrite``."""
    directory = Path(directory)
    check_replaceable(directory, overwrite)
    check_flag(merged, "merged", "True writes an adapter run's base with the adapter merged in")
    check_shard_size(max_shard_size, "max_shard_size")
    check_tokenizer(tokenizer)
    if merged and not engine.frozen_base:
        raise ValueError(
            "merged=True folds an adapter into its frozen base, and this engine trains every "
            "parameter (no adapter, no frozen base): export it with merged=False"
        )
    rank0 = _is_rank0()
    shapes = _shapes(engine, merged)
    plan = shard_plan(shapes, max_shard_size)
    file_of = {name: file for file, names in plan.filename_to_tensors.items() for name in names}
    missing = {file: set(names) for file, names in plan.filename_to_tensors.items()}
    tmp = staging_dir(directory)
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)

    collected: dict[str, dict[str, torch.Tensor]] = {}
    tensors = (
        _merged_parameters(engine, rank0) if merged else engine.stream_parameters(materialize=rank0)
    )
    origin = origin_of(engine.model)
    if origin is not None:  # the text model's tensors under the checkpoint's keys, and the rest
        tensors = multimodal_tensors(origin, tensors, rank0)
    with _removed_on_failure(tmp, rank0):
        for name, value in tensors:
            file = file_of[name]
            # under the keys save_pretrained writes (a mixture's experts one a key)
            collected.setdefault(file, {}).update(original_tensors(engine.model, name, value))
            missing[file].discard(name)
            if not missing[file]:
                with safetensors_write(tmp / file):
                    save_file(collected.pop(file), str(tmp / file), metadata={"format": "pt"})
                logger.info("export: wrote %s", file)
        if not rank0:
            return None
        assert not collected, f"shards left unwritten: {sorted(collected)}"

        if plan.is_sharded:
            total = sum(t.numel() for t in shapes.values())  # a merge leaves the adapter out
            keys = original_keys(engine.model, shapes)
            weight_map = {key: file_of[name] for name in shapes for key in keys[name]}
            index = {
                "metadata": {**plan.metadata, "total_parameters": total},
                "weight_map": weight_map,
            }
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        _write_configs(engine, tmp, tokenizer)
        return publish(tmp, directory)


@contextlib.contextmanager
def _removed_on_failure(tmp: Path, owner: bool) -> Iterator[None]:
    """A failed write (a full disk, a path that turned unwritable, any error on the way)
    leaves no ``<name>.tmp`` behind: the half-written export is of no use, and its bytes
    may be what the disk lacks."""
    try:
        yield
    except Exception:
        if owner:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_adapter(
    engine: ZOEngine, directory: Path, tokenizer=None, overwrite: bool = False
) -> Path | None:
    """Write the flushed adapter in peft's format (``adapter_config.json`` and
    ``adapter_model.safetensors``), which ``peft.PeftModel.from_pretrained`` loads onto
    the base model (an existing ``directory`` with files in it replaced only with
    ``overwrite``). Collective: call on every rank; returns the directory on rank 0."""
    directory = Path(directory)
    if engine.peft_model is None:
        raise ValueError(
            "export_adapter writes a peft adapter, and this engine's model has none: export "
            "the model with export_model, or attach an adapter before building the engine"
        )
    check_replaceable(directory, overwrite)
    check_tokenizer(tokenizer)
    rank0 = _is_rank0()
    values = dict(engine.stream_parameters(materialize=rank0))
    # A frozen lora_A (lora-fa) is part of the adapter too; it rests with the base.
    values.update(
        (n, v)
        for n, v in engine.stream_parameters(materialize=rank0, frozen=True)
        if is_adapter_name(n)
    )
    if not rank0:
        return None
    peft_model = as_peft_model(engine.peft_model)
    tmp = staging_dir(directory)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with _removed_on_failure(tmp, True):
        return _write_adapter(engine, values, peft_model, tmp, directory, tokenizer)


def _write_adapter(engine, values, peft_model, tmp: Path, directory: Path, tokenizer) -> Path:
    """The adapter's files into ``tmp``, then published as ``directory``."""
    from peft.utils import get_peft_model_state_dict

    # peft reads a prefix from its own table: the blocks' prefixes go back into it
    if engine.prefixes:
        names = [
            next(e.names[0] for e in layout.entries if is_adapter_name(e.names[0]))
            for layout in engine.block_layouts
        ]
        table = prefix_embedding(peft_model).weight
        table.data = prefix_table([values[n] for n in names]).to(table.dtype)
        state = get_peft_model_state_dict(peft_model, adapter_name=ADAPTER_NAME)
    else:
        state = get_peft_model_state_dict(
            peft_model,
            {PEFT_PREFIX + n: v for n, v in values.items()},
            adapter_name=ADAPTER_NAME,
        )
    config = peft_model.peft_config[ADAPTER_NAME]
    origin = origin_of(engine.model)
    if origin is not None and not engine.prefixes:  # LoRA: named as on the multimodal base
        state, config = multimodal_adapter(origin, state, config)
    with safetensors_write(tmp / ADAPTER_WEIGHTS):
        save_file(
            {k: v.contiguous() for k, v in state.items()},
            str(tmp / ADAPTER_WEIGHTS),
            metadata={"format": "pt"},
        )
    config.save_pretrained(str(tmp))
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    return publish(tmp, directory)


def _write_configs(engine: ZOEngine, directory: Path, tokenizer) -> None:
    model = engine.model
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"a Hugging Face export needs a transformers model, not a {type(model).__name__}"
        )
    origin = origin_of(model)
    # the live model's config stays as it is; a multimodal checkpoint's text model is
    # written back as the multimodal model
    config = copy.deepcopy(model.config if origin is None else origin.config)
    config.dtype = str(engine.resident_layout.dtype).removeprefix("torch.")
    config.architectures = [type(model).__name__ if origin is None else origin.architecture]
    config.save_pretrained(directory)
    if model.can_generate():
        model.generation_config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    if origin is not None:
        copy_processor_files(origin, directory)
