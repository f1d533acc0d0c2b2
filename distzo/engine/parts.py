"""What an engine is assembled from, in the order it must be made.

The layouts decide the strategy (full tuning or a frozen base), the masters' dtype
decides the noise, the noise is handed to the stores that round, the stores are filled
one block at a time, and last the model is bound to its scratch buckets. ``ZOEngine``
takes the finished parts; a restore only remakes the noise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from distzo.adapters.peft_adapters import install_block_prefixes, is_prefix_tuned
from distzo.config.engine_options import ZOConfig
from distzo.dist import ParallelContext
from distzo.engine.build import (
    check_transfer_dtype,
    compute_dtype,
    fill_store,
    make_moments,
    make_noise,
    make_shard,
    master_dtype,
    store_maker,
)
from distzo.engine.layouts import device_bucket, split_layouts
from distzo.engine.module_scratch import ModuleScratch
from distzo.engine.passes import Group, pass_grouping
from distzo.engine.rebuilt_master import RebuiltMaster
from distzo.engine.resident_sides import resident_sides, scratch_numel, share_block_scratch
from distzo.engine.scratch import ResidentScratch, bound_scratch
from distzo.engine.state import StoredBuckets
from distzo.engine.tuning import Tuning, make_tuning
from distzo.engine.updates import UpdateRule
from distzo.engine.vocab_slices import SlicedResident, shared_scratch_numel, sliced_sides
from distzo.models.weights import WeightSource, check_weights
from distzo.offload import BucketLayout, StreamedBlocks
from distzo.offload.moment_stores import CarriedStore, Moments
from distzo.runtime.option_names import option_name as _n
from distzo.runtime.units import counted, format_bytes, format_count
from distzo.zo import NoiseSource, Pass

if TYPE_CHECKING:
    from distzo.engine.engine import ZOEngine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """Where the engine runs: its device, its rank's place in the job, the transfer, the
    passes this rank runs and the run seed every rank shares."""

    config: ZOConfig
    device: torch.device
    parallel: ParallelContext
    transfer: str
    passes: tuple[Pass, ...]
    run_seed: int


@dataclass(frozen=True)
class Parts:
    """The engine's parts, made once from the model and the config."""

    tuning: Tuning
    trained: StoredBuckets
    noise: NoiseSource
    rounding_noise: NoiseSource | None
    update_rule: UpdateRule
    moments: Moments
    carried: CarriedStore | None  # the blocks' store that carries their moments, if they travel
    block_scratch: torch.Tensor
    module_scratch: ModuleScratch | None  # the block scratch bound module by module, if so
    resident: ResidentScratch | SlicedResident  # sliced, in the module scratch, if so
    pass_groups_of: Callable[[tuple[Pass, ...]], list[Group]]
    compute_dtype: torch.dtype
    rebuilt: RebuiltMaster | None  # a low-bit block's master without the buffer


def build_parts(
    model: nn.Module,
    peft_model: nn.Module | None,
    blocks: list[nn.Module],
    at: Placement,
    weights: WeightSource | None,
) -> Parts:
    """Lay out, store, fill and bind ``model`` (its parameters become views of the
    scratch buckets, and are frozen: the engine updates them, never autograd)."""
    config, device = at.config, at.device
    # Prefix tuning: every block carries its own prefix, trained with the block.
    prefixes = (
        install_block_prefixes(peft_model, blocks)
        if peft_model is not None and is_prefix_tuned(peft_model)
        else []
    )
    (built, (resident_layout, resident_ordered)), frozen = split_layouts(model, blocks)
    model.requires_grad_(False)
    layouts = [layout for layout, _ in built]
    tuning = make_tuning(frozen, layouts, resident_layout, prefixes)
    groups, largest = _check_tuning(model, tuning, layouts, resident_layout, at)
    check_weights(weights, model)  # from the files' headers, if it can
    dtype = master_dtype([resident_layout, *layouts, *tuning.base_layouts])
    check_transfer_dtype(config, dtype)  # before any bucket is allocated
    noise, rounding_noise = make_noise(
        config, at.run_seed, device, dtype, tuning.rounds(config), [resident_layout, *layouts]
    )
    shard = make_shard(at.transfer, at.parallel)
    store = tuning.make_store(store_maker(config, device, shard, rounding_noise), layouts, device)
    fill_store(store, built, weights)
    tuning.load_base(weights, device)
    master = device_bucket(resident_layout, resident_ordered, weights, device)
    trained = StoredBuckets(resident_layout, layouts, master, store)
    update_rule = UpdateRule(config, noise)
    streams_trained = tuning.streams_trained
    moments, carried = make_moments(
        update_rule.moment_names, config, trained, streams_trained, device, shard, rounding_noise
    )
    scratch_dtype = compute_dtype(config, dtype)
    setattr(model, BOUND, True)  # from here on its parameters are the engine's views
    block_scratch, module_scratch, resident = _bind_scratch(
        model, tuning, trained, at, scratch_dtype
    )
    if largest > 1:
        tuning.setup_batched(layouts, largest, device, scratch_dtype)
    rebuilt = (
        RebuiltMaster(store, config.noise_chunk, device, dtype)
        if isinstance(store, StreamedBlocks) and store.rebuilds
        else None
    )
    return Parts(
        tuning,
        trained,
        noise,
        rounding_noise,
        update_rule,
        moments,
        carried,
        block_scratch,
        module_scratch,
        resident,
        groups,
        scratch_dtype,
        rebuilt,
    )


