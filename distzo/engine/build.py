"""The engine's parts, made from its config: the transfer, the noise sources, the block
stores and their initial values, and the optimizer's moment buckets.

Each is a function of the config and the layouts, so the engine's constructor reads as
the list of what it assembles; what differs between full tuning and a frozen base is
decided in ``distzo.engine.tuning``.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from distzo.config.engine_options import ZOConfig
from distzo.config.field_types import whole_number
from distzo.dist import ParallelContext, broadcast_seed
from distzo.engine import layouts as engine_layouts
from distzo.engine.layouts import (
    LaidOut,
    bucket_range,
    bucket_values,
    copy_in_chunks,
    unwrap_peft,
)
from distzo.engine.state import StoredBuckets
from distzo.models import family_for
from distzo.models.weights import WeightSource
from distzo.offload import BlockStore, BucketLayout, ResidentBlocks, Shard, StreamedBlocks
from distzo.offload.low_bit import COMPUTE_DTYPES, TRANSFER_DTYPES
from distzo.offload.moment_stores import CarriedStore, Moments
from distzo.offload.streamed_blocks import ROUNDING_STREAM
from distzo.runtime.option_names import option_name as _n
from distzo.zo import NoiseSource
from distzo.zo.lowrank import LowRankNoise, narrowest_matrix

# Makes the store of the blocks that stream, from their layouts (read_only: never written back).
StoreMaker = Callable[[list[BucketLayout], bool], BlockStore]


def resolve_run_seed(
    run_seed: int | None, config_seed: int | None, parallel: ParallelContext
) -> int:
    """``run_seed``, else ``config.seed``, else a random draw: rank 0's, broadcast under
    torchrun. Ranks drawing their own would perturb along different ``z`` (a PertP pair's
    ``L+`` and ``L-`` of two directions) and their weights would part."""
    if run_seed is not None:  # config.seed is checked with the config
        whole = whole_number(run_seed)
        if whole is None:  # int() read 1.5 as 1 and "3" as 3: another run's noise
            raise ValueError(f"run_seed must be a whole number, got {run_seed!r}")
        return whole
    if config_seed is not None:
        return config_seed
    if parallel.is_distributed:
        return broadcast_seed(None, parallel.comm)
    return secrets.randbits(63)


def resolve_transfer(config: ZOConfig, device: torch.device, parallel: ParallelContext) -> str:
    """none (resident), naive or sliced: ``auto`` is sliced on CUDA + NCCL with several
    local ranks, which then share one host copy of the blocks."""
    transfer, group = config.transfer, parallel.shard_group
    if config.mode == "resident":
        return "none"
    if transfer == "sliced" and group is None:
        raise ValueError(
            "transfer sliced needs a torchrun launch with a node-local process group; "
            "use transfer naive (or auto) in a single process"
        )
    if transfer == "auto":
        nccl = dist.is_initialized() and dist.get_backend() == "nccl"
        return "sliced" if device.type == "cuda" and nccl and group and group.size > 1 else "naive"
    return transfer


def master_dtype(layouts: list[BucketLayout]) -> torch.dtype:
    """The one dtype of every bucket's master: the update and the noise run in it."""
    dtype = layouts[0].dtype
    if any(layout.dtype != dtype for layout in layouts):
        raise ValueError("blocks and resident modules must share one dtype; cast the model first")
    return dtype


def check_transfer_dtype(config: ZOConfig, master: torch.dtype) -> None:
    """A low-bit transfer must be narrower than the masters it carries: one as wide in
    another format saves no byte, only trades precision for range (and fp16 masters could
    not be rounded into bf16's wider range)."""
    if config.mode != "offload" or config.transfer_dtype == "fp32":
        return
    wire = TRANSFER_DTYPES[config.transfer_dtype]
    if wire != master and wire.itemsize >= master.itemsize:
        narrower = " or fp8" if master.itemsize > 1 else ""
        raise ValueError(
            f"transfer_dtype {config.transfer_dtype} is as wide as the model's "
            f"{str(master).removeprefix('torch.')} "
            f"({master.itemsize} bytes an element), so it saves nothing; use transfer_dtype "
            f"fp32 (the blocks travel in their own dtype){narrower}"
        )


def compute_dtype(config: ZOConfig, master: torch.dtype) -> torch.dtype:
    """The dtype of the scratch the model computes with: the masters' unless AMP is asked."""
    return master if config.compute_dtype == "auto" else COMPUTE_DTYPES[config.compute_dtype]


def check_lozo_rank(config: ZOConfig, layouts: list[BucketLayout]) -> None:
    """Refuse a low-rank noise whose rank exceeds a trained matrix's smaller side: its
    ``U V^T`` cannot have a higher rank, but its entries' variance (and with it the step)
    grows with the rank, so the run diverges; checked from the shapes, before any weight
    is read. ``layouts``: the trained buckets (with an adapter, LoRA's A and B)."""
    if config.noise != "lowrank":
        return
    narrowest = narrowest_matrix(layouts)
    if narrowest is None or config.lozo_rank <= narrowest[0]:
        return
    side, entry = narrowest
    rows, rank = entry.shape[0], _n("lozo_rank")
    raise ValueError(
        f"{rank} {config.lozo_rank} exceeds the smaller side of {entry.names[0]} "
        f"({rows} x {entry.numel // rows}): its U V^T has rank {side} at most, while the "
        f"step grows with {rank}; set {rank} {side} or less"
    )


