"""``summary.json``: the run at a glance, written by rank 0 at the end. The options that
decide what was trained (the whole tree is ``config.toml``), the steps, this session's
time and tokens per second, the training loss and the first, last and best evaluation
(and dev evaluation, where --num-dev gave dev rows: then the best step is the dev rows'
choice, by the lowest loss or the task's metric, ``chosen_by``), and where the last
checkpoint, the export and the picture are.

The losses and evaluations come from metrics.jsonl and eval.jsonl, so a resumed run's
summary covers the whole run; the time and throughput are those of the session that
finished it (an interrupted session's are not recorded anywhere).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distzo.config.engine_options import ZOConfig
from distzo.config.job import JobConfig
from distzo.job.records import eval_split, metric_name
from distzo.runtime.json_text import loads

SUMMARY = "summary.json"


def key_options(
    job: JobConfig,
    config: ZOConfig,
    objective: str,
    transfer: str,
    device: str,
    world_size: int,
    data_commits: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The options a reader compares runs by, resolved (the lr a default gave, the
    transfer and the device ``auto`` chose; rank 0's device; ``data_commits``: the commit
    each ``hf:`` source was read at, by source, where ``main`` names another by now)."""
    model = job.model
    return {
        "model": model.model or model.model_config or "built-in tiny OPT",
        "model_layers": model.model_layers,
        "task": job.data.task,
        "objective": objective,
        "peft": job.peft.peft,
        "max_steps": job.optim.max_steps,
        "batch_size": job.data.batch_size,
        "lr": config.lr,
        "lr_schedule": config.lr_schedule,
        "eps": config.eps,
        "optimizer": config.optimizer,
        "estimator": config.estimator,
        "num_queries": config.num_queries,
        "mode": config.mode,
        "transfer": transfer,
        "transfer_dtype": config.transfer_dtype,
        "dtype": model.dtype,
        "device": device,
        "world_size": world_size,
        "seed": job.run.seed,
        "data_commits": data_commits or {},
    }


# What the best evaluation is chosen by: the first of these metrics the first record
# holds. A causal LM's records hold the loss of its training objective (language
# modelling's, or a prompt task's ``lm`` or ``classification``): MeZO's OPT runs keep the
# step of the lowest dev loss (``--load_best_model_at_end``, no ``--metric_for_best_model``).
# A masked LM's hold none: MeZO's RoBERTa trainer (``default_dev_objective``) takes F1
# (MRPC, QQP), then MCC (CoLA), then accuracy; so does a run trained on ``accuracy`` or
# ``f1``, whose objective is minus that metric. A resumed run's first record, written
# before the loss was reported, keeps choosing by its metric.
CHOSEN_BY = ("loss", "f1", "mcc", "accuracy")


def chosen_by(record: dict[str, Any]) -> str | None:
    """The key of ``record`` the best evaluation is chosen by (``dev_mcc``, ``eval_loss``):
    read off the first record, so that a resumed run keeps choosing as it began."""
    keys = [k for k in record if k != "step"]
    by_name = {metric_name(k): k for k in keys}
    return next((by_name[n] for n in CHOSEN_BY if n in by_name), keys[0] if keys else None)


def best_eval(evals: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The best evaluation by its task's metric (``chosen_by``): the lowest loss, or the
    highest F1, MCC or accuracy; of equals, the earliest."""
    if not evals:
        return None
    key = chosen_by(evals[0])
    if key is None:
        return None
    scored = [r for r in evals if isinstance(r.get(key), (int, float))]
    pick = min if "loss" in key else max
    best = pick(scored, key=lambda r: r[key])  # the earliest among equals
    return {"by": key, **best}


def run_summary(
    options: dict[str, Any],
    steps: int,
    session: dict[str, Any],
    losses: Sequence[float],
    evals: list[dict[str, Any]],
    paths: dict[str, Path | None],
) -> dict[str, Any]:
    """The summary's record. ``steps``: the run's, all sessions; ``session``: this
    process's ``start_step``, ``steps``, ``seconds``, ``tokens_per_s``; ``losses``: the
    training loss of every step metrics.jsonl holds, in order; ``paths``: the checkpoint,
    export, curves... (absolute in the file, so it reads from anywhere)."""
    dev = [r for r in evals if eval_split(r) == "dev"]
    on_eval_rows = [r for r in evals if eval_split(r) == "eval"]
    scored = _at_a_glance(on_eval_rows)
    if dev:  # the best step is chosen on the dev rows, as MeZO does, never on the eval rows
        scored["best"] = scored_at_best_dev(on_eval_rows, best_eval(dev))
    return {
        "options": options,
        "steps": steps,
        "session": session,
        "train_loss": (
            {"first": losses[0], "last": losses[-1], "min": min(losses)} if losses else None
        ),
        "eval": scored,
        # --num-dev: the evaluations during training; "best" the step of the lowest dev
        # loss or best dev metric (``chosen_by``), the earliest among equals
        **({"dev": _at_a_glance(dev)} if dev else {}),
        **{name: str(p.absolute()) if p is not None else None for name, p in paths.items()},
    }


def scored_at_best_dev(
    evals: list[dict[str, Any]], best_dev: dict[str, Any] | None
) -> dict[str, Any] | None:
    """With dev rows, ``eval.best``: the eval rows' score of the model the dev rows chose
    (the figure MeZO reports), ``by`` the dev metric that chose it; None where the eval
    rows did not score that step (one before the run's end). The best of the eval (test)
    rows' own scores would be a figure chosen on the rows it is reported on."""
    if best_dev is None:
        return None
    record = next((r for r in evals if r["step"] == best_dev["step"]), None)
    return {"by": best_dev["by"], **record} if record is not None else None


def _at_a_glance(evals: list[dict[str, Any]]) -> dict[str, Any]:
    """The first, last and best of one split's evaluations."""
    return {
        "first": evals[0] if evals else None,
        "last": evals[-1] if evals else None,
        "best": best_eval(evals),
    }


def write_summary(path: Path, summary: dict[str, Any]) -> Path:
    """``summary`` as indented JSON at ``path``, through a temporary file and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(path)
    return path


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """The ``summary.json`` of the run in ``run_dir``, or None: none yet (the run died
    before its end, or it is being rewritten) or one that is not a JSON object."""
    try:
        summary = loads((run_dir / SUMMARY).read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None
