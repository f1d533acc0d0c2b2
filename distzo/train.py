"""``python -m distzo.train`` / ``torchrun --nproc_per_node=N -m distzo.train``.

With no arguments it trains a tiny random-init OPT on a counting task generated in
code (no download), evaluates before and after, and prints the loss going down.
Under torchrun the ranks form a dp x pert mesh (DistZO2): every option is validated
on every rank before any process group or model is built.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoConfig, PretrainedConfig

from distzo.config import COMPUTE_DTYPE_NAMES, MODES, TRANSFER_DTYPE_NAMES, TRANSFERS, ZOConfig
from distzo.data import CountingTask
from distzo.dist import LaunchEnv, ParallelContext, ParallelDims, ShardGroup, broadcast_seed
from distzo.dist import process_group as pg
from distzo.engine import ZOEngine, count_tokens
from distzo.models import check_supported, load_model, model_from_config
from distzo.models.tiny import tiny_opt_config
from distzo.zo import SCHEDULES

logger = logging.getLogger("distzo.train")

MASTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
FAILURE_ENV = "DISTZO_FAIL_AT"  # "RANK:STEP": that rank raises at that step (tests of failure handling)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m distzo.train",
        description="Zeroth-order (MeZO / ZO2 / DistZO2) fine-tuning. Defaults train a tiny OPT on a "
        "generated counting task. Launch with torchrun for several ranks.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=None, help="hub name or local path of an OPT model; default: tiny random init")
    p.add_argument("--dtype", choices=sorted(MASTER_DTYPES), default="fp32", help="master (parameter) dtype")
    p.add_argument("--max-steps", type=int, default=2000, help="ZO steps to take")
    p.add_argument("--batch-size", type=int, default=16, help="global sequences per step (split over dp)")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per generated sequence")
    p.add_argument("--lr", type=float, default=1e-2, help="learning rate")
    p.add_argument("--eps", type=float, default=1e-3, help="perturbation scale")
    p.add_argument("--weight-decay", type=float, default=0.0, help="decoupled weight decay on matrices")
    p.add_argument("--lr-schedule", choices=SCHEDULES, default="linear", help="learning-rate schedule")
    p.add_argument("--mode", choices=MODES, default="offload", help="offload: blocks in host memory (ZO2); resident: all on device (MeZO)")
    p.add_argument("--num-slots", type=int, default=2, help="device slots for streamed blocks (1 = no overlap)")
    p.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK if CUDA, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--seed", type=int, default=0, help="run seed (model init, data and noise); -1: rank 0 draws one")
    p.add_argument("--eval-batch-size", type=int, default=64, help="sequences in the fixed evaluation batch")
    p.add_argument("--log-every", type=int, default=50, help="log a line every N steps")
    p.add_argument("--output-dir", default=None, help="where rank 0 writes metrics.jsonl and final.safetensors")
    dist = p.add_argument_group("distributed (under torchrun)")
    dist.add_argument("--dp", type=int, default=None, help="data-parallel size (default auto: world / pert)")
    dist.add_argument("--pert", type=int, default=None, help="perturbation-parallel size, 1 or 2 (default auto: 2 if the world is even)")
    dist.add_argument("--transfer", choices=TRANSFERS, default="auto", help="naive: whole blocks per rank; sliced: each local rank moves 1/n and all-gathers; auto: sliced on CUDA+NCCL with >1 local ranks")
    dist.add_argument("--transfer-dtype", choices=TRANSFER_DTYPE_NAMES, default="fp32", help="format of blocks in host memory and on the wire (stochastic rounding back)")
    dist.add_argument("--transfer-chunks", type=int, default=4, help="pieces of each rank's share, so the sliced upload's all-gather of one overlaps the copy of the next")
    dist.add_argument("--compute-dtype", choices=COMPUTE_DTYPE_NAMES, default="auto", help="dtype of perturbed weights and activations (auto: the master dtype)")
    dist.add_argument("--backend", choices=pg.BACKENDS, default="auto", help="process-group backend (auto: nccl on CUDA, gloo on CPU)")
    dist.add_argument("--dist-timeout", type=float, default=300.0, help="seconds before a stuck collective fails the job")
    dist.add_argument("--threads", type=int, default=0, help="CPU threads per rank (0: cores / local ranks)")
    return p


def configure_logging(env: LaunchEnv) -> None:
    """Rank 0 speaks; the other ranks report only warnings and errors, tagged with their rank."""
    level = logging.INFO if env.rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"%(asctime)s [rank{env.rank}] %(levelname)s %(name)s: %(message)s")


def resolve_device(name: str, env: LaunchEnv) -> str:
    """One rank = one GPU: ``auto`` and a bare ``cuda`` mean cuda:LOCAL_RANK."""
    if name in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{env.local_rank % torch.cuda.device_count()}"
    return name


def validate(args: argparse.Namespace, env: LaunchEnv) -> tuple[ZOConfig, ParallelDims]:
    """Every check that needs no model and no process group, run identically on every rank."""
    if args.max_steps < 0 or args.batch_size < 1 or args.eval_batch_size < 1:
        raise ValueError("--max-steps must be >= 0 and --batch-size/--eval-batch-size >= 1")
    dims = ParallelDims.resolve(env.world_size, args.dp, args.pert)
    dims.check_batch(args.batch_size)
    if args.transfer == "sliced" and not env.launched:
        raise ValueError("--transfer sliced needs a torchrun launch (a process group); use --transfer naive or auto")
    config = ZOConfig(
        lr=args.lr,
        eps=args.eps,
        weight_decay=args.weight_decay,
        lr_schedule=args.lr_schedule,
        max_steps=args.max_steps,
        mode=args.mode,
        num_slots=args.num_slots,
        device=resolve_device(args.device, env),
        seed=None if args.seed == -1 else args.seed,
        transfer=args.transfer,
        transfer_dtype=args.transfer_dtype,
        compute_dtype=args.compute_dtype,
        transfer_chunks=args.transfer_chunks,
    )
    pg.resolve_backend(args.backend, config.torch_device())
    model_config = model_config_of(args.model)
    check_supported(model_config.model_type)
    if args.seq_len > model_config.max_position_embeddings:
        raise ValueError(
            f"--seq-len {args.seq_len} exceeds the model's max_position_embeddings "
            f"{model_config.max_position_embeddings}; lower --seq-len"
        )
    return config, dims


def model_config_of(name: str | None) -> PretrainedConfig:
    """The model's config alone (a small file): enough to reject bad input before loading."""
    if name is None:
        return tiny_opt_config()
    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as err:  # a missing path, a malformed name, no hub access
        raise ValueError(f"cannot load --model {name!r}: {str(err).splitlines()[0]}") from None


