"""``python -m distzo.replay [--base MODEL] --log SEEDLOG --out DIR [--step N] [--overwrite]
[--[no-]merge-adapter] [--export-shard-size SIZE]``: a ZO run rebuilt from its seeds and
scalars, at its end or after its first N steps (the step a dev set chose, say), exported as
``distzo.train``'s export options (the same flags) ask.

A ZO-SGD run is fully described by its base weights and, per step, (step, g per query,
lr): z is regenerated from (run seed, step, block, query) and the element, so replaying
the updates in order gives the fine-tuned weights: bit for bit on the device type that
trained them, and on any other device along exactly the same directions (the portable
noise draws the same z everywhere; the update's arithmetic may round differently, a
fused multiply-add on a GPU, so the weights agree to float rounding). Logs from before
noise kinds carry ``legacy`` noise, whose z differs between CPU and CUDA: they replay
only on the device type that trained them. The log is kilobytes where a checkpoint is the
model's size, so it is also a cheap checkpoint between full saves. Full-tuning runs with a
low-bit transfer round stochastically on the host and cannot be replayed from the log; an
adapter run's low-bit base was rounded to nearest once, which the replay repeats.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from distzo.adapters.peft_adapters import (
    AdapterSpec,
    AdapterWeights,
    attach_adapter,
    check_mergeable,
    name_base_revision,
)
from distzo.config.cli import add_version_flag, fail, home_path, program, write_failure
from distzo.config.engine_options import ZOConfig, lowrank_options, optimizer_options
from distzo.config.inapplicable import RULES, ignored_warning
from distzo.config.job import DEFAULT_MAX_SHARD_SIZE, add_job_flag
from distzo.engine import ZOEngine
from distzo.export.hf_model import check_shard_size, export_model
from distzo.export.out_dir import check_out, staging_dir
from distzo.job.build import source_tokenizer, with_byte_tokenizer_ids
from distzo.job.replay_defaults import run_export_options
from distzo.job.run_dir import BEST_EXPORT
from distzo.job.run_end import BEST_WRITTEN, complete_export, export_record
from distzo.job.run_lock import DirectoryLocked, RunLock
from distzo.job.seed_log import (
    SEED_LOG,
    first_step,
    logged_noise,
    logged_revision,
    read_seed_log,
    step_grads,
)
from distzo.job.summary import SUMMARY, write_summary
from distzo.models import hub
from distzo.models.config_file import read_config
from distzo.models.multimodal import checkpoint_model, trained_config
from distzo.models.shapes import check_signature, shape_config, signature
from distzo.models.tiny import byte_tokenizer
from distzo.models.weights import (
    RandomWeights,
    skeleton,
    with_generation_config,
)
from distzo.objectives import Accuracy, Classification, Objective
from distzo.runtime import json_text
from distzo.runtime.master_dtypes import MASTER_DTYPES
from distzo.runtime.option_names import named_as_flags
from distzo.runtime.units import counted
from distzo.zo import drawable, identity_kind

logger = logging.getLogger("distzo.replay")


def base_folder(base: str | None, header: dict) -> Path | None:
    """The local folder of the run's base, as the run read it (a hub name's snapshot, fetched
    where the cache lacks it); None for a --model-config shape, rebuilt from its seed.
    Errors name where the base came from: ``--base`` or the log's header."""
    if base is None and header.get("model_config"):
        return None
    name = base or header.get("base")
    if not name:
        raise ValueError("the log names no base model; pass --base")
    option = "--base" if base else "the log's base"
    try:
        local = hub.local_model_dir(name, option)
        if local is not None:
            return local
        return hub.snapshot(
            name, True, logged_revision(header, "the log's header", base), option=option
        )
    except ValueError as err:
        raise ValueError(str(err) if base else f"{err}; pass --base") from None


def base_model(folder: Path | None, name: str, header: dict, dtype: torch.dtype):
    """(model, weight source) of the run's starting point, streamed: a --model-config shape
    (``folder`` None) is rebuilt from its init seed, a folder read bucket by bucket."""
    if folder is None:
        config = shape_config(header["model_config"], header.get("model_layers"))
        if header.get("byte_tokenizer"):  # the run read text through it: its special ids
            config = with_byte_tokenizer_ids(config)
        return skeleton(config, dtype), RandomWeights(header["init_seed"])
    recorded = header.get("model") or logged_base_signature(header)
    config = read_config(folder, "--base")
    check_signature(recorded, trained_config(config), name)  # before any weight is read
    config.name_or_path = hub.base_reference(name)  # as the run's adapter names its base
    model, weights = checkpoint_model(folder, config, dtype)
    return with_generation_config(model, folder), weights


