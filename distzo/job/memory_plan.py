"""The memory a run will take, computed from the bucket layouts before anything is allocated.

Rank 0 prints it at start-up, and the run refuses to start (one line) when it does not
fit the free device memory or the host memory it sees, unless ``--force``. The
figures are the engine's own allocations (buckets, slots, staging, scratch, the noise
workspaces), so on CUDA they can be checked against ``torch.cuda.memory_allocated``;
the activation figure is an estimate of the largest transient (the bigger of one
block's intermediates, for one micro-batch under --grad-accum and --micro-batch-rows
times the passes batched together or for an evaluation forward, which runs whole, and
the fp32 logits of one head chunk: the head runs at most ``HEAD_CHUNK`` positions at a
time). Beside the engine's own: the attention masks a
forward keeps, and on a CUDA job of several ranks NCCL's buffers (from the NCCL
variables in the environment). A refusal names the largest term of what does not
fit. Host memory is pinned at exactly its size, so the host figure is what a CUDA
run locks.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from distzo.config.engine_options import ZOConfig
from distzo.engine import split_layouts, unwrap_peft
from distzo.engine.parts import scratch_sizes
from distzo.engine.passes import micro_batch_count, pass_grouping
from distzo.export.hf_model import export_shapes, shard_plan
from distzo.export.multimodal import multimodal_shapes
from distzo.models import family_for
from distzo.models.config_file import ModelSize
from distzo.models.multimodal import MultimodalOrigin, origin_of
from distzo.objectives import HEAD_CHUNK
from distzo.offload.bucket import ALIGN_ELEMENTS, BucketLayout, round_up
from distzo.offload.low_bit import COMPUTE_DTYPES, TRANSFER_DTYPES
from distzo.runtime.host_memory import available_host_bytes
from distzo.runtime.units import format_bytes, format_count
from distzo.zo.estimators import Pass, rank_share
from distzo.zo.lowrank import Segment, planned_lowrank_bytes, segments
from distzo.zo.lowrank_momentum import scratch_elements, state_elements
from distzo.zo.moments import MomentRule
from distzo.zo.noise import planned_noise_bytes, workspace_elements

if TYPE_CHECKING:
    from distzo.dist.parallel_context import ParallelContext

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryPlan:
    parameters: int
    host_bytes: int  # this rank's host copy of the blocks
    device_resident: int  # the resident bucket and its scratch, unless it shares the block's
    device_blocks: int  # resident-mode block masters, or the K slots (+ staging)
    device_scratch: int  # the block scratch bucket and the noise workspaces
    activations: int  # estimate of the largest transient
    checkpoint_bytes: int = (
        0  # host copies a checkpoint save makes on this node (one writer per block)
    )
    frozen_parameters: int = (
        0  # a frozen base under an adapter (``parameters`` are the trained ones)
    )
    state_host_bytes: int = 0  # this rank's host shards of a stored optimizer's moments
    state_device_bytes: int = (
        0  # the moments on the device (or their slots) and the update's scratch
    )
    device_masks: int = 0  # the attention masks a forward keeps (per micro-batch, group size)
    device_comm: int = 0  # NCCL's buffers (and NVLS's) for the communicators the job uses
    export_bytes: int = 0  # rank 0's host copies while the export writes its largest shard

    @property
    def device_bytes(self) -> int:
        """What the engine allocates (activations excluded)."""
        return (
            self.device_resident
            + self.device_blocks
            + self.device_scratch
            + self.state_device_bytes
        )

    def device_terms(self) -> dict[str, int]:
        """Every device term by its name in the log line and a refusal (zeros left out)."""
        terms = {
            "resident": self.device_resident,
            "blocks/slots": self.device_blocks,
            "scratch": self.device_scratch,
            "optimizer state": self.state_device_bytes,
            "attention masks": self.device_masks,
            "NCCL buffers": self.device_comm,
            "activations": self.activations,
        }
        return {name: size for name, size in terms.items() if size}

    @property
    def device_need(self) -> int:
        """Everything the plan puts on the device: what the engine allocates, the masks,
        NCCL's buffers and the activation estimate."""
        return sum(self.device_terms().values())

    def describe(self) -> str:
        """The log line: each figure in the unit that fits (``distzo.runtime.units``)."""
        b = format_bytes
        frozen = self.frozen_parameters
        terms = self.device_terms()
        activations = terms.pop("activations", 0)
        device_parts = [
            f"{name} {b(size)}"
            for name, size in terms.items()
            if size or name in ("resident", "blocks/slots", "scratch")
        ]
        return (
            f"{format_count(self.parameters)} parameters"
            + (f" trained on a frozen base of {format_count(frozen)}" if frozen else "")
            + f"; host {b(self.host_bytes)} per rank; device {b(self.device_need - activations)} "
            f"({', '.join(device_parts)}) + activations ~{b(activations)}"
            + (
                f"; optimizer state {b(self.state_host_bytes)} host per rank"
                if self.state_host_bytes
                else ""
            )
            + f"; a checkpoint save +{b(self.checkpoint_bytes)} host per node"
            + (f"; the export +{b(self.export_bytes)} host on rank 0" if self.export_bytes else "")
        )