def _check_tuning(
    model: nn.Module,
    tuning: Tuning,
    layouts: list[BucketLayout],
    resident_layout: BucketLayout,
    at: Placement,
) -> tuple[Callable[[tuple[Pass, ...]], list[Group]], int]:
    """How passes group into forwards, and the largest group; refuses what the tuning
    cannot do before any bucket is allocated or a byte of the checkpoint read."""
    config = at.config
    if config.perturb_scope == "module" and tuning.base_layouts:
        raise ValueError(
            "perturb_scope module perturbs the modules of trained blocks; an adapter's base "
            "is never perturbed: use perturb_scope block"
        )
    groups = pass_grouping(config.dual_forward, config.batch_queries)
    largest = max(len(g) for g in groups(at.passes))
    if largest > 1:
        tuning.batch_factors(model, layouts, resident_layout)
    elif (config.dual_forward or config.batch_queries) and at.parallel.dims.pert > 1:
        # said once for the job, on rank 0: every rank builds the same grouping
        if at.parallel.env.rank == 0:
            asked = [_n(f) for f in ("dual_forward", "batch_queries") if getattr(config, f)]
            logger.warning(
                "%s %s nothing: the %d pert ranks split a step's passes so that each runs "
                "%d, none of them batchable together; use fewer pert ranks (a smaller %s, "
                "a larger %s) to batch them",
                " and ".join(asked),
                "batches" if len(asked) == 1 else "batch",
                at.parallel.dims.pert,
                len(at.passes),
                _n("pert"),
                _n("dp"),
            )
    return groups, largest


def scratch_sizes(
    model: nn.Module,
    layouts: list[BucketLayout],
    resident_layout: BucketLayout,
    perturb_scope: str,
    full_tuning: bool,
) -> tuple[int, int]:
    """(the block scratch's elements, the resident scratch's own; 0 where its sides take
    turns in the block's): what ``_bind_scratch`` allocates and the memory plan counts.
    The module scope's scratch holds the largest module and the sides in vocabulary
    slices (``vocab_slices``); an untied head's sides share a whole-block scratch under
    full tuning (``share_block_scratch``); otherwise each has its own."""
    if perturb_scope == "module" and full_tuning:
        return shared_scratch_numel(model, layouts, resident_layout), 0
    sides = resident_sides(resident_layout, model)
    largest = max(layout.numel for layout in layouts)
    if share_block_scratch(sides, full_tuning):
        return max(largest, scratch_numel(sides)), 0
    return largest, scratch_numel(sides)


# Set on a model once an engine binds its parameters to that engine's scratch buckets.
BOUND = "_distzo_bound_to_an_engine"


def check_unbound(model: nn.Module) -> None:
    """Refuse a model whose parameters another engine bound: they are views of that
    engine's scratch (the last perturbed block's values, or a slice of a module), not the
    model's weights, so a second engine would pack garbage without a word."""
    if getattr(model, BOUND, False):
        raise ValueError(
            "this model is already bound to a ZOEngine (its parameters are views of that "
            "engine's scratch, not its weights); build the new engine on a freshly loaded "
            "model (from_pretrained, or a run's export), or keep using the first engine"
        )


