"""The model a run trains: its weights' source, its tokenizer, the default model's initial
weights saved as ``base/`` (which a replay starts from), and its adapter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from distzo.adapters.peft_adapters import (
    AdapterWeights,
    attach_adapter,
    check_mergeable,
    name_base_revision,
)
from distzo.config.job import JobConfig
from distzo.dist import Collectives, LaunchEnv
from distzo.dist.agreement import agreed
from distzo.job.build import build_model, load_tokenizer, model_source
from distzo.job.progress import no_library_bars
from distzo.job.same_job import check_same_model
from distzo.job.seed_log import resumed_base_revision
from distzo.models import hub
from distzo.models.weights import WeightSource
from distzo.runtime.safetensors_write import safetensors_write


def run_model(
    job: JobConfig, seed: int, env: LaunchEnv, comm: Collectives, run_dir: Path
) -> tuple[nn.Module, WeightSource | None, Any, str | None]:
    """The model (with its adapter), its weight source, its tokenizer and, for a hub name,
    the commit its snapshot is (a resumed run's: the one its seed log records, not the
    cache's newer ``main``); a random-init model's initial weights saved as
    ``run_dir/base``, by rank 0 of a fresh run. The same model folder on every node, and
    a refusal on one rank (a checkpoint that disagrees with its config.json, rank 0's
    write of ``base/``) ends every rank with its line, not the others in their next
    collective, after a wait, with no word of the cause."""
    revision = resumed_base_revision(run_dir, job.run.resume)  # the commit its log records
    source = model_source(job.model.model, env, comm, revision)
    if job.model.model and source is not None:
        check_same_model(job.model.model, source, comm, env)
    revision = hub_commit(job.model.model, source)
    model, weights, tokenizer = agreed(
        comm, lambda: _built(job, seed, env, source, run_dir, revision)
    )
    return model, weights, tokenizer, revision


def hub_commit(name: str | None, source: Path | None) -> str | None:
    """The commit a hub name's snapshot is; None for a folder given by its path (named by
    that path) or a random-init model."""
    if not name or source is None or hub.local_model_dir(name) is not None:
        return None
    return hub.snapshot_commit(source)


def _built(
    job: JobConfig,
    seed: int,
    env: LaunchEnv,
    source: Path | None,
    run_dir: Path,
    revision: str | None,
) -> tuple[nn.Module, WeightSource | None, Any]:
    """``run_model``'s model, built on this rank alone (no collective)."""
    torch.manual_seed(seed)  # the random init of the default model: equal everywhere
    tokenizer = load_tokenizer(job, source)
    model, weights = build_model(job, seed, source)
    if weights is None and not job.model.model:  # the default model, built whole
        assert isinstance(model, PreTrainedModel)
        if env.rank == 0 and job.run.resume == "no":
            with no_library_bars(), safetensors_write(run_dir / "base"):
                model.save_pretrained(run_dir / "base")
            if tokenizer is not None:
                tokenizer.save_pretrained(run_dir / "base")
        # what an exported adapter names as its base (peft reads it when attaching)
        model.name_or_path = str((run_dir / "base").absolute())
    elif job.model.model and isinstance(model, PreTrainedModel):
        # not the folder it streams from: a relative path, a hub cache
        model.name_or_path = hub.base_reference(job.model.model)
    spec = job.peft.adapter_spec()
    if spec.enabled:  # the same adapter init on every rank, on resume and in a replay
        model = attach_adapter(model, spec, seed)
        name_base_revision(model, revision)  # an exported adapter loads the same base
        if job.peft.merge_adapter:  # refused now, not after training
            check_mergeable(model)
        weights = AdapterWeights(weights, model) if weights is not None else None
    return model, weights, tokenizer