def logged_base_signature(header: dict) -> dict:
    """What a log from before the header's ``model`` record says of its model: its base
    folder's config where that folder still exists; else nothing to check."""
    logged = header.get("base")
    if logged and Path(logged).is_dir() and (Path(logged) / "config.json").is_file():
        return signature(trained_config(read_config(logged, "the log's base")))
    return {}


# What every header distzo has written records (seed logs of all versions), and the replay reads.
REQUIRED_FIELDS = ("run_seed", "noise_chunk", "weight_decay", "dtype", "device_type")


def check_header(log: Path, header: dict) -> None:
    """Refuse, in one line and before any model is built, a header without the fields
    every distzo version writes (a damaged log, or one some other tool wrote)."""
    missing = [name for name in REQUIRED_FIELDS if header.get(name) is None]
    if missing:
        raise ValueError(
            f"--log {log}: its header has no {', '.join(missing)} (every distzo seed log "
            "records them); is the log damaged, or written by another tool?"
        )
    if header["dtype"] not in MASTER_DTYPES:
        raise ValueError(
            f"--log {log}: its header's dtype {header['dtype']!r} is not one of "
            f"{', '.join(MASTER_DTYPES)}; is the log damaged?"
        )


def replay_mode(transfer_dtype: str) -> str:
    """Where the replay keeps the blocks: resident, unless the run's frozen base rested in
    a low-bit format (an adapter run: its trained tensors never leave the device, but the
    base it computed with, and an export merges into, was rounded to nearest once); then
    streamed in that format, so the base is rounded as the run rounded it."""
    return "resident" if transfer_dtype == "fp32" else "offload"


def check_replayable(log: Path, header: dict, spec: AdapterSpec) -> None:
    """Refuse, before any model is built, a log whose weights are not a function of it (or
    not of every step from 0): a copied start, stochastic rounding on the host, noise this
    version does not draw."""
    check_header(log, header)
    if first_step(header):
        raise ValueError(
            f"--log {log} begins at step {first_step(header)} (its run went on from a copied "
            "checkpoint): a replay needs every step from 0; use the run's export/ instead"
        )
    transfer_dtype = header.get("transfer_dtype", "fp32")
    if transfer_dtype != "fp32" and not spec.enabled:
        raise ValueError(
            f"--log {log}: a {transfer_dtype} transfer rounds stochastically on the "
            "host, so its weights are not a function of the log; use the run's export/ instead"
        )
    if (header.get("optimizer") or {}).get("state_dtype", "fp32") != "fp32":
        raise ValueError(
            f"--log {log}: the run's {header['optimizer']['state_dtype']} optimizer state rounds "
            "stochastically on the host, so its weights are not a function of the log; use the "
            "run's export/ instead"
        )
    identity = logged_noise(header)
    if not drawable(identity):
        raise ValueError(
            f"--log {log}: the run drew {identity} noise, which this distzo does not draw; "
            "replay it with the version that wrote it"
        )


def replay_config(header: dict, device: str | None) -> ZOConfig:
    """The engine the run had, as far as its trajectory goes (lr 0: the logged steps carry
    their own), on ``device`` (the run's device type by default)."""
    transfer_dtype = header.get("transfer_dtype", "fp32")
    kind = identity_kind(logged_noise(header))
    with named_as_flags():  # the one option typed here is --device: named as the flag
        config = ZOConfig(
            lr=0.0,
            mode=replay_mode(transfer_dtype),
            transfer_dtype=transfer_dtype,
            # a prefix's init by real activations ran in it (logs from before the record: auto)
            compute_dtype=header.get("compute_dtype", "auto"),
            device=device or header["device_type"],
            weight_decay=header["weight_decay"],
            noise_chunk=header["noise_chunk"],
            seed=header["run_seed"],
            noise=kind,
            **lowrank_options(header.get("lowrank")),
            **optimizer_options(header.get("optimizer")),
        )
    if kind == "legacy" and config.torch_device().type != header["device_type"]:
        raise ValueError(
            f"the run drew legacy noise on {header['device_type']}; replay it on that device type"
        )
    return config


# The choice objectives a log may name, for the engine's check that a masked LM's objective
# scores a <mask>; any other (lm, f1: causal LMs only) is the engine's default.
CHOICE_OBJECTIVES = {"classification": Classification, "accuracy": Accuracy}


def logged_objective(header: dict) -> Objective | None:
    """The run's objective where it scored choices: a replay computes no loss, but the
    engine refuses a masked LM (RoBERTa) the default ``LanguageModeling``, and a masked
    run trained only on choices. None: the default, as for every causal run."""
    kind = CHOICE_OBJECTIVES.get(header.get("objective") or "")
    return kind() if kind is not None else None


