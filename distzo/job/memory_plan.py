"""The memory a run will take, computed from the bucket layouts before anything is allocated.

Rank 0 prints it at start-up, and the run refuses to start (one line) when it does not
fit the free device memory or the host memory it sees, unless ``--force``. The
figures are the engine's own allocations (buckets, slots, staging, scratch, the noise
workspaces), so on CUDA they can be checked against ``torch.cuda.memory_allocated``;
the activation figure is an estimate of the largest transient (the bigger of one
block's intermediates, for one micro-batch under --grad-accum, and the fp32 logits of one
head chunk: the head runs at most
``HEAD_CHUNK`` positions at a time). Host memory is pinned at exactly its size, so
the host figure is what a CUDA run locks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from distzo.config.engine_options import ZOConfig
from distzo.engine import split_layouts, unwrap_peft
from distzo.models import family_for
from distzo.objectives import HEAD_CHUNK
from distzo.offload.bucket import ALIGN_ELEMENTS, round_up
from distzo.offload.low_bit import COMPUTE_DTYPES, TRANSFER_DTYPES
from distzo.runtime.host_memory import available_host_bytes
from distzo.zo.moments import MomentRule
from distzo.zo.noise import planned_noise_bytes, workspace_elements

logger = logging.getLogger(__name__)
GB = 1e9


@dataclass(frozen=True)
class MemoryPlan:
    parameters: int
    host_bytes: int  # this rank's host copy of the blocks
    device_resident: int  # the resident bucket and its scratch
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

    @property
    def device_bytes(self) -> int:
        """What the engine allocates (activations excluded)."""
        return (
            self.device_resident
            + self.device_blocks
            + self.device_scratch
            + self.state_device_bytes
        )

    def describe(self) -> str:
        return (
            f"{self.parameters / 1e9:.3f} B parameters"
            + (
                f" trained on a frozen base of {self.frozen_parameters / 1e9:.3f} B"
                if self.frozen_parameters
                else ""
            )
            + f"; host {self.host_bytes / GB:.2f} GB per rank; "
            f"device {self.device_bytes / GB:.2f} GB (resident {self.device_resident / GB:.2f}, blocks/slots "
            f"{self.device_blocks / GB:.2f}, scratch {self.device_scratch / GB:.2f}"
            + (
                f", optimizer state {self.state_device_bytes / GB:.2f}"
                if self.state_device_bytes
                else ""
            )
            + ") + activations ~"
            f"{self.activations / GB:.2f} GB"
            + (
                f"; optimizer state {self.state_host_bytes / GB:.2f} GB host per rank"
                if self.state_host_bytes
                else ""
            )
            + f"; a checkpoint save +{self.checkpoint_bytes / GB:.2f} GB host per node"
        )


def _width(config, *names: str, default: int = 0) -> int:
    for name in names:
        value = getattr(config, name, None)
        if value:
            return int(value)
    return default


def plan_memory(
    model: nn.Module,
    config: ZOConfig,
    shard_size: int,
    sliced: bool,
    batch: int,
    seq: int,
    signs: int,
    world: int = 1,
    local_ranks: int = 1,
    async_save: bool = True,
) -> MemoryPlan:
    """The plan of ``ZOEngine(model, config)`` on one rank (the model may be a meta skeleton).

    ``world`` and ``local_ranks`` place the rank in the job, for the checkpoint's copies:
    block i is copied by one rank (i % world, or under the sliced transfer a member of
    node i % nodes), plus the resident bucket on rank 0. A synchronous save
    (``async_save`` False; the final save always is) copies only what does not already
    rest in host memory.
    """
    model, _ = unwrap_peft(model)
    blocks_of_model = family_for(model).blocks()
    (built, (resident, _)), frozen_layouts = split_layouts(model, blocks_of_model)
    layouts = [layout for layout, _ in built]
    # What streams: the whole blocks, or under an adapter the frozen base (read-only; the
    # adapter's buckets stay on the device, with the frozen resident modules).
    frozen = frozen_layouts is not None
    if frozen:
        base_built, (resident_base, _) = frozen_layouts
        streamed = [layout for layout, _ in base_built]
    else:
        streamed = layouts
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
    padded = [round_up(l.numel, owners * chunks * ALIGN_ELEMENTS) for l in streamed]
    largest = max(padded)
    device_type = config.torch_device().type
    noise = planned_noise_bytes(config.noise_chunk, master, device_type, config.noise)
    state_wire = 2 if config.state_dtype == "bf16" else master
    if (
        wire != master or state_wire != master
    ) and not frozen:  # stochastic rounding's uniforms, float32
        noise += planned_noise_bytes(config.noise_chunk, 4, device_type, config.noise)
    if config.mode == "offload":
        host = sum(padded) // owners * wire
        blocks = config.num_slots * largest * (master + (wire if wire != master else 0))
    else:
        host, blocks = 0, sum(l.numel for l in streamed) * master
    scratch = max(l.numel for l in layouts) * compute
    resident_bytes = resident.numel * (master + compute)
    if frozen:
        blocks += sum(l.numel for l in layouts) * master  # the adapter's block buckets
        scratch += max(l.numel for l in streamed) * compute  # the base's copy in the compute dtype
        resident_bytes += resident_base.numel * (master + (compute if compute != master else 0))
    state_host, state_device = _state_bytes(
        config,
        resident.numel,
        layouts,
        padded,
        owners,
        master,
        state_wire,
        streams=config.mode == "offload" and not frozen,
    )
    cfg = model.config
    hidden = _width(cfg, "hidden_size", "n_embd")
    ffn = _width(cfg, "intermediate_size", "ffn_dim", "n_inner", default=4 * hidden)
    heads = _width(cfg, "num_attention_heads", "n_head", default=1)
    vocab = _width(cfg, "vocab_size")
    tokens = batch * seq
    micro = -(-batch // config.grad_accum)  # a block runs one micro-batch at a time (the largest)
    block_tmp = micro * seq * (4 * hidden + 2 * ffn) * compute + micro * heads * seq * seq * compute
    # the LM head runs on at most HEAD_CHUNK positions at a time: their logits, fp32 copy and log-softmax
    logits = min(tokens, HEAD_CHUNK) * vocab * (compute + 2 * 4)
    live_hiddens = (
        signs * config.num_queries
    )  # one hidden state per pass (all its micro-batches) crosses the blocks
    activations = live_hiddens * tokens * hidden * compute + max(block_tmp, logits)
    at_rest = [
        l.numel * (wire if config.mode == "offload" and not frozen else master) for l in layouts
    ]
    sliced = sliced and not frozen  # an adapter's state is whole on every rank
    if sliced:  # each node's shard group writes every (world / n)-th block
        node_blocks = -(-len(layouts) // max(world // shard_size, 1))
    else:
        node_blocks = min(len(layouts), -(-len(layouts) // world) * local_ranks)
    on_device = config.torch_device().type != "cpu"
    copies_blocks = async_save or sliced or ((config.mode == "resident" or frozen) and on_device)
    moments = config.num_moments
    # a stored optimizer's moments are saved beside the weights, in their at-rest dtype
    state_rest = [
        l.numel * (state_wire if config.mode == "offload" and not frozen else master)
        for l in layouts
    ]
    checkpoint = (
        (sum(sorted(at_rest, reverse=True)[:node_blocks]) if copies_blocks else 0)
        + (resident.numel * master if async_save or on_device else 0)
        + moments
        * (
            (sum(sorted(state_rest, reverse=True)[:node_blocks]) if copies_blocks else 0)
            + (resident.numel * master if async_save or on_device else 0)
        )
    )
    return MemoryPlan(
        parameters=resident.num_parameters + sum(l.num_parameters for l in layouts),
        host_bytes=host,
        device_resident=resident_bytes,
        device_blocks=blocks,
        device_scratch=scratch + noise,
        activations=activations,
        checkpoint_bytes=checkpoint,
        frozen_parameters=(resident_base.num_parameters + sum(l.num_parameters for l in streamed))
        if frozen
        else 0,
        state_host_bytes=state_host,
        state_device_bytes=state_device,
    )


def _state_bytes(
    config: ZOConfig,
    resident_numel: int,
    layouts,
    padded: list[int],
    owners: int,
    master: int,
    state_wire: int,
    streams: bool,
) -> tuple[int, int]:
    """(host, device) bytes of a stored optimizer's moments, as the engine allocates them:
    beside the resident bucket on the device; beside streamed blocks as host shards in
    the state dtype with K slots of their own (+ bf16 staging), else on the device; plus
    the update's scratch (one noise piece for ghat, one more for Adam's denominator)."""
    moments = config.num_moments
    if not moments:
        return 0, 0
    if streams:
        host = moments * (sum(padded) // owners) * state_wire
        blocks = (
            moments
            * config.num_slots
            * max(padded)
            * (master + (state_wire if state_wire != master else 0))
        )
    else:
        host, blocks = 0, moments * sum(l.numel for l in layouts) * master
    scratch = (
        MomentRule.of(config).scratch_pieces
        * workspace_elements(config.noise_chunk, config.torch_device().type, config.noise)
        * master
    )
    return host, moments * resident_numel * master + blocks + scratch


def check_fits(plan: MemoryPlan, device: torch.device, local_ranks: int, force: bool) -> None:
    """Refuse a plan that cannot fit, before anything is allocated (``force`` overrides)."""
    problems = []
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        need = plan.device_bytes + plan.activations
        if need > free:
            problems.append(
                f"{need / GB:.1f} GB of device memory, {free / GB:.1f} GB free on {device}"
            )
        host_need = (plan.host_bytes + plan.state_host_bytes) * local_ranks + plan.checkpoint_bytes
    else:  # on CPU the "device" buffers are host memory too
        host_need = (
            plan.host_bytes + plan.state_host_bytes + plan.device_bytes + plan.activations
        ) * local_ranks + plan.checkpoint_bytes
    available = available_host_bytes()
    if available is not None and host_need > available:
        problems.append(
            f"{host_need / GB:.1f} GB of host memory for {local_ranks} local ranks and a checkpoint save, "
            f"{available / GB:.1f} GB available"
        )
    if problems and not force:
        raise ValueError(
            f"the run does not fit: it needs {'; '.join(problems)}. Lower --num-slots or the batch, use a low-bit "
            "--transfer-dtype or --transfer sliced, fewer --model-layers, or pass --force to start anyway"
        )
    for problem in problems:
        logger.warning("starting anyway (--force): the plan needs %s", problem)