def check_model_lozo_rank(model: nn.Module, config: ZOConfig) -> None:
    """``check_lozo_rank`` of ``model`` (a skeleton will do, a peft model its adapter's
    matrices): what a job asks before it builds its data or the engine reads a weight."""
    if config.noise != "lowrank":
        return
    model, _ = unwrap_peft(model)
    (built, (resident, _)), _ = engine_layouts.split_layouts(model, family_for(model).blocks())
    check_lozo_rank(config, [resident, *(layout for layout, _ in built)])


def make_noise(
    config: ZOConfig,
    run_seed: int,
    device: torch.device,
    dtype: torch.dtype,
    rounds: bool,
    layouts: list[BucketLayout],
) -> tuple[NoiseSource, NoiseSource | None]:
    """The perturbation noise, and with ``rounds`` (low-bit state written back to the
    host) a separate source for stochastic rounding: it has its own stream and workspace
    and runs on the offload stream, concurrently with the compute stream's perturbations.
    ``layouts``: the trained buckets by noise id (the resident bucket's first), which the
    low-rank kind cuts into its matrices."""
    kind, chunk = config.noise, config.noise_chunk
    noise: NoiseSource
    if kind == "lowrank":
        check_lozo_rank(config, layouts)
        rank, interval = config.lozo_rank, config.lozo_interval
        noise = LowRankNoise(run_seed, chunk, device, dtype, layouts, rank, interval)
    else:
        noise = NoiseSource(run_seed, chunk, device, dtype, kind=kind)
    # rounding draws uniforms: any portable kind draws the same ones
    rounding_kind = "gaussian" if kind == "lowrank" else kind
    rounding = (
        NoiseSource(run_seed, chunk, device, torch.float32, "uniform", kind=rounding_kind)
        if rounds
        else None
    )
    return noise, rounding


def make_shard(transfer: str, parallel: ParallelContext) -> Shard | None:
    """This rank's share of the host copy under the sliced transfer (None: a whole copy)."""
    if transfer != "sliced":
        return None
    group = parallel.shard_group
    if group is None:  # resolve_transfer refuses sliced without one
        raise ValueError("the sliced transfer needs a node-local process group")
    return Shard(group.group, group.rank, group.size, parallel.comm)


def store_maker(
    config: ZOConfig,
    device: torch.device,
    shard: Shard | None,
    rounding_noise: NoiseSource | None,
) -> StoreMaker:
    """How the blocks that stream are stored: in host memory, crossing the link in the
    transfer dtype, under offload; on the device in resident mode."""
    if config.mode != "offload":
        return lambda layouts, read_only: ResidentBlocks(layouts, device)
    low_bit = None if config.transfer_dtype == "fp32" else TRANSFER_DTYPES[config.transfer_dtype]

    def streamed(layouts: list[BucketLayout], read_only: bool) -> BlockStore:
        return StreamedBlocks(
            layouts,
            device,
            config.num_slots,
            low_bit,
            shard,
            rounding_noise,
            config.transfer_chunks,
            read_only=read_only,
            master_buffers=config.master_buffers,
        )

    return streamed


def fill_store(store: BlockStore, built: list[LaidOut], weights: WeightSource | None) -> None:
    """Each block's initial values into ``store``, one block in memory at a time; from a
    source, ``LOAD_CHUNK`` elements at a time (a sliced rank reads only its share)."""
    for i, (layout, ordered) in enumerate(built):
        if weights is None:
            store.load_block(i, bucket_values(layout, ordered))
            continue
        read = functools.partial(bucket_range, layout, weights)
        if isinstance(store, StreamedBlocks):
            store.load_block_ranges(i, read, chunk=engine_layouts.LOAD_CHUNK)
        elif isinstance(store, ResidentBlocks):
            copy_in_chunks(store.device_bucket(i), read)
        else:
            store.load_block(i, read(0, layout.numel))


def make_moments(
    names: tuple[str, ...],
    config: ZOConfig,
    trained: StoredBuckets,
    streams_trained: bool,
    device: torch.device,
    shard: Shard | None,
    rounding_noise: NoiseSource | None,
) -> tuple[Moments, CarriedStore | None]:
    """Stored optimizer state (Adam, a stored momentum): zeroed moment buckets beside the
    ``trained`` buckets, in host shards streamed with the blocks when the trained blocks
    stream (sliced like them), else on the device; none for ZO-SGD. Returns the moments
    and, when they travel, the store that carries them with the blocks."""
    layouts = trained.block_layouts
    resident = [torch.zeros_like(trained.resident) for _ in names]
    if not (config.mode == "offload" and streams_trained):
        on_device: list[BlockStore] = [ResidentBlocks(layouts, device) for _ in names]
        return Moments(names, resident, on_device), None
    state_dtype = torch.bfloat16 if config.state_dtype == "bf16" else None
    blocks: list[BlockStore] = [
        StreamedBlocks(
            layouts,
            device,
            config.num_slots,
            state_dtype,
            shard,
            rounding_noise,
            config.transfer_chunks,
            rounding_stream=ROUNDING_STREAM * (2 + k),
            # a bf16 moment packs where its block does: as many buffers (never 0: stored
            # moments refuse recompute)
            master_buffers=config.master_buffers,
        )
        for k in range(len(names))
    ]
    carried = CarriedStore(trained.store, blocks) if blocks else None
    return Moments(names, resident, blocks), carried