def _width(config, *names: str, default: int = 0) -> int:
    for name in names:
        value = getattr(config, name, None)
        if value:
            return int(value)
    return default


@dataclass(frozen=True)
class _Buckets:
    """The buckets a plan counts, and the bytes per element each kind takes."""

    trained: list[BucketLayout]  # the block buckets of what a step trains
    resident: BucketLayout  # the resident bucket of what a step trains
    resident_scratch: int  # its scratch's elements (the larger side; 0: in the block's)
    block_scratch: int  # the block scratch's elements (``parts.scratch_sizes``)
    streamed: list[BucketLayout]  # what streams: the blocks, or an adapter's frozen base
    resident_base: BucketLayout | None  # an adapter's frozen resident modules
    master: int
    compute: int
    wire: int  # blocks at rest in host memory and on the link
    state_wire: int  # a stored optimizer's moments at rest
    owners: int  # ranks that each hold a share of a streamed block (sliced transfer)
    padded: list[int]  # each streamed block's elements, padded for its owners' chunks
    # The resident bucket's then each trained block's low-rank segments (``segments``),
    # cut once for the noise's buffers and LOZO-M's factors, state and save (empty when
    # the noise is not lowrank)
    lowrank_segments: list[tuple[Segment, ...]]

    @property
    def frozen(self) -> bool:
        return self.resident_base is not None


def _buckets(model: nn.Module, config: ZOConfig, shard_size: int, sliced: bool) -> _Buckets:
    """The engine's bucket layouts of ``model`` (already unwrapped from peft)."""
    (built, (resident, _)), frozen_layouts = split_layouts(model, family_for(model).blocks())
    trained = [layout for layout, _ in built]
    streamed, resident_base = trained, None
    if frozen_layouts is not None:
        base_built, (resident_base, _) = frozen_layouts
        streamed = [layout for layout, _ in base_built]
    master = resident.dtype.itemsize
    compute = (
        master if config.compute_dtype == "auto" else COMPUTE_DTYPES[config.compute_dtype].itemsize
    )
    wire = (
        master
        if config.transfer_dtype == "fp32"
        else TRANSFER_DTYPES[config.transfer_dtype].itemsize
    )
    owners = shard_size if sliced else 1
    chunks = config.transfer_chunks if owners > 1 else 1
    padded = [round_up(b.numel, owners * chunks * ALIGN_ELEMENTS) for b in streamed]
    state_wire = 2 if config.state_dtype == "bf16" else master
    block_scratch, resident_scratch = scratch_sizes(
        model, trained, resident, config.perturb_scope, full_tuning=resident_base is None
    )
    lowrank = config.noise == "lowrank" or config.lowrank_state
    cut = [segments(b, config.lozo_rank) for b in (resident, *trained)] if lowrank else []
    return _Buckets(
        trained,
        resident,
        resident_scratch,
        block_scratch,
        streamed,
        resident_base,
        master,
        compute,
        wire,
        state_wire,
        owners,
        padded,
        cut,
    )