def merged_export(spec: AdapterSpec, run_merged: bool, merge_adapter: bool | None) -> bool:
    """Whether the export merges the adapter into its base (``--merge-adapter`` or
    ``--no-merge-adapter``; None: the run's choice, ``run_merged``); refused in one line
    before the base is fetched or a step replayed where there is nothing to merge (training
    refuses it) or a prefix (the export would)."""
    if merge_adapter and not spec.enabled:
        raise ValueError(
            "--merge-adapter: the run tuned the full model, with no adapter to merge; "
            "drop --merge-adapter"
        )
    merge = run_merged if merge_adapter is None else merge_adapter
    if merge and spec.method == "prefix":
        raise ValueError(
            "--merge-adapter: the run trained a prefix, which cannot be merged into the "
            "weights; replay without --merge-adapter (the peft adapter)"
        )
    return merge and spec.enabled


def steps_up_to(log: Path, steps: list[dict], step: int | None) -> list[dict]:
    """The records of the first ``step`` steps (all with None): the model an evaluation "at
    step N" scored. A step the log has not reached is one line, before any model is built."""
    if step is None:
        return steps
    if not 0 <= step <= len(steps):
        raise ValueError(
            f"--step {step}: --log {log} holds {counted(len(steps), 'step')}; give --step 0 to "
            f"{len(steps)} (0: the base, {len(steps)}: the run's end)"
        )
    return steps[:step]


def replay(
    base: str | None,
    log: Path,
    out: Path,
    device: str | None = None,
    merge_adapter: bool | None = None,
    step: int | None = None,
    max_shard_size: str | None = None,
) -> Path | None:
    """Rebuild the run that ``log`` records onto its base, written to ``out`` as the run's
    own export is (``merge_adapter``, None: as the run's, an adapter merged into its base
    or not; the base's tokenizer beside the weights); ``step``: after that many steps
    (default: all); ``max_shard_size``: as ``distzo.train``'s ``--export-shard-size``
    (None: the run's, ``run_export_options``); returns the directory (a replay is one
    process, so rank 0's: never None there)."""
    if max_shard_size is not None:
        check_shard_size(max_shard_size)
    header, logged = read_seed_log(log)
    spec = AdapterSpec.from_record(header.get("peft"))
    check_replayable(log, header, spec)
    steps = steps_up_to(log, logged, step)
    run_options = run_export_options(log, header)
    merge = merged_export(spec, run_options["merge_adapter"], merge_adapter)
    if max_shard_size not in (None, DEFAULT_MAX_SHARD_SIZE) and spec.enabled and not merge:
        logger.warning(ignored_warning({"export_shard_size": RULES["export_shard_size"][1]}))
    shards = run_options["export_shard_size"] if max_shard_size is None else max_shard_size
    check_shard_size(shards)  # the run's: a damaged record is one line, before any model
    config = replay_config(header, device)
    folder = base_folder(base, header)
    name = base or header.get("base") or header["model_config"]
    model, weights = base_model(folder, name, header, MASTER_DTYPES[header["dtype"]])
    if spec.enabled:  # the run's adapter, initialised as the run did (seeded by the run)
        model = attach_adapter(model, spec, header["init_seed"])
        # the base the run's adapter names
        name_base_revision(model, logged_revision(header, "the log's header", base))
        weights = AdapterWeights(weights, model) if weights is not None else None
    if merge:
        check_mergeable(model)
    objective = logged_objective(header)
    engine = ZOEngine(
        model, config, run_seed=header["run_seed"], weights=weights, objective=objective
    )
    # every logged update in one pass over the blocks, in order: the run's trajectory
    engine.catch_up([(record["step"], step_grads(record), record["lr"]) for record in steps])
    logger.info("replayed %s onto %s", counted(len(steps), "step"), name)
    # the command checked --out (an existing one only with --overwrite)
    tokenizer = run_tokenizer(folder, header)
    return export_model(engine, out, tokenizer, shards, merge, overwrite=True)


BEST_LOCK_WAIT_S = 5.0  # how long export-best waits for its run directory's lock


