"""The records a run writes, each built here from the part that knows its numbers: a
step's metrics (``StepMeter``), its seed-log entry and the log's header, the rank's
summary (``rankN.json``), and the one-line description of an evaluation."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from distzo.adapters.peft_adapters import AdapterSpec
from distzo.config.engine_options import ZOConfig, lowrank_record, optimizer_record
from distzo.config.job import JobConfig
from distzo.dist import ParallelContext
from distzo.engine import StepResult, ZOEngine
from distzo.job.build import shape_reads_bytes
from distzo.models import hub
from distzo.models.shapes import signature
from distzo.runtime.devices import device_name
from distzo.runtime.host_memory import peak_rss_bytes, rss_bytes
from distzo.zo import noise_identity


class StepMeter:
    """Times each step and builds its metrics record (a line of metrics.jsonl, the
    dashboard's scalars): throughput, the host link's rate, host and device memory."""

    def __init__(self, objective: str, link_bytes: int, device: torch.device) -> None:
        self.objective = objective
        self.link_bytes = link_bytes  # what one step moves over the host link (the layout's)
        self.device = device
        self.tokens = 0  # input tokens of every step metered
        self.tokens_per_s = 0.0  # the last step's
        self._started = time.perf_counter()

    def start(self) -> None:
        self._started = time.perf_counter()

    def record(self, step: int, result: StepResult, tokens: int) -> dict[str, Any]:
        """The metrics of the step just taken, ``tokens`` the global batch's."""
        seconds = max(time.perf_counter() - self._started, 1e-9)
        self.tokens += tokens
        self.tokens_per_s = tokens / seconds
        rss = rss_bytes()
        record: dict[str, Any] = {
            "step": step,
            "objective": self.objective,
            "loss": result.loss,
            "loss_plus": result.loss_plus,
            "loss_minus": result.loss_minus,
            "projected_grad": result.projected_grad,
            "lr": result.lr,
            "tokens_per_s": self.tokens_per_s,
            "step_s": seconds,  # the step's wall time: what time-to-accuracy adds up
            "link_gb_per_s": self.link_bytes
            / seconds
            / 1e9,  # uploaded by rank 0 (offloaded alike)
            "host_rss_gb": rss / 1e9 if rss is not None else None,
            "host_peak_rss_gb": peak_rss_bytes() / 1e9,
        }
        if self.device.type == "cuda":
            record["peak_device_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9
        if len(result.projected_grads) > 1:
            record["projected_grads"] = list(result.projected_grads)
        return record


def seed_record(step: int, result: StepResult, run_seed: int) -> dict[str, Any]:
    """A step's line of the seed log: what a replay or a catch-up applies."""
    return {
        "step": step,
        "run_seed": run_seed,
        "projected_grads": list(result.projected_grads),
        "lr": result.lr,
    }


def run_header(
    job: JobConfig,
    config: ZOConfig,
    run_seed: int,
    init_seed: int,
    objective: str,
    device: torch.device,
    run_dir: Path,
    model_config: PretrainedConfig | None = None,
    train_rows: str | None = None,
    base_revision: str | None = None,
    data_commits: dict[str, Any] | None = None,
    eval_rows: str | None = None,
) -> dict[str, Any]:
    """The seed log's header: what a replay rebuilds the run from, and what a resumed run
    must share with it (``seed_log.TRAJECTORY_FIELDS``; ``train_rows``, the digest of the
    rows the steps draw from, is checked before any model: ``resume.check_resumed_rows``;
    it and ``eval_rows``, the evaluation rows', let a resume read a data file that moved:
    ``moved_data``)."""
    model = job.model
    spec: AdapterSpec = job.peft.adapter_spec()
    return {
        "run_seed": run_seed,
        "noise_chunk": config.noise_chunk,
        "noise": noise_identity(config.noise),
        "lowrank": lowrank_record(config),
        "weight_decay": config.weight_decay,
        "device_type": device.type,
        "dtype": model.dtype,
        "transfer_dtype": config.transfer_dtype,
        # a prefix initialised from real activations takes them in this dtype
        "compute_dtype": config.compute_dtype,
        "base": None if model.model_config else _base(model.model, run_dir),
        # a hub base's commit: a resume and a replay read it, not the cache's newer main
        "base_revision": base_revision,
        "model_config": model.model_config,
        "model_layers": model.model_layers,
        "byte_tokenizer": shape_reads_bytes(job),
        "init_seed": init_seed,
        "objective": objective,
        "peft": spec.record() if spec.enabled else None,
        # how a replay writes its export (a resume's change: the run's config.toml)
        "merge_adapter": job.peft.merge_adapter,
        "export_shard_size": job.run.export_shard_size,
        "optimizer": optimizer_record(config),
        "estimator": config.estimator,
        "train_rows": train_rows,  # None: generated data
        "eval_rows": eval_rows,
        # each hf: source's commit: a resume reads it, not the hub's newer main
        "data_commits": data_commits,
        # what a replay checks its --base against (None: a caller without the model's config)
        **({"model": signature(model_config)} if model_config is not None else {}),
    }


def _base(name: str | None, run_dir: Path) -> str | None:
    """The base a replay starts from: a hub name as given, a local folder (or the run's own
    ``base/``) as an absolute path, so the log replays from any working directory."""
    if name is None:
        return str((run_dir / "base").absolute())
    return hub.base_reference(name)


def rank_summary(
    engine: ZOEngine,
    parallel: ParallelContext,
    device: torch.device,
    peft: str,
    before: dict[str, float] | None,
    after: dict[str, float],
) -> dict[str, Any]:
    """``rankN.json``: where this rank sat in the mesh, how it moved blocks and drew noise,
    its memory, and the evaluations before and after."""
    rank = parallel.env.rank
    return {
        "rank": rank,
        "device": device_name(device),
        "transfer": engine.transfer,
        "noise": noise_identity(engine.config.noise),
        "noise_backend": engine.noise.backend,
        "shard_group": parallel.shard_group.members if parallel.shard_group else [rank],
        "mesh_coordinates": [parallel.dp_rank, parallel.pert_rank],
        "formula_coordinates": list(parallel.dims.coordinates(rank)),
        "host_bytes": engine.host_bytes,
        "device_bytes": engine.device_bytes,
        "peft": peft,
        "trained_parameters": engine.num_parameters,
        "frozen_parameters": engine.num_frozen,
        "base_read_only": engine.frozen_base,
        "eval_before": before,
        "eval_after": after,
    }


def describe(metrics: dict[str, float]) -> str:
    """``loss 1.7585, accuracy 0.4333``: an evaluation in a log line."""
    return ", ".join(f"{metric_name(k)} {v:.4f}" for k, v in metrics.items())


def metric_name(key: str) -> str:
    """``accuracy`` of ``eval_accuracy`` or ``dev_accuracy``: what an evaluation measured."""
    return key.removeprefix("eval_").removeprefix("dev_")


def eval_split(record: Mapping[str, Any]) -> str:
    """Which rows an evaluation record scored: ``dev`` (its metrics named ``dev_...``,
    ``--num-dev``) or ``eval``."""
    return "dev" if any(key.startswith("dev_") for key in record) else "eval"
