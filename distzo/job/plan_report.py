"""``python -m distzo.job.plan_report``: the memory plan of a job, term by term, without
building or launching it (a named ``--model-config`` shape, planned for CUDA ranks
from any machine).

It prints what ``distzo.train`` plans on one rank of the job described (the same
``plan_memory``, the rows a step and an evaluation forward), then the device terms of
one rank and the host terms of one node, with their totals: the figures in
docs/models.md are its output.
"""

from __future__ import annotations

import argparse
import sys

import torch

from distzo.config.engine_checks import (
    COMPUTE_DTYPE_NAMES,
    ESTIMATOR_NAMES,
    LOW_BIT_MASTERS,
    PERTURB_SCOPES,
    TRANSFER_DTYPE_NAMES,
)
from distzo.config.engine_options import ZOConfig
from distzo.config.job import DEFAULT_MAX_SHARD_SIZE
from distzo.dist.parallel_dims import ParallelDims
from distzo.export.hf_model import check_shard_size
from distzo.job.evaluation import rows_per_call
from distzo.job.memory_plan import (
    MemoryPlan,
    PlannedExport,
    RankPlace,
    host_terms,
    plan_memory,
)
from distzo.models.registry import check_supported
from distzo.models.shapes import SHAPES, shape_config
from distzo.models.weights import skeleton
from distzo.runtime.option_names import named_as_flags
from distzo.runtime.units import counted, format_bytes
from distzo.zo.estimators import estimator_for


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m distzo.job.plan_report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_layout(parser)
    _add_engine(parser)
    _add_rows(parser)
    return parser


def _add_layout(parser: argparse.ArgumentParser) -> None:
    """The shape planned and how its ranks share it."""
    group = parser.add_argument_group("model and ranks")
    group.add_argument(
        "--model-config", required=True, choices=sorted(SHAPES), help="the named shape planned"
    )
    group.add_argument(
        "--model-layers",
        type=int,
        default=None,
        help="layer count of --model-config, as distzo.train takes it (default: the shape's)",
    )
    group.add_argument(
        "--nproc", type=int, default=8, help="ranks on the node (one node; default: 8)"
    )
    group.add_argument("--dp", type=int, default=None, help="default: nproc / pert")
    group.add_argument(
        "--pert",
        type=int,
        default=None,
        help="ranks sharing a step's passes (at most the passes); default: nproc / dp, or 1 "
        "without --dp",
    )
    group.add_argument(
        "--transfer",
        default="sliced",
        choices=("naive", "sliced"),
        help="whole blocks per rank, or 1/nproc of each block per rank, all-gathered "
        "(default: sliced)",
    )