@dataclass(frozen=True)
class RankPlace:
    """Where the planned rank sits in the job. ``pert`` ranks share each step's passes,
    this one running its ``pert_rank`` share (``ParallelContext.own_passes``: one hidden
    state per pass crosses the blocks); ``world`` ranks, ``local_ranks`` to a node, this one
    on ``node`` (torchrun's GROUP_RANK; rank 0 is on node 0), for the checkpoint's copies on
    its node and NCCL's buffers."""

    pert: int = 1
    pert_rank: int = 0
    world: int = 1
    local_ranks: int = 1
    node: int = 0

    @classmethod
    def of(cls, parallel: ParallelContext) -> RankPlace:
        """The place of this process's rank, as the trainer built its context."""
        env = parallel.env
        return cls(
            parallel.dims.pert,
            parallel.pert_rank,
            env.world_size,
            env.local_world_size,
            env.node_rank,
        )

    def saved_blocks(self, count: int, sliced: bool, shard_size: int) -> list[int]:
        """The blocks a save copies on this node, as ``Checkpointer._state`` shares them
        out: block i from rank i % world (torchrun numbers a node's ranks in a row), or
        under the sliced transfer (shard groups of ``shard_size``) from node i % nodes."""
        if sliced:
            nodes = max(self.world // shard_size, 1)
            return [i for i in range(count) if i % nodes == self.node]
        return [i for i in range(count) if (i % self.world) // self.local_ranks == self.node]


ONE_RANK = RankPlace()


@dataclass(frozen=True)
class PlannedExport:
    """The run's final export on rank 0: ``--export-shard-size`` and ``--merge-adapter``."""

    shard_size: int | str
    merge_adapter: bool = False


def plan_memory(
    model: nn.Module,
    config: ZOConfig,
    shard_size: int,
    sliced: bool,
    batch: int,
    seq: int,
    *,
    place: RankPlace = ONE_RANK,
    async_save: bool = True,
    device_type: str | None = None,
    export: PlannedExport | None = None,
    eval_rows: int = 0,
) -> MemoryPlan:
    """The plan of ``ZOEngine(model, config)`` on the rank at ``place`` (the model may be a
    meta skeleton). A checkpoint copies block i by one rank (``RankPlace.saved_blocks``)
    plus the resident bucket on rank 0; a synchronous save (``async_save`` False; the
    final save always is) copies only what does not already rest in host memory.
    ``device_type`` is where the engine runs (the config's device when None): "cuda" plans
    a GPU job from a machine without one. ``export`` (None: no export planned) sizes the
    run's final export on rank 0. ``eval_rows``: the rows of one evaluation forward, which
    runs them in one piece whatever --grad-accum (``batch`` must count them too).
    """
    on = device_type or config.torch_device().type
    passes = rank_share(config.step_passes(), place.pert, place.pert_rank)
    model, peft_model = unwrap_peft(model)
    b = _buckets(model, config, shard_size, sliced)
    host, blocks, scratch, resident_bytes = _weight_bytes(b, config)
    scratch += _pass_scratch_bytes(b, config, passes)
    state_host, state_device = _state_bytes(b, config, on)
    frozen_parameters = 0
    if b.resident_base is not None:
        frozen_parameters = b.resident_base.num_parameters + sum(
            layout.num_parameters for layout in b.streamed
        )
    return MemoryPlan(
        parameters=b.resident.num_parameters + sum(layout.num_parameters for layout in b.trained),
        host_bytes=host,
        device_resident=resident_bytes,
        device_blocks=blocks,
        device_scratch=scratch + _noise_bytes(b, config, on),
        activations=_activation_bytes(
            model.config, config, b.compute, batch, seq, passes, eval_rows
        ),
        checkpoint_bytes=_checkpoint_bytes(
            b,
            config,
            sliced and not b.frozen,
            place,
            shard_size,
            async_save,
            on,
        ),
        frozen_parameters=frozen_parameters,
        state_host_bytes=state_host,
        state_device_bytes=state_device,
        device_masks=_mask_bytes(model.config, config, b.compute, batch, seq, passes),
        device_comm=nccl_buffer_bytes(_nccl_groups(on, place, shard_size, sliced)),
        export_bytes=0
        if export is None
        else _export_bytes(
            b, export.shard_size, peft_model is None or export.merge_adapter, origin_of(model)
        ),
    )


def _export_bytes(
    b: _Buckets, max_shard_size: int | str, whole: bool, origin: MultimodalOrigin | None
) -> int:
    """Rank 0's host copies while the export writes: the tensors of its largest shard
    (Hugging Face's split of what it holds, from shapes) and the bucket read beside them,
    in the master dtype. ``whole``: the model (an adapter merged in, or none); otherwise
    the adapter alone. A multimodal checkpoint's (``origin``) export holds its vision
    tower and projector too, as stored."""
    trained = [b.resident, *b.trained]
    if not whole:
        return sum(layout.numel for layout in trained) * b.master
    layouts = trained + ([b.resident_base, *b.streamed] if b.resident_base is not None else [])
    shapes = export_shapes(layouts, merged=b.frozen)
    if origin is not None:
        shapes = multimodal_shapes(origin, shapes)
    files = shard_plan(shapes, max_shard_size).filename_to_tensors.values()
    largest = max(sum(shapes[name].nbytes for name in names) for names in files)
    return largest + max(layout.numel for layout in layouts) * b.master


def _weight_bytes(b: _Buckets, config: ZOConfig) -> tuple[int, int, int, int]:
    """(host, device blocks or slots, device scratch, device resident) bytes of the weights."""
    master, compute, wire = b.master, b.compute, b.wire
    if config.mode == "offload":
        host = sum(b.padded) // b.owners * wire
        # K slots in the wire format; a trained low-bit block is rebuilt in a master
        # buffer while it computes (two where the upload and offload streams fill and empty
        # them; a noise chunk of it at a time, without one); a frozen base's stays in the
        # wire format (read, upcast into its compute scratch)
        biggest = max(b.padded)
        rebuilt = 0
        if b.resident_base is None and wire != master:
            buffers = config.master_buffers
            rebuilt = (buffers * biggest if buffers else min(config.noise_chunk, biggest)) * master
        blocks = biggest * config.num_slots * wire + rebuilt
    else:
        host, blocks = 0, sum(layout.numel for layout in b.streamed) * master
    scratch = b.block_scratch * compute
    resident_bytes = b.resident.numel * master + b.resident_scratch * compute
    if b.resident_base is not None:
        blocks += sum(layout.numel for layout in b.trained) * master  # the adapter's blocks
        # the base's copy in the compute dtype
        scratch += max(layout.numel for layout in b.streamed) * compute
        # the passes' copy on the device; a master in another dtype waits on the host
        resident_bytes += b.resident_base.numel * compute
        host += b.resident_base.numel * master if compute != master else 0
    return host, blocks, scratch, resident_bytes


def _noise_bytes(b: _Buckets, config: ZOConfig, device_type: str) -> int:
    """The noise workspaces, and stochastic rounding's float32 uniforms for a low-bit rest."""
    if config.noise == "lowrank":  # its factors' buffers depend on the matrices' shapes
        noise = planned_lowrank_bytes(
            b.lowrank_segments, config.lozo_rank, config.noise_chunk, b.master, device_type
        )
    else:
        noise = planned_noise_bytes(config.noise_chunk, b.master, device_type, config.noise)
    if (b.wire != b.master or b.state_wire != b.master) and not b.frozen:
        noise += planned_noise_bytes(config.noise_chunk, 4, device_type, config.noise)
    return noise


def _activation_bytes(
    cfg: Any,
    config: ZOConfig,
    compute: int,
    batch: int,
    seq: int,
    passes: tuple[Pass, ...],
    eval_rows: int = 0,
) -> int:
    """An estimate of the largest transient: the live hidden states, plus the bigger of one
    block's intermediates (one micro-batch, --grad-accum's or at most --micro-batch-rows,
    times the passes batched together, or an evaluation's ``eval_rows``: they split a step
    only) and the LM head's logits
    of one chunk."""
    hidden = _width(cfg, "hidden_size", "n_embd")
    ffn = _width(cfg, "intermediate_size", "ffn_dim", "n_inner", default=4 * hidden)
    heads = _width(cfg, "num_attention_heads", "n_head", default=1)
    vocab = _width(cfg, "vocab_size")
    tokens = batch * seq
    # a block runs one micro-batch at a time (the largest), as many as the engine splits into
    micro_batches = micro_batch_count(batch, config.grad_accum, config.micro_batch_rows)
    micro = -(-batch // micro_batches)
    # a group of batched passes (--dual-forward, --batch-queries) runs its micro-batch
    # once per pass in one forward
    micro *= _largest_group(config, passes)
    micro = max(micro, eval_rows)  # an evaluation forward: one pass, never split
    block_tmp = micro * seq * (4 * hidden + 2 * ffn) * compute
    block_tmp += micro * _score_planes(cfg, heads) * seq * seq * compute
    # the LM head runs on at most HEAD_CHUNK positions at a time: their logits, fp32 copy and
    # log-softmax
    logits = min(tokens, HEAD_CHUNK) * vocab * (compute + 2 * 4)
    # one hidden state per pass (all its micro-batches) crosses the blocks: 2q for SPSA,
    # N + 1 for FZOO, a pert rank's share of them
    live_hiddens = len(passes)
    return live_hiddens * tokens * hidden * compute + max(block_tmp, logits)


def _attention(cfg: Any) -> str:
    """The model's attention implementation (transformers' default: sdpa)."""
    return getattr(cfg, "_attn_implementation", None) or "sdpa"


def _score_planes(cfg: Any, heads: int) -> int:
    """(L, L) planes a layer's attention holds per row at once, in the compute dtype: eager
    attention's scores, one per head; sdpa's kernels keep them in tiles, but turn a boolean
    mask into a float bias of one plane (measured on CPU: 55 MB beside eager's 802 MB at
    2 x 12 heads x 2048^2 in fp32); flash attention takes the padding mask as it is."""
    implementation = _attention(cfg)
    if implementation.startswith("flash"):
        return 0
    return heads if implementation == "eager" else 1


def _mask_bytes(
    cfg: Any, config: ZOConfig, compute: int, batch: int, seq: int, passes: tuple[Pass, ...]
) -> int:
    """The attention masks a forward keeps on the device: the model's builders make one
    (rows, 1, L, L) mask per kind of layer (full, sliding) for every micro-batch, for
    passes alone and again for the largest group of passes batched together; boolean
    under sdpa, in the compute dtype under eager attention (worst case: a padded batch;
    an unpadded one needs none under sdpa)."""
    implementation = _attention(cfg)
    if implementation.startswith("flash"):
        return 0  # flash attention reads the (rows, L) padding mask itself
    itemsize = compute if implementation == "eager" else 1
    kinds = len(set(getattr(cfg, "layer_types", None) or ["full"]))
    largest = _largest_group(config, passes)
    groups = 1 + (largest if largest > 1 else 0)
    return kinds * groups * batch * seq * seq * itemsize


def _pass_scratch_bytes(b: _Buckets, config: ZOConfig, passes: tuple[Pass, ...]) -> int:
    """The batched passes' scratch (``Tuning.setup_batched``): one row per pass of the
    largest group, each as wide as the largest block's adapter, in the compute dtype."""
    largest = _largest_group(config, passes)
    if largest < 2 or not b.frozen:  # full tuning refuses batched passes
        return 0
    return largest * max(layout.numel for layout in b.trained) * b.compute


def _largest_group(config: ZOConfig, passes: tuple[Pass, ...]) -> int:
    """The most passes one batched forward runs together (1: each pass alone)."""
    groups_of = pass_grouping(config.dual_forward, config.batch_queries)
    return max((len(group) for group in groups_of(passes)), default=1)


NCCL_BUFFSIZE = 4 << 20  # NCCL's default NCCL_BUFFSIZE: one channel's buffer to one peer
NCCL_CHANNELS = 32  # NCCL's most channels per communicator (NCCL_MAX_NCHANNELS lowers it)
NCCL_NVLS_CHANNELS = 16  # NCCL's default NCCL_NVLS_NCHANNELS


def _nccl_groups(device_type: str, place: RankPlace, shard_size: int, sliced: bool) -> list[int]:
    """The local ranks of each NCCL communicator that carries collectives: the job's
    (the step's all-reduce, evaluation's sums) and, under the sliced transfer, the
    node's shard group; none on CPU or in one process."""
    if device_type != "cuda" or place.world < 2:
        return []
    return [place.local_ranks] + ([shard_size] if sliced else [])


def nccl_buffer_bytes(groups: list[int], environ: Mapping[str, str] | None = None) -> int:
    """NCCL's device buffers on one rank for communicators with ``groups`` local ranks:
    NCCL_BUFFSIZE per channel per ring peer (the previous and the next rank), and under
    NVLS (NVLink SHARP on an NVSwitch node, H100; on unless NCCL_NVLS_ENABLE=0)
    2 x NCCL_BUFFSIZE per NVLS channel per local rank. The environment's settings of
    these variables are read as NCCL reads them."""
    env = os.environ if environ is None else environ
    buffsize = int(env.get("NCCL_BUFFSIZE") or NCCL_BUFFSIZE)
    channels = min(int(env.get("NCCL_MAX_NCHANNELS") or NCCL_CHANNELS), NCCL_CHANNELS)
    nvls_channels = int(env.get("NCCL_NVLS_NCHANNELS") or NCCL_NVLS_CHANNELS)
    nvls = env.get("NCCL_NVLS_ENABLE", "1") != "0"
    total = 0
    for local in groups:
        total += 2 * channels * buffsize
        if nvls and local > 1:
            total += local * nvls_channels * 2 * buffsize
    return total


def _checkpoint_bytes(
    b: _Buckets,
    config: ZOConfig,
    sliced: bool,
    place: RankPlace,
    shard_size: int,
    async_save: bool,
    device_type: str,
) -> int:
    """The host copies a save makes on ``place``'s node: the blocks its ranks write and
    their moments, and on rank 0's node, node 0, the resident bucket; a synchronous save
    reads what already rests on the host. ``sliced``: the blocks are sliced over a shard
    group (an adapter's state is whole on every rank)."""
    numel = sum(b.trained[i].numel for i in place.saved_blocks(len(b.trained), sliced, shard_size))
    offloaded = config.mode == "offload" and not b.frozen
    on_device = device_type != "cpu"
    copies_blocks = async_save or sliced or ((config.mode == "resident" or b.frozen) and on_device)
    # a stored optimizer's moments are saved beside the weights, in their at-rest dtype
    at_rest = numel * (b.wire if offloaded else b.master) if copies_blocks else 0
    state_rest = numel * (b.state_wire if offloaded else b.master) if copies_blocks else 0
    copies_resident = place.node == 0 and (async_save or on_device)
    resident = b.resident.numel * b.master if copies_resident else 0
    # LOZO-M's factors are whole on every rank: rank 0 saves them, as the resident bucket
    factors = (
        _lowrank_state_bytes(config, b.lowrank_segments, b.master)
        if copies_resident and config.lowrank_state
        else 0
    )
    return at_rest + resident + config.num_moments * (state_rest + resident) + factors


def _lowrank_state_bytes(
    config: ZOConfig, segment_lists: list[tuple[Segment, ...]], itemsize: int
) -> int:
    """LOZO-M's factors of the buckets cut into ``segment_lists`` (``LowRankMomentum.states``)."""
    rank = config.lozo_rank
    return itemsize * sum(state_elements(segs, rank) for segs in segment_lists)


def _state_bytes(b: _Buckets, config: ZOConfig, device_type: str) -> tuple[int, int]:
    """(host, device) bytes of a stored optimizer's moments, as the engine allocates them:
    beside the resident bucket on the device; beside streamed blocks as host shards in
    the state dtype with K slots of their own (+ one float32 buffer when low-bit), else on
    the device; plus the update's scratch (one noise piece for ghat, one more for Adam's
    denominator)."""
    moments, master = config.num_moments, b.master
    rule = MomentRule.of(config)
    if config.lowrank_state:  # LOZO-M: each bucket's factors, on the device in every layout
        scratch = master * scratch_elements(b.lowrank_segments, config.lozo_rank)
        return 0, _lowrank_state_bytes(config, b.lowrank_segments, master) + scratch
    if not moments or rule is None:
        return 0, 0
    if config.mode == "offload" and not b.frozen:  # the moments stream beside the blocks
        host = moments * (sum(b.padded) // b.owners) * b.state_wire
        # K slots in the state dtype, and a low-bit moment's master buffers (its blocks')
        rebuilt = config.master_buffers * master if b.state_wire != master else 0
        blocks = moments * max(b.padded) * (config.num_slots * b.state_wire + rebuilt)
    else:
        host, blocks = 0, moments * sum(layout.numel for layout in b.trained) * master
    scratch = (
        rule.scratch_pieces
        * workspace_elements(config.noise_chunk, device_type, config.noise)
        * master
    )
    return host, moments * b.resident.numel * master + blocks + scratch


def _largest(terms: dict[str, int]) -> str:
    """The term that weighs most, for a refusal to name."""
    name = max(terms, key=lambda k: terms[k])
    return f"largest: {name} {format_bytes(terms[name])}"


def host_terms(plan: MemoryPlan, on_device: bool, local_ranks: int) -> dict[str, int]:
    """The host memory of a node by term: each local rank's copies (and, on CPU, its
    "device" terms, which are host memory too), and the larger of a checkpoint save's
    copies and the final export's (the export starts once the final save is written)."""
    copies = {"a checkpoint save": plan.checkpoint_bytes, "the export": plan.export_bytes}
    larger = max(copies, key=lambda name: copies[name])
    terms = {
        "host copy of the blocks": plan.host_bytes * local_ranks,
        "optimizer state": plan.state_host_bytes * local_ranks,
        larger: copies[larger],
    }
    if not on_device:  # added to the host's: the moments' host shards and "device" ones
        for name, size in plan.device_terms().items():
            terms[name] = terms.get(name, 0) + size * local_ranks
    return {name: size for name, size in terms.items() if size}


def check_fits(plan: MemoryPlan, device: torch.device, local_ranks: int, force: bool) -> None:
    """Refuse a plan that cannot fit, before anything is allocated (``force`` overrides);
    the refusal names the largest term of what does not fit."""
    problems = []
    on_device = device.type == "cuda"
    if on_device:
        free, _ = torch.cuda.mem_get_info(device)
        if plan.device_need > free:
            problems.append(
                f"{format_bytes(plan.device_need)} of device memory, {format_bytes(free)} free "
                f"on {device} ({_largest(plan.device_terms())})"
            )
    host = host_terms(plan, on_device, local_ranks)
    available = available_host_bytes()
    if available is not None and sum(host.values()) > available:
        problems.append(
            f"{format_bytes(sum(host.values()))} of host memory for {local_ranks} local ranks "
            f"and a checkpoint save or the export, {format_bytes(available)} available "
            f"({_largest(host)})"
        )
    if problems and not force:
        raise ValueError(
            f"the run does not fit: it needs {'; '.join(problems)}. Lower --num-slots, "
            "--batch-size, --eval-batch-size or --export-shard-size, bound a step's forward "
            "with --micro-batch-rows, use a low-bit --transfer-dtype or --transfer sliced, "
            "fewer --model-layers, or pass --force to start anyway"
        )
    for problem in problems:
        logger.warning("starting anyway (--force): the plan needs %s", problem)


# Host memory a module of a skeleton takes (a Python object and its dicts): 2.9-3.4 KB
# measured for OPT, Llama and GPT-2 layers; the lower figure, as the check is a floor.
SKELETON_MODULE_BYTES = 2500


def fewest_bytes_a_parameter(config: ZOConfig, master: torch.dtype) -> int:
    """The fewest bytes a parameter takes wherever ``config``'s layouts keep it: its
    master's, its rest (low-bit transfer) or its compute copy's, whichever is least."""
    sizes = [master.itemsize]
    if config.transfer_dtype != "fp32":
        sizes.append(TRANSFER_DTYPES[config.transfer_dtype].itemsize)
    if config.compute_dtype != "auto":
        sizes.append(COMPUTE_DTYPES[config.compute_dtype].itemsize)
    return min(sizes)


def node_memory_bytes(device: torch.device) -> tuple[int | None, int]:
    """(host memory available, the node's devices' total memory: 0 on CPU)."""
    on_device = device.type == "cuda"
    count = torch.cuda.device_count() if on_device else 0
    devices = sum(torch.cuda.get_device_properties(i).total_memory for i in range(count))
    return available_host_bytes(), devices


def check_weights_fit(
    size: ModelSize, each: int, device: torch.device, force: bool, where: str
) -> None:
    """Refuse, before its skeleton is built, a model whose weights alone (at ``each`` bytes
    a parameter) and skeleton outgrow the node's host and device memory together: no layout
    of the run needs less, and a config.json of absurd sizes (10**6 layers) built for an
    hour and took the host's memory before the plan (``check_fits``) could say so.
    ``force`` starts anyway, as it does for the plan."""
    host, devices = node_memory_bytes(device)
    need = size.parameters * each + size.modules * SKELETON_MODULE_BYTES
    if host is None or need <= host + devices:
        return
    on = f" and {format_bytes(devices)} on its devices" if devices else ""
    unit = "bytes" if each > 1 else "byte"
    problem = (
        f"{where}: its config.json describes {format_count(size.parameters)} parameters in "
        f"{format_count(size.modules)} modules, at least {format_bytes(need)} ({each} {unit} a "
        f"parameter, {format_bytes(SKELETON_MODULE_BYTES)} a module's skeleton); the host has "
        f"{format_bytes(host)} available{on}"
    )
    if force:
        logger.warning("starting anyway (--force): %s", problem)
        return
    low_bit = " or a low-bit --transfer-dtype" if each > 1 else ""
    raise ValueError(
        f"{problem}. Is its config.json damaged? A model this large needs a larger "
        f"machine{low_bit}; --force starts anyway"
    )
