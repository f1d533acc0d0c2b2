"""The distzo peer of ``benchmarks/peers.py``: one distzo engine, timed by the protocol.

    python benchmarks/peer_distzo.py --system distzo-offload --shape opt-1.3b --batch 1 \\
        --seq 2048 --dtype fp16 --device cuda
    python -m torch.distributed.run --nproc_per_node 2 benchmarks/peer_distzo.py \\
        --system distzo-sliced ...        # rank 0 speaks the protocol

Systems: ``distzo-resident`` (MeZO: every weight on the device), ``distzo-offload``
(blocks in host memory, streamed through the default slots), ``distzo-offload-recompute``
(the same steps, the block's float32 master rebuilt a chunk at a time from its low-bit
copy instead of held in a buffer the size of a block), ``distzo-offload-double`` (the
same steps, the master's upcast and its rounding for the way back on the upload and
offload streams, in two such buffers, beside the compute), ``distzo-offload-half``
(the same with the model held in ``--dtype``, fp16 or bf16, as ZO2 holds its model: no
float32 masters, each update rounded to nearest in that dtype as ZO2's) and, on 2 ranks,
``distzo-sliced`` (PertP over the 2 ranks, each uploading its half of every block and
all-gathering the rest: the trainer's layout at 2 ranks of a node). The model is the
shape's OPT or Qwen3, built as ZO2's speed test builds it (``distzo.bench.peer_models``:
the config's defaults but for the shape, ``tie_word_embeddings=False``,
``max_position_embeddings = seq``), as a meta skeleton filled by ``RandomWeights``. The
step is ZO2's speed test's: lr 1e-3, eps 1e-3, weight decay 0.1, the causal-LM loss on
one fixed random batch (labels = the input ids).

Masters are float32 (distzo's design) but for ``distzo-offload-half``; ``--dtype`` is the
compute dtype, and under offload also the host copy's and the link's
(``--transfer-dtype`` overrides), so that the bytes at rest and on the link are ZO2's for
its model in that dtype.
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from pathlib import Path

import torch

from distzo import ZOConfig, ZOEngine
from distzo.bench.kernel_profile import TRACE_SUFFIX, profile_step, write_profile
from distzo.bench.peer_models import PEER_SHAPES, peer_config
from distzo.bench.peer_protocol import protocol_parser, serve
from distzo.bench.phases import step_phases
from distzo.config.engine_checks import PERTURB_SCOPES
from distzo.dist import Collectives, LaunchEnv, ParallelContext, ParallelDims, ShardGroup
from distzo.dist import process_group as pg
from distzo.job.memory_plan import RankPlace, plan_memory
from distzo.models.weights import RandomWeights, skeleton

SYSTEMS = (
    "distzo-resident",
    "distzo-offload",
    "distzo-offload-recompute",
    "distzo-offload-double",
    "distzo-offload-half",
    "distzo-sliced",
)
HALF_MASTERS = {"fp16": torch.float16, "bf16": torch.bfloat16}
# the systems that place a low-bit block's float32 master otherwise than in one buffer
LOW_BIT_MASTER = {"distzo-offload-recompute": "recompute", "distzo-offload-double": "double"}
# The timeline steps a phases request takes, the median kept: one step of a busy machine
# can be an outlier (the noise is timed over one more step).
PHASE_STEPS = 3
# A rank other than 0 waits in a broadcast while the other peers of an interleaved run
# take their steps: hours at the largest shapes.
IDLE_TIMEOUT = timedelta(hours=6)


# the memory plan's device terms (``MemoryPlan.device_terms``) as a report's metrics
PLAN_METRICS = {
    "resident": "plan_resident_gb",
    "blocks/slots": "plan_slots_gb",
    "scratch": "plan_scratch_gb",
    "optimizer state": "plan_state_gb",
    "attention masks": "plan_masks_gb",
    "NCCL buffers": "plan_nccl_gb",
    "activations": "plan_activations_gb",
}


class DistzoSystem:
    """An engine and its fixed batch (this rank's share of it), and the engine's memory
    plan of that batch (``plan_memory``'s device terms, in GB); ``profile_dir``: where a
    phases request also leaves one profiled step's kernels (``distzo.bench.kernel_profile``)
    under the system's ``name``."""

    def __init__(
        self,
        engine: ZOEngine,
        batch: dict[str, torch.Tensor],
        plan: dict[str, float],
        name: str,
        profile_dir: Path | None = None,
    ) -> None:
        self.engine, self.batch, self.plan = engine, batch, plan
        self.name, self.profile_dir = name, profile_dir
        self.parameters = engine.num_parameters

    def step(self) -> float:
        return self.engine.step(self.batch).loss

    def phases(self) -> dict[str, float]:
        """Where a step's time goes, from ``PHASE_STEPS`` + 1 more steps
        (``distzo.bench.phases``), and where its device memory goes by the plan: what a
        missed memory target names."""
        phases = step_phases(self.engine, self.batch, PHASE_STEPS) | self.plan
        if self.profile_dir is not None:
            self.profile_kernels(self.profile_dir)
        return phases

    def profile_kernels(self, directory: Path) -> None:
        """One more step, profiled (every rank steps: its collectives need them all);
        rank 0 writes its kernels and its trace."""
        speaks = self.engine.parallel.env.rank == 0
        trace = directory / f"{self.name}{TRACE_SUFFIX}" if speaks else None
        record = profile_step(self.engine, self.batch, trace)
        if speaks:
            write_profile(directory, self.name, record)


def planned_terms(
    model: torch.nn.Module, zo: ZOConfig, parallel: ParallelContext, rows: int, seq: int
) -> dict[str, float]:
    """The plan of ``ZOEngine(model, zo)`` on this rank at ``rows`` x ``seq``, by term."""
    sliced = zo.transfer == "sliced"
    shard = parallel.shard_group.size if parallel.shard_group else 1
    plan = plan_memory(
        model,
        zo,
        shard,
        sliced,
        rows,
        seq,
        place=RankPlace.of(parallel),
        device_type=zo.torch_device().type,
    )
    terms = {PLAN_METRICS[name]: size / 1e9 for name, size in plan.device_terms().items()}
    return terms | {"plan_gb": plan.device_need / 1e9}


def parallel_for(system: str, device: torch.device) -> ParallelContext:
    """One process, or the 2 ranks of ``distzo-sliced`` (as the trainer builds them)."""
    env = LaunchEnv.from_environ()
    if system != "distzo-sliced":
        if env.world_size > 1:
            raise ValueError(f"{system} runs in one process; launch it with python, not torchrun")
        return ParallelContext.single(device)
    if env.world_size != 2:
        raise ValueError(
            "distzo-sliced runs on 2 ranks: launch it with torchrun --nproc_per_node 2"
        )
    pg.init_process_group(env, pg.resolve_backend("auto", device), IDLE_TIMEOUT.total_seconds())
    comm = Collectives.for_job(device, IDLE_TIMEOUT)
    dims = ParallelDims(1, 2)
    mesh = pg.build_mesh(dims, device, IDLE_TIMEOUT)
    group, members = pg.node_groups(env, comm)
    return ParallelContext(env, dims, mesh, ShardGroup.of(group, members, env.rank), comm)


def build(args: argparse.Namespace) -> tuple[DistzoSystem, torch.device]:
    system = getattr(args, "like", None) or args.system  # what to build; --system names it
    if system not in SYSTEMS:
        raise ValueError(
            f"--system {system}: the distzo peer runs {', '.join(SYSTEMS)} (a variant of "
            "yours: --system NAME --like one of those)"
        )
    if args.shape not in PEER_SHAPES:
        raise ValueError(f"--shape {args.shape}: choose one of {', '.join(PEER_SHAPES)}")
    env = LaunchEnv.from_environ()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device here")
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    half = system == "distzo-offload-half"
    if half and args.dtype not in HALF_MASTERS:
        raise ValueError(
            f"--system {system} holds the masters in --dtype: use fp16 or bf16 (at "
            f"{args.dtype} it is distzo-offload)"
        )
    config = peer_config(args.shape, args.layers, args.hidden, args.seq)
    parallel = parallel_for(system, device)
    mode = "resident" if system == "distzo-resident" else "offload"
    # a half run's blocks travel in their masters' dtype ("fp32": no conversion)
    transfer_dtype = "fp32" if half else args.transfer_dtype or args.dtype
    zo = ZOConfig(
        lr=1e-3,
        eps=1e-3,
        weight_decay=0.1,
        seed=args.seed,
        device=str(device),
        mode=mode,
        compute_dtype=args.dtype,
        transfer="sliced" if system == "distzo-sliced" else "auto",
        transfer_dtype=transfer_dtype if mode == "offload" else "fp32",
        low_bit_master=LOW_BIT_MASTER.get(system, "buffer"),
        perturb_scope=args.perturb_scope,
    )
    model = skeleton(config, HALF_MASTERS[args.dtype] if half else torch.float32)
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g)
    batch = parallel.shard_batch({"input_ids": ids})
    # planned from the skeleton: once built, the engine's modules hold views in the
    # compute dtype, which a plan would take for the masters' dtype
    plan = planned_terms(model, zo, parallel, batch["input_ids"].shape[0], args.seq)
    # float32 draws rounded to a half run's masters, drawn on the GPU where there is one:
    # the host's generator (the scalar 16-bit path, or one thread's float32 draws) would
    # take most of the build (the values do not matter to a speed test)
    weights = RandomWeights(
        args.seed,
        draw_dtype=torch.float32,
        draw_device=device if device.type == "cuda" else None,
    )
    engine = ZOEngine(model, zo, parallel=parallel, weights=weights)
    if device.type == "cuda":  # the draws' staging, out of the process's device figure
        torch.cuda.empty_cache()
    profile_dir = Path(args.profile_dir) if getattr(args, "profile_dir", None) else None
    return DistzoSystem(engine, batch, plan, args.system, profile_dir), device


def main() -> int:
    p = protocol_parser(__doc__.splitlines()[0])
    p.add_argument(
        "--transfer-dtype",
        choices=("fp32", "fp16", "bf16"),
        default=None,
        help="offload: the host copy's and the link's dtype (default: --dtype)",
    )
    p.add_argument(
        "--like",
        choices=SYSTEMS,
        default=None,
        help="build as this system, reported under --system (a --peer of the harness: a "
        "variant of a built-in system side by side with it, e.g. --perturb-scope module)",
    )
    p.add_argument(
        "--perturb-scope",
        choices=PERTURB_SCOPES,
        default="block",
        help="a block perturbed whole, or module by module (the same steps, a smaller scratch)",
    )
    p.add_argument(
        "--profile-dir",
        default=None,
        help="a phases request also profiles one step: its kernels per stream "
        "(DIR/SYSTEM.kernels.json) and its Chrome trace (DIR/SYSTEM.trace.json)",
    )
    args = p.parse_args()
    env = LaunchEnv.from_environ()
    built: list[DistzoSystem] = []

    def build_here(a: argparse.Namespace) -> tuple[DistzoSystem, torch.device]:
        system, device = build(a)
        built.append(system)
        return system, device

    def share(steps: int) -> int:
        """Rank 0's request, on every rank of a launch (the other ranks never read stdin)."""
        return int(built[0].engine.parallel.comm.broadcast_object(steps)) if built else steps

    try:
        return serve(build_here, args, speaks=env.rank == 0, share=share)
    finally:
        pg.shutdown()


if __name__ == "__main__":
    sys.exit(main())