def build_parallel(args: argparse.Namespace, env: LaunchEnv, dims: ParallelDims, device: torch.device) -> ParallelContext:
    if not env.launched:
        return ParallelContext(env, dims)
    pg.init_process_group(env, pg.resolve_backend(args.backend, device), args.dist_timeout)
    mesh = pg.build_mesh(dims, device)
    group, members = pg.node_groups(env)
    shard = ShardGroup(group, members, members.index(env.rank))
    return ParallelContext(env, dims, mesh, shard)


def injected_failure(rank: int) -> int | None:
    """The step at which this rank must raise, from ``DISTZO_FAIL_AT=RANK:STEP``."""
    spec = os.environ.get(FAILURE_ENV)
    if not spec:
        return None
    fail_rank, fail_step = (int(x) for x in spec.split(":"))
    return fail_step if fail_rank == rank else None


def train(args: argparse.Namespace, env: LaunchEnv, config: ZOConfig, dims: ParallelDims) -> None:
    device = config.torch_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif env.launched or args.threads:
        logger.info("%d CPU threads per rank", pg.set_cpu_threads(env, args.threads))
    parallel = build_parallel(args, env, dims, device)
    seed = broadcast_seed(config.seed, device)
    logger.info(
        "run seed %d; %d ranks as dp %d x pert %d", seed, env.world_size, dims.dp, dims.pert
    )

    torch.manual_seed(seed)  # the random init of the default model: equal on every rank
    dtype = MASTER_DTYPES[args.dtype]
    model = load_model(args.model, dtype) if args.model else model_from_config(tiny_opt_config(), dtype)
    engine = ZOEngine(model, config, parallel=parallel, run_seed=seed)
    task = CountingTask(model.config.vocab_size, seq_len=args.seq_len, seed=seed)
    out_dir = Path(args.output_dir) if args.output_dir else None
    metrics = None
    if out_dir is not None and env.rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        metrics = open(out_dir / "metrics.jsonl", "w")
    fail_at = injected_failure(env.rank)

    eval_batch = task.batch(args.eval_batch_size)
    eval_batch["labels"] = eval_batch["input_ids"]
    before = engine.forward(eval_batch)[1].item()
    logger.info("eval loss before training: %.4f", before)
    start, tokens = time.perf_counter(), 0
    progress = tqdm(range(args.max_steps), desc="train", disable=None if env.rank == 0 else True)
    for step in progress:
        if step == fail_at:
            raise RuntimeError(f"failure injected by {FAILURE_ENV} at step {step}")
        global_batch = task.batch(args.batch_size)  # the same rows on every rank
        _, label_tokens = count_tokens(global_batch)
        result = engine.step(parallel.shard_batch(global_batch), num_items=label_tokens)
        tokens += result.num_tokens
        progress.set_postfix(loss=f"{result.loss:.4f}", g=f"{result.projected_grad:+.3g}")
        if metrics is not None:
            record = {k: getattr(result, k) for k in ("step", "loss", "loss_plus", "loss_minus", "projected_grad", "lr")}
            metrics.write(json.dumps(record) + "\n")
        if args.log_every and (step % args.log_every == 0 or step == args.max_steps - 1):
            logger.info("step %d loss %.4f g %+.4g lr %.3g", step, result.loss, result.projected_grad, result.lr)
    elapsed = time.perf_counter() - start
    after = engine.forward(eval_batch)[1].item()
    logger.info(
        "eval loss %.4f -> %.4f after %d steps (%.1f s, %.0f tokens/s on rank 0)",
        before,
        after,
        args.max_steps,
        elapsed,
        tokens / max(elapsed, 1e-9),
    )
    params = engine.named_parameters()  # collective under the sliced transfer
    if out_dir is not None:
        rank_record = {
            "rank": env.rank,
            "transfer": engine.transfer,
            "shard_group": parallel.shard_group.members if parallel.shard_group else [env.rank],
            "mesh_coordinates": [parallel.dp_rank, parallel.pert_rank],
            "formula_coordinates": list(dims.coordinates(env.rank)),
            "host_bytes": engine.store.host_bytes,
            "device_bytes": engine.store.device_bytes,
            "eval_before": before,
            "eval_after": after,
        }
        (out_dir / f"rank{env.rank}.json").write_text(json.dumps(rank_record))
    if metrics is not None:
        metrics.close()
        canonical = {name: params[name].contiguous() for name in engine.canonical_names}
        tmp = out_dir / "final.safetensors.tmp"
        save_file(canonical, str(tmp))
        tmp.replace(out_dir / "final.safetensors")  # never a half-written file


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = LaunchEnv.from_environ()
    configure_logging(env)
    try:
        config, dims = validate(args, env)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)  # every rank, the same line, before any model
        return 2
    try:
        train(args, env, config, dims)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    # Any other failure propagates: the process exits non-zero and torchrun stops the other
    # ranks (a peer blocked in a collective fails by itself within --dist-timeout). The
    # process group is torn down only after success: tearing it down under a collective
    # that a dead peer will never join can hang.
    pg.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