def _bind_scratch(
    model: nn.Module, tuning: Tuning, trained: StoredBuckets, at: Placement, dtype: torch.dtype
) -> tuple[torch.Tensor, ModuleScratch | None, ResidentScratch | SlicedResident]:
    """The scratch buckets (the block's bound module by module, if so) and the model bound
    to them."""
    device, layouts = at.device, trained.block_layouts
    # One scratch bucket serves every block: blocks compute one after another on one
    # stream. Scratch holds the perturbed weights in the compute dtype (AMP).
    module_scratch = None
    resident: ResidentScratch | SlicedResident
    scope, full_tuning = at.config.perturb_scope, not tuning.base_layouts
    numel, _ = scratch_sizes(model, layouts, trained.resident_layout, scope, full_tuning)
    if scope == "module":
        # the blocks' modules and the resident sides take turns in one scratch
        block_scratch = torch.zeros(numel, device=device, dtype=dtype)
        module_scratch = ModuleScratch(model, layouts, block_scratch)
        resident = SlicedResident(
            model, sliced_sides(trained.resident_layout, model), block_scratch
        )
    else:
        block_scratch = bound_scratch(model, layouts, device, dtype, numel)
        sides = resident_sides(trained.resident_layout, model)
        shared = share_block_scratch(sides, full_tuning)
        resident = ResidentScratch(model, sides, device, dtype, block_scratch if shared else None)
    tuning.bind_base(model, device, dtype)
    return block_scratch, module_scratch, resident


def describe(engine: ZOEngine, dtype: torch.dtype) -> str:
    """One line of what was built (mode, dtypes, sizes, and how the blocks travel where they
    do), for the log."""
    config, frozen = engine.config, engine.num_frozen
    queries = config.num_queries
    of_all = f" (of {format_count(engine.num_parameters + frozen)}: a frozen base)"
    rebuilt = ", masters rebuilt per pass" if engine.rebuilt is not None else ""
    if engine.streamed_store.double_buffered:
        rebuilt = ", masters in two buffers, upcast and rounded beside the compute"
    if engine.module_scratch is not None:
        scratch = engine.block_scratch
        rebuilt += (
            f", blocks perturbed module by module "
            f"({format_bytes(scratch.numel() * scratch.element_size())} scratch)"
        )
        slices = engine.resident.num_slices if isinstance(engine.resident, SlicedResident) else 0
        if slices:
            rebuilt += f", the vocabulary in {slices} slice{'s' if slices > 1 else ''}"
    compute = f"{str(dtype).replace('torch.', '')} compute"
    # A resident model never travels: no transfer, wire format, slots or host copy to name.
    if config.mode == "resident":
        layout, slots, stored = f"({compute}{rebuilt})", "", ""
    else:
        wire = f"{engine.transfer} transfer, {config.transfer_dtype} on the wire"
        layout = f"({wire}{rebuilt}, {compute})"
        slots = f", {counted(engine.streamed_store.num_slots, 'slot')}"
        stored = f", {format_bytes(engine.host_bytes)} host"
    return (
        f"ZO engine: {config.mode} mode {layout} on {engine.device}, "
        f"{counted(len(engine.blocks), 'block')}{slots}, "
        f"{format_count(engine.num_parameters)} trained parameters"
        f"{of_all if engine.frozen_base else ''}{stored}, "
        f"{config.estimator}, {queries} quer{'y' if queries == 1 else 'ies'} per step"
        f"{noise_note(engine)}"
    )


def noise_note(engine: ZOEngine) -> str:
    """Where the noise comes from torch ops though a kernel draws it faster: the C kernel
    not built (an install without a C compiler, whose warning pip hides) or Triton not
    installed. The same bits, several times slower: said in the run's log, not left for a
    slow run to be puzzled over."""
    if engine.noise.backend != "torch":
        return ""
    if engine.device.type == "cpu":
        return (
            ", noise from torch ops (the C kernel was not built: reinstall distzo where a C "
            "compiler is found, for noise about 10x faster)"
        )
    if engine.device.type == "cuda":
        return ", noise from torch ops (Triton is not installed: pip install 'distzo[cuda]')"
    return ""
