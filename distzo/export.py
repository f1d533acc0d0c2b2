"""The trained model as a Hugging Face directory, written one block at a time.

``save_pretrained`` wants the whole state dict in memory: for a model that lives in
host memory only as rank-owned slices (and may be several times the size of any one
rank's share), that is the model twice. Here the engine streams its parameters bucket
by bucket, rank 0 collects them into Hugging Face's own shard plan
(``split_torch_state_dict_into_shards``, computed from shapes alone) and writes each
safetensors shard as soon as its last tensor arrives, so the peak is about one shard
plus one block. The directory is the format ``from_pretrained`` reads: config,
generation config, ``model.safetensors`` or ``model-XXXXX-of-YYYYY.safetensors`` with
``model.safetensors.index.json``, and the tokenizer when one is given. It is written
under ``<name>.tmp`` and renamed when complete.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file

from distzo.dist.collectives import world_rank
from distzo.engine import ZOEngine

logger = logging.getLogger(__name__)

WEIGHTS_PATTERN = "model{suffix}.safetensors"  # transformers' SAFE_WEIGHTS_NAME, sharded
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"


def _is_rank0() -> bool:
    return world_rank()[0] == 0


def check_shard_size(size: str) -> None:
    """A one-line error, before any work, for a size Hugging Face's shard planner cannot read."""
    try:
        if size.strip().startswith("-"):
            raise ValueError(size)
        split_torch_state_dict_into_shards({"probe": torch.empty(1, device="meta")}, max_shard_size=size)
    except (ValueError, TypeError):
        raise ValueError(f"--export-shard-size {size!r} is not a size; write e.g. 5GB or 500MB") from None


def shard_plan(engine: ZOEngine, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE):
    """Hugging Face's split of the model's tensors into files, from shapes alone."""
    shapes = {}
    for layout in [engine.resident_layout, *engine.block_layouts]:
        for e in layout.entries:
            shapes[e.names[0]] = torch.empty(e.shape, dtype=layout.dtype, device="meta")
    return split_torch_state_dict_into_shards(shapes, filename_pattern=WEIGHTS_PATTERN, max_shard_size=max_shard_size)


def export_hf(
    engine: ZOEngine, directory: Path, tokenizer=None, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
) -> Path | None:
    """Write the flushed model to ``directory`` in the Hugging Face format; returns it on
    rank 0 (None elsewhere). Collective: call on every rank."""
    directory = Path(directory)
    rank0 = _is_rank0()
    plan = shard_plan(engine, max_shard_size)
    file_of = {name: file for file, names in plan.filename_to_tensors.items() for name in names}
    missing = {file: set(names) for file, names in plan.filename_to_tensors.items()}
    tmp = directory.with_name(directory.name + ".tmp")
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)

    collected: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in engine.stream_parameters(materialize=rank0):
        file = file_of[name]
        collected.setdefault(file, {})[name] = value
        missing[file].discard(name)
        if not missing[file]:
            save_file(collected.pop(file), str(tmp / file), metadata={"format": "pt"})
            logger.info("export: wrote %s", file)
    if not rank0:
        return None
    assert not collected, f"shards left unwritten: {sorted(collected)}"

    if plan.is_sharded:
        index = {"metadata": {**plan.metadata, "total_parameters": engine.num_parameters}, "weight_map": file_of}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    model = engine.model
    config = copy.deepcopy(model.config)  # the live model's config stays as it is
    config.dtype = str(engine.resident_layout.dtype).removeprefix("torch.")
    config.architectures = [type(model).__name__]
    config.save_pretrained(tmp)
    if model.can_generate():
        model.generation_config.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)
    return directory