def export_best(run_dir: Path, options: dict[str, Any], lock: RunLock | None = None) -> None:
    """MeZO's ``--load_best_model_at_end`` (``--export-best``): the model of the best dev
    step, which the run's ``summary.json`` names (``dev.best``), replayed from the run's
    seed log into ``export-best/`` (rank 0, once the run has ended and its logs are
    closed) with the run's export ``options`` (``export_options``), and named in the
    summary too. A checkpoint at every dev evaluation would be the model's size each time;
    the seed log rebuilds any step. A requeue of the finished run keeps the folder as it is
    where the summary's record of it (``BEST_WRITTEN``) says it is complete and of this
    step and these options: a replay of the whole log spared. ``lock``: the run's, held
    since it began (``distzo.train``), released here; None: taken again, so that no other
    job (a requeue) writes export-best/ beside this one."""
    try:
        if lock is None:
            lock = RunLock(run_dir)
            lock.acquire(wait_s=BEST_LOCK_WAIT_S)  # another job's start-up check: an instant
    except DirectoryLocked as taken:  # a job started while the directory was free
        raise ValueError(
            f"--export-best: another job took {run_dir} as this run ended ({taken.holder}), "
            "so export-best/ was not written; once that job ends, python -m distzo.replay "
            f"--log {run_dir / SEED_LOG} --out {run_dir / BEST_EXPORT} --step N, with N its "
            "summary.json's dev.best.step, writes it"
        ) from None
    try:
        _export_best_locked(run_dir, options)
    finally:
        lock.release()


def _export_best_locked(run_dir: Path, options: dict[str, Any]) -> None:
    """``export_best`` in the run directory this process has locked."""
    summary = json_text.loads((run_dir / SUMMARY).read_text())
    best = summary["dev"]["best"]
    assert best is not None, "a run with --num-dev evaluates its dev rows at its end"
    step, out = best["step"], Path(os.path.abspath(run_dir / BEST_EXPORT))
    written = summary.pop(BEST_WRITTEN, None)
    if (
        isinstance(written, dict)
        and written.get("step") == step
        and complete_export(out, {k: v for k, v in written.items() if k != "step"}, options)
    ):
        logger.info("best dev step %d: its export-best/ is kept as it is", step)
    else:
        # a replay killed before its rename left export-best.tmp/: the run's own (locked)
        shutil.rmtree(staging_dir(out), ignore_errors=True)
        out = check_out(out, overwrite=True)  # distzo's own folder
        if written is not None:  # the record no longer describes the folder replaced
            write_summary(run_dir / SUMMARY, summary)
        replay(
            None,
            run_dir / SEED_LOG,
            out,
            merge_adapter=options["merge_adapter"],
            step=step,
            max_shard_size=options["export_shard_size"],
        )
        logger.info(
            "best dev step %d (%s %.4f): its model exported to %s",
            step,
            best["by"],
            best[best["by"]],
            out,
        )
    summary["dev"]["export_best"] = str(out)
    summary[BEST_WRITTEN] = {"step": step, **export_record(out, options)}
    write_summary(run_dir / SUMMARY, summary)


def run_tokenizer(folder: Path | None, header: dict) -> Any:
    """The tokenizer the run's export carried: the base's own, or the byte tokenizer a
    --model-config shape read text through (none for one that read no text)."""
    if folder is not None:
        return source_tokenizer(folder)
    return byte_tokenizer() if header.get("byte_tokenizer") else None


def _parser() -> argparse.ArgumentParser:
    """The command line: the log and where to write, and the export's flags of distzo.train."""
    p = argparse.ArgumentParser(
        prog=program("distzo.replay"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_version_flag(p)
    p.add_argument(
        "--base",
        default=None,
        metavar="MODEL",
        type=os.path.expanduser,
        help="the base model (hub name or local path) the run started from; "
        "default: the one its log names (or the --model-config shape it was drawn from)",
    )
    p.add_argument(
        "--log", required=True, metavar="SEEDLOG", type=home_path, help="the run's seedlog.jsonl"
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        type=home_path,
        help="where to write the rebuilt model (Hugging Face format)",
    )
    p.add_argument(
        "--step",
        type=int,
        default=None,
        metavar="N",
        help="rebuild the model after the run's first N steps (default: all the log holds)",
    )
    p.add_argument("--device", default=None, help="default: the device type the run trained on")
    add_job_flag(  # distzo.train's flags, which the run's own export took
        p,
        "merge_adapter",
        default=None,
        help="write an adapter run's base with the adapter merged in, or (--no-merge-adapter) "
        "the peft adapter alone (default: as the run's export, which its --merge-adapter "
        "decided)",
    )
    add_job_flag(
        p,
        "export_shard_size",
        default=None,
        help="largest safetensors file of the exported model (e.g. 5GB, 500MB) (default: as "
        "the run's export, which its --export-shard-size decided)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out (without it, an existing one is refused)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.base == "":  # "" would read as unset: the log's base, where one was named
            raise ValueError("--base is empty; give the base's hub name or folder, or leave it out")
        target = check_out(args.out, args.overwrite)
        out = replay(
            args.base,
            args.log,
            target,
            args.device,
            args.merge_adapter,
            args.step,
            args.export_shard_size,
        )
    except ValueError as err:
        return fail(str(err).splitlines()[0])
    except OSError as err:  # a full disk, an unwritable --out: a failure, one line
        return fail(write_failure(err, args.out), 1)
    logger.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