def _add_engine(parser: argparse.ArgumentParser) -> None:
    """The engine's options that size its buffers."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--transfer-dtype",
        default="bf16",
        choices=TRANSFER_DTYPE_NAMES,
        help="the blocks at rest and on the link (default: bf16)",
    )
    group.add_argument(
        "--compute-dtype",
        default="bf16",
        choices=COMPUTE_DTYPE_NAMES,
        help="the dtype the forward computes in (default: bf16)",
    )
    group.add_argument(
        "--num-slots", type=int, default=3, help="device slots blocks stream through (default: 3)"
    )
    group.add_argument(
        "--low-bit-master",
        default="buffer",
        choices=LOW_BIT_MASTERS,
        help="a low-bit block's float32 master: one buffer, two (upcast and rounded beside "
        "the compute), or rebuilt a chunk at a time (default: buffer)",
    )
    group.add_argument(
        "--perturb-scope",
        default="block",
        choices=PERTURB_SCOPES,
        help="a block perturbed whole, or module by module in a scratch the size of one "
        "(default: block)",
    )
    group.add_argument(
        "--estimator",
        default="spsa",
        choices=ESTIMATOR_NAMES,
        help="the gradient estimator, whose passes a step runs (default: spsa)",
    )
    group.add_argument(
        "--num-queries", type=int, default=None, help="default: the estimator's (spsa 1, fzoo 8)"
    )


def _add_rows(parser: argparse.ArgumentParser) -> None:
    """The rows a step and an evaluation call take, and the export."""
    group = parser.add_argument_group("rows and export")
    group.add_argument(
        "--batch-size", type=int, default=16, help="global sequences per step (default: 16)"
    )
    group.add_argument(
        "--rows-per-example",
        type=int,
        default=1,
        help="rows a step's example takes: a choice task's candidates of several tokens are a "
        "row each (ReCoRD: up to 50; default: 1)",
    )
    group.add_argument(
        "--micro-batch-rows",
        type=int,
        default=0,
        help="at most this many rows of a pass in a step's micro-batch (0: no bound)",
    )
    group.add_argument(
        "--eval-batch-size",
        type=int,
        default=64,
        help="rows of one evaluation call over all the ranks (default: 64)",
    )
    group.add_argument(
        "--seq-len", type=int, default=512, help="tokens per sequence (default: 512)"
    )
    group.add_argument(
        "--export-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help="largest safetensors file of the final export (rank 0 holds one while writing; "
        f"default: {DEFAULT_MAX_SHARD_SIZE})",
    )


def check_sizes(args: argparse.Namespace) -> None:
    """The counts ``distzo.train`` refuses, refused here in its words: a plan for a batch of
    0 or a sequence of -5 tokens printed negative activations, and one past the shape's
    token positions a plan no run of it can reach."""
    for flag, value in (
        ("--nproc", args.nproc),
        ("--batch-size", args.batch_size),
        ("--rows-per-example", args.rows_per_example),
        ("--eval-batch-size", args.eval_batch_size),
        ("--seq-len", args.seq_len),
    ):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    config = shape_config(args.model_config, args.model_layers)
    # RoBERTa's positions count from its pad id + 1: its 514 rows hold 512 tokens
    positions = check_supported(config.model_type).token_positions(config)
    table = config.max_position_embeddings
    held = f" ({positions} token positions)" if positions != table else ""
    if args.seq_len > positions:
        raise ValueError(
            f"--seq-len {args.seq_len} exceeds {args.model_config}'s max_position_embeddings "
            f"{table}{held}; lower --seq-len"
        )


def report(args: argparse.Namespace) -> str:
    """The plan's lines for ``args`` (the command line, parsed)."""
    check_sizes(args)
    pert = 1 if args.pert is None and args.dp is None else args.pert
    with named_as_flags():  # the layout's errors name --dp and --pert, as typed here
        dims = ParallelDims.resolve(args.nproc, args.dp, pert)
    dp = dims.dp
    rule = estimator_for(args.estimator)
    queries = args.num_queries if args.num_queries is not None else rule.default_queries
    with named_as_flags():  # its checks name --num-slots, as typed here, not num_slots
        config = ZOConfig(
            device="cpu",
            mode="offload",
            num_slots=args.num_slots,
            transfer_dtype=args.transfer_dtype,
            low_bit_master=args.low_bit_master,
            perturb_scope=args.perturb_scope,
            compute_dtype=args.compute_dtype,
            estimator=args.estimator,
            num_queries=queries,
            noise=rule.default_noise,
            micro_batch_rows=args.micro_batch_rows,
        )
    with named_as_flags():  # after --num-queries >= 1, as in training
        dims.check_passes(args.estimator, queries)
    dims.check_batch(args.batch_size)  # what distzo.train refuses, refused here too
    check_shard_size(args.export_shard_size)
    if args.eval_batch_size < args.nproc:
        raise ValueError(
            f"--eval-batch-size {args.eval_batch_size} is smaller than the {args.nproc} "
            "ranks; raise it"
        )
    model = skeleton(shape_config(args.model_config, args.model_layers), torch.float32)
    eval_rows = rows_per_call(args.eval_batch_size, args.nproc)
    rows = max(args.batch_size // dp * args.rows_per_example, eval_rows)
    sliced = args.transfer == "sliced"
    plan = plan_memory(
        model,
        config,
        args.nproc if sliced else 1,
        sliced,
        rows,
        args.seq_len,
        place=RankPlace(pert=dims.pert, world=args.nproc, local_ranks=args.nproc),
        device_type="cuda",
        export=PlannedExport(args.export_shard_size),
        eval_rows=eval_rows,
    )
    return _lines(plan, args, dims, rows, config)


def _lines(
    plan: MemoryPlan, args: argparse.Namespace, dims: ParallelDims, rows: int, config: ZOConfig
) -> str:
    b = format_bytes
    host = host_terms(plan, True, args.nproc)
    # a step's passes, named where they are not MeZO's two (one hidden state each)
    passes = len(config.step_passes())
    step = "" if passes == 2 else f"{config.estimator} with {passes} passes per step, "
    master = {
        "buffer": "",
        "double": "block masters double-buffered, ",
        "recompute": "block masters recomputed, ",
    }[config.low_bit_master]
    master += "" if config.perturb_scope == "block" else "perturbed module by module, "
    bound = config.micro_batch_rows
    split = f" (a step's at most {bound} at a time)" if 0 < bound < rows else ""
    layers = f" ({counted(args.model_layers, 'layer')})" if args.model_layers else ""
    out = [
        f"{args.model_config}{layers}, {counted(args.nproc, 'GPU')} on one node, "
        f"dp {dims.dp} x pert {dims.pert}, "
        f"{args.transfer} transfer, {args.transfer_dtype} at rest, {args.compute_dtype} compute, "
        f"{counted(args.num_slots, 'slot')}, {master}{step}{counted(rows, 'row')} x "
        f"{args.seq_len} tokens per "
        f"forward{split}",
        f"memory plan: {plan.describe()}",
        "device, per rank:",
        *(f"  {name:<24} {b(size):>10}" for name, size in plan.device_terms().items()),
        f"  {'device total':<24} {b(plan.device_need):>10}",
        f"host, per node ({counted(args.nproc, 'rank')}):",
        *(f"  {name:<24} {b(size):>10}" for name, size in host.items()),
        f"  {'host total':<24} {b(sum(host.values())):>10}",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Print the report; exit 2 with one line for options that do not make a job."""
    args = _parser().parse_args(argv)
    try:
        print(report(args))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
