"""One ZO step over embed -> streamed blocks -> head.

Per step t, with the pending update (t-1, g_0..g_{q-1}, lr) of the previous step:

* the resident bucket (embeddings, head, final norm) gets the pending update, then
  is perturbed out of place into its scratch bucket for each pass;
* each block is uploaded into a device slot, gets the pending update right there (so
  it crosses the link once per step), is perturbed out of place into the one block
  scratch bucket for each pass (query j, sign) and run on that pass's hidden states,
  then offloaded: q queries (n-SPSA) cost 2q forward passes but one transfer;
* the head gives L+_j and L-_j; one all-reduce of ``[L+_0, L-_0, ...]`` (identity in
  one process) gives every rank the same g_j, which become the new pending update.

The module parameters are bound once to the scratch buckets, so the model's own
layers compute with whatever perturbation the scratch currently holds.
"""

from __future__ import annotations

import functools
import itertools
import logging
import secrets
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from distzo.adapters.peft_adapters import install_block_prefixes, is_prefix_tuned
from distzo.config.engine_options import ZOConfig
from distzo.dist import ParallelContext
from distzo.engine.layouts import (
    RESIDENT_BLOCK_ID,
    bucket_range,
    bucket_values,
    split_layouts,
    unwrap_peft,
)
from distzo.engine.updates import PendingUpdate, step_grads
from distzo.models import ModelFamily, family_for
from distzo.models.batched_linear import make_pass_batched
from distzo.models.prefix import BlockPrefix
from distzo.models.weights import WeightSource
from distzo.objectives import LanguageModeling, Objective, PassRunner
from distzo.offload import (
    BlockScheduler,
    BucketLayout,
    ResidentBlocks,
    Shard,
    StreamedBlocks,
    Streams,
    bind,
)
from distzo.offload.bucket import Entry
from distzo.offload.low_bit import COMPUTE_DTYPES, TRANSFER_DTYPES
from distzo.offload.moment_stores import CarriedStore, Moments
from distzo.offload.streamed_blocks import ROUNDING_STREAM
from distzo.zo import (
    NoiseSource,
    Pass,
    drawable,
    identity_kind,
    learning_rate,
    loss_contribution,
    noise_identity,
    passes,
    projected_gradients,
)
from distzo.zo.moments import MomentRule, MomentUpdater

logger = logging.getLogger(__name__)

UNPERTURBED: Pass = (0, 0)  # the pass of an evaluation forward: theta itself
Measured = TypeVar("Measured")


@dataclass(frozen=True)
class StepResult:
    """One step's losses and estimate; with several queries, means over the queries."""

    step: int  # 0-based index of the step just taken
    loss: float  # mean of (L+ + L-) / 2, the loss at theta to first order
    loss_plus: float
    loss_minus: float
    projected_grad: float  # mean of projected_grads
    lr: float
    num_tokens: int  # input tokens this rank processed (all passes count once)
    projected_grads: tuple[float, ...]  # g_j of each query j
    stop: bool = False  # some rank asked to stop after this step (a preemption notice)


def count_tokens(batch: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """(input tokens, label tokens) of a batch, counted where it lies (no device sync for
    a batch on the host). Labels default as in a plain causal LM: every real token.

    The label count of the *global* batch is what each rank passes as ``num_items`` so
    that its loss is a share of the global mean.
    """
    input_ids, mask, labels = batch["input_ids"], batch.get("attention_mask"), batch.get("labels")
    tokens = int(mask.sum()) if mask is not None else input_ids.numel()
    if labels is not None:
        return tokens, int((labels[..., 1:] != -100).sum())
    return tokens, int(mask[..., 1:].sum()) if mask is not None else input_ids[..., 1:].numel()


def resolve_transfer(config: ZOConfig, device: torch.device, parallel: ParallelContext) -> str:
    """none (resident), naive or sliced: ``auto`` is sliced on CUDA + NCCL with several local ranks."""
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


class ZOEngine:
    """MeZO-SGD on a model whose blocks are resident (MeZO) or streamed from host memory (ZO2).

    ``parallel`` places this rank in a torchrun job (DistZO2): which perturbed passes it
    runs, the all-reduce that gives every rank the same g, and the node-local group that
    shares one host copy of the blocks. ``run_seed`` must be equal on every rank (the
    trainer broadcasts it); it defaults to ``config.seed``, else a random draw.
    ``weights`` fills the buckets, one at a time, for a model whose parameters are still on
    the meta device (streaming load, random init of large shapes); without it the model's
    own parameter values are packed. ``objective`` is what a step minimises (default: the
    causal-LM loss on the batch's labels; see ``distzo.objectives``).
    """

    def __init__(
        self,
        model: nn.Module,
        config: ZOConfig,
        family: ModelFamily | None = None,
        parallel: ParallelContext | None = None,
        run_seed: int | None = None,
        weights: WeightSource | None = None,
        objective: Objective | None = None,
    ) -> None:
        config.validate()
        model, self.peft_model = unwrap_peft(model)
        self.objective: Objective = objective if objective is not None else LanguageModeling()
        self.family = family if family is not None else family_for(model)
        self.config = config
        self.device = config.torch_device()
        self.model = model
        self.parallel = parallel if parallel is not None else ParallelContext.single(self.device)
        self.signs = self.parallel.signs
        self.passes = passes(config.num_queries, self.signs)  # (query, sign) this rank runs
        self.transfer = self._resolve_transfer()
        if run_seed is None:
            run_seed = config.seed if config.seed is not None else secrets.randbits(63)
        self.run_seed = int(run_seed)
        self.step_index = 0
        self.pending: PendingUpdate | None = None
        self._backlog: list[
            PendingUpdate
        ] = []  # logged steps to apply before the pending one (catch_up)
        self.recent_steps: tuple[
            tuple[int, tuple[float, ...]], ...
        ] = ()  # momentum: (step, g) newest first
        self._broken: str | None = None

        # ZO takes two forward passes of one function: dropout would make them two functions.
        model.eval()
        self.blocks = self.family.blocks()
        if not self.blocks:
            raise ValueError("the model has no transformer blocks to stream")
        # Prefix tuning: every block carries its own prefix, trained with the block.
        self.prefixes = (
            install_block_prefixes(self.peft_model, self.blocks)
            if is_prefix_tuned(self.peft_model)
            else []
        )
        # The trainable buckets: every parameter, or an adapter's. A frozen base (adapter
        # runs) gets buckets of its own that are only ever read.
        (built, (self.resident_layout, resident_ordered)), frozen = split_layouts(
            model, self.blocks
        )
        model.requires_grad_(False)
        self.block_layouts = [layout for layout, _ in built]
        self.frozen_base = frozen is not None
        if self.frozen_base:
            base_built, (self.resident_base_layout, base_ordered) = frozen
            self.base_layouts = [layout for layout, _ in base_built]
            if not any(layout.numel for layout in [self.resident_layout, *self.block_layouts]):
                raise ValueError(
                    "the adapter has no trainable parameters; check its target modules"
                )
        else:
            base_built, self.base_layouts, self.resident_base_layout = [], [], None
        dtype = self.resident_layout.dtype  # the masters' dtype
        if any(layout.dtype != dtype for layout in [*self.block_layouts, *self.base_layouts]):
            raise ValueError(
                "blocks and resident modules must share one dtype; cast the model first"
            )
        compute_dtype = (
            dtype if config.compute_dtype == "auto" else COMPUTE_DTYPES[config.compute_dtype]
        )
        self._make_noise(dtype)

        # The streamed store holds what crosses the link each step: the whole blocks, or
        # under an adapter the frozen base, uploaded and never written back (the adapter's
        # own buckets are small and stay on the device).
        streamed_layouts = self.base_layouts if self.frozen_base else self.block_layouts
        shard = None
        if config.mode == "offload":
            if self.transfer == "sliced":
                group = self.parallel.shard_group
                shard = Shard(group.group, group.rank, group.size, self.parallel.comm)
            low_bit = (
                None if config.transfer_dtype == "fp32" else TRANSFER_DTYPES[config.transfer_dtype]
            )
            streamed = StreamedBlocks(
                streamed_layouts,
                self.device,
                config.num_slots,
                low_bit,
                shard,
                self.rounding_noise,
                config.transfer_chunks,
                read_only=self.frozen_base,
            )
        else:
            streamed = ResidentBlocks(streamed_layouts, self.device)
        self.base_store = streamed if self.frozen_base else None
        self.store = (
            ResidentBlocks(self.block_layouts, self.device) if self.frozen_base else streamed
        )
        self._fill(self.store, built, weights, sliced=self.state_sliced)
        self._fill(self.base_store, base_built, weights, sliced=self.transfer == "sliced")
        self.resident_master = bucket_values(self.resident_layout, resident_ordered, weights).to(
            self.device
        )
        self._make_moments(shard)

        # One scratch bucket serves every block: blocks compute one after another on one
        # stream. Scratch holds the perturbed weights in the compute dtype (AMP).
        scratch_len = max(l.numel for l in self.block_layouts)
        self.block_scratch = torch.zeros(scratch_len, device=self.device, dtype=compute_dtype)
        self.resident_scratch = torch.zeros(
            self.resident_layout.numel, device=self.device, dtype=compute_dtype
        )
        for layout in self.block_layouts:
            bind(model, layout, self.block_scratch)
        bind(model, self.resident_layout, self.resident_scratch)
        if self.frozen_base:
            # The frozen base of each block is copied into its own scratch once per visit,
            # in the compute dtype, and every pass reads it; the resident base never changes.
            self.base_scratch = torch.zeros(
                max(l.numel for l in self.base_layouts), device=self.device, dtype=compute_dtype
            )
            for layout in self.base_layouts:
                bind(model, layout, self.base_scratch)
            self.resident_base = bucket_values(self.resident_base_layout, base_ordered, weights).to(
                self.device
            )
            base_compute = self.resident_base.to(
                compute_dtype
            )  # the same tensor when the dtypes agree
            bind(model, self.resident_base_layout, base_compute)
            self._resident_base_compute = base_compute
        self._setup_batched_passes(model, compute_dtype)
        self._resident_holds: tuple[int, int, int] | None = (
            None  # (query, sign, step) now in resident_scratch
        )
        model.to(self.device)  # parameters already live on the device; this moves buffers only
        if self.device.type == "cuda":
            # The buffers were filled on the default stream; the three streams start after that.
            torch.cuda.current_stream(self.device).synchronize()

        self.streams = Streams(self.device)
        self.scheduler = BlockScheduler(self.streamed_store, self.streams, len(self.blocks))
        if self.prefixes and self.prefixes[0].init_tokens is not None:
            self._init_prefixes_from_activations(self.prefixes[0].init_tokens)
        logger.info(
            "ZO engine: %s mode (%s transfer, %s on the wire, %s compute) on %s, %d blocks, %d slots, "
            "%.1f M trained parameters%s, %.1f MB host, %d quer%s per step",
            config.mode,
            self.transfer,
            config.transfer_dtype,
            str(compute_dtype).replace("torch.", ""),
            self.device,
            len(self.blocks),
            self.streamed_store.num_slots,
            self.num_parameters / 1e6,
            f" (of {(self.num_parameters + self.num_frozen) / 1e6:.1f} M: a frozen base)"
            if self.frozen_base
            else "",
            self.host_bytes / 1e6,
            config.num_queries,
            "y" if config.num_queries == 1 else "ies",
        )

    def _init_prefixes_from_activations(self, token_ids: torch.Tensor) -> None:
        """MeZO's prefix init (``prefix_init_by_real_act``): each layer's prefix becomes the
        keys and values that layer computes for ``token_ids`` (random tokens drawn from the
        run seed) in one unperturbed pass of the model without a prefix."""
        for prefix in self.prefixes:
            prefix.capture = True
        self.forward({"input_ids": token_ids})
        # On the compute stream, which wrote the captured keys and values (they were never
        # handed to the caller's stream) and which updates the adapter's buckets.
        with torch.no_grad(), self.streams.compute_scope():
            for i, prefix in enumerate(self.prefixes):
                captured = prefix.take_captured()
                prefix.init_tokens = None
                (entry,) = (
                    e for e in self.block_layouts[i].entries if ".prefix_tuning." in e.names[0]
                )
                bucket = self.store.device_bucket(i)
                bucket[entry.offset : entry.offset + entry.numel].copy_(captured.reshape(-1))

    def _resolve_transfer(self) -> str:
        return resolve_transfer(self.config, self.device, self.parallel)

    def _setup_batched_passes(self, model: nn.Module, compute_dtype: torch.dtype) -> None:
        """P-RGE's batched passes: the passes of a group share one forward, the batch
        duplicated per pass, and every trained LoRA factor computes its slice of the batch
        with that pass's perturbed weights (``PassBatchedLinear``), held side by side in
        ``pass_scratch``; the frozen base is read once for the whole group."""
        self.pass_groups_of = _pass_grouping(self.config.dual_forward, self.config.batch_queries)
        self._batched_factors: list[list[tuple[nn.Module, Entry]]] = []
        self.pass_scratch = None
        largest = max(len(g) for g in self.pass_groups_of(self.passes))
        if largest == 1:
            return
        if not self.frozen_base or self.resident_layout.numel:
            raise ValueError(
                "--dual-forward and --batch-queries need an adapter that trains only inside the blocks "
                "(--peft lora, lora-fa or prefix); drop them for full tuning"
            )
        for layout in self.block_layouts:
            factors = []
            for e in layout.entries:
                owner, _, attr = e.names[0].rpartition(".")
                module = model.get_submodule(owner)  # a prefix reads ``stacked`` itself
                factors.append(
                    (
                        module
                        if isinstance(module, BlockPrefix)
                        else make_pass_batched(module, attr),
                        e,
                    )
                )
            self._batched_factors.append(factors)
        self.pass_scratch = torch.zeros(
            largest,
            max(l.numel for l in self.block_layouts),
            device=self.device,
            dtype=compute_dtype,
        )

    @staticmethod
    def _fill(store, built, weights: WeightSource | None, sliced: bool) -> None:
        """Each block's initial values into ``store``, one block in memory at a time."""
        for i, (layout, ordered) in enumerate(built):
            if weights is not None and sliced:
                # Read only this rank's share of the block from the checkpoint.
                store.load_block_ranges(i, functools.partial(bucket_range, layout, weights))
            else:
                store.load_block(i, bucket_values(layout, ordered, weights))

    def _make_moments(self, shard: Shard | None) -> None:
        """Stored optimizer state (Adam, a stored momentum): zeroed moment buckets beside the
        resident bucket and the blocks, in host shards streamed with the blocks when the
        blocks stream (sliced like them), else on the device; none for ZO-SGD."""
        self.moment_rule = MomentRule.of(self.config)
        self.moment_updater = (
            MomentUpdater(self.moment_rule, self.noise) if self.moment_rule else None
        )
        self._carried: CarriedStore | None = None
        names = self.moment_rule.names if self.moment_rule else ()
        resident = [torch.zeros_like(self.resident_master) for _ in names]
        if self.config.mode == "offload" and not self.frozen_base:
            state_dtype = torch.bfloat16 if self.config.state_dtype == "bf16" else None
            blocks = [
                StreamedBlocks(
                    self.block_layouts,
                    self.device,
                    self.config.num_slots,
                    state_dtype,
                    shard,
                    self.rounding_noise,
                    self.config.transfer_chunks,
                    rounding_stream=ROUNDING_STREAM * (2 + k),
                )
                for k in range(len(names))
            ]
            if blocks:
                self._carried = CarriedStore(self.store, blocks)
        else:
            blocks = [ResidentBlocks(self.block_layouts, self.device) for _ in names]
        self.moments = Moments(names, resident, blocks)

    @property
    def streamed_store(self):
        """The store whose blocks the scheduler moves: the frozen base under an adapter,
        the blocks with their moments when those travel too."""
        if self.base_store is not None:
            return self.base_store
        return self._carried if self._carried is not None else self.store

    @property
    def state_sliced(self) -> bool:
        """Whether the trained state is split over the node's ranks (the sliced transfer of
        whole blocks); an adapter's state is small and whole on every rank."""
        return self.transfer == "sliced" and not self.frozen_base

    @property
    def host_bytes(self) -> int:
        """The host copy of the streamed blocks (optimizer state apart: ``state_host_bytes``)."""
        return (self.base_store or self.store).host_bytes

    @property
    def device_bytes(self) -> int:
        """Block masters or slots (and an adapter's buckets and base scratch); optimizer
        state apart (``state_device_bytes``)."""
        frozen = 0
        if self.frozen_base:
            frozen = (
                self.store.device_bytes
                + self.base_scratch.numel() * self.base_scratch.element_size()
            )
        return (self.base_store or self.store).device_bytes + frozen

    @property
    def link_bytes_per_step(self) -> int:
        """Bytes this rank uploads over the host link in a training step (and offloads, unless
        the blocks are a frozen base): every streamed block once, with its moments; 0 resident."""
        return sum(self.streamed_store.link_bytes(i) for i in range(len(self.blocks)))

    @property
    def state_host_bytes(self) -> int:
        """The moments' host shards (stored optimizer state of streamed blocks)."""
        return self.moments.host_bytes

    @property
    def state_device_bytes(self) -> int:
        """The moments on the device (resident bucket's, blocks' or their slots) and the update's scratch."""
        return self.moments.device_bytes + (
            self.moment_updater.device_bytes if self.moment_updater else 0
        )

    def _make_noise(self, dtype: torch.dtype) -> None:
        kind = self.config.noise
        self.noise = NoiseSource(
            self.run_seed, self.config.noise_chunk, self.device, dtype, kind=kind
        )
        # A separate source (own stream and workspace) for rounding: it runs on the
        # offload stream, concurrently with the compute stream's perturbations. A frozen
        # base is never written back, so it never rounds.
        self.rounding_noise = (
            NoiseSource(
                self.run_seed,
                self.config.noise_chunk,
                self.device,
                torch.float32,
                "uniform",
                kind=kind,
            )
            if self.config.rounds_on_host and not self.frozen_base
            else None
        )

    # ------------------------------------------------------------------ public API

    @property
    def num_parameters(self) -> int:
        """The parameters a step perturbs and updates (an adapter's alone, under one)."""
        return self.resident_layout.num_parameters + sum(
            l.num_parameters for l in self.block_layouts
        )

    @property
    def num_frozen(self) -> int:
        """The parameters of a frozen base (0 without an adapter)."""
        if not self.frozen_base:
            return 0
        return self.resident_base_layout.num_parameters + sum(
            l.num_parameters for l in self.base_layouts
        )

    def step(
        self, batch: Mapping[str, torch.Tensor], num_items: int | None = None, stop: bool = False
    ) -> StepResult:
        """One ZO-SGD step on ``batch``, in the form the objective reads (for the default
        ``lm``: ``input_ids``, optional ``attention_mask``/``labels``).

        ``num_items`` is what the objective averages over (label tokens, examples) in the
        *global* batch; it defaults to this batch's, which is right in one process.
        ``stop``: this rank's vote to stop after this step, carried by the step's one
        all-reduce, so every rank learns in the same step whether any rank voted
        (``StepResult.stop``): ranks that got a signal at different moments stop together.
        """
        return self._finish_step(*self._queue_step(batch, num_items, stop))

    def _queue_step(
        self, batch: Mapping[str, torch.Tensor], num_items: int | None, stop: bool = False
    ):
        """Everything of a step up to its one host read, queued without reading the device
        (the CUDA tests hold it to that with the sync debug mode set to "error")."""
        t = self.step_index
        cfg = self.config
        lr = learning_rate(cfg.lr, t, cfg.lr_schedule, cfg.warmup_steps, cfg.max_steps)
        self._check_batch(batch)
        num_tokens, _ = count_tokens(batch)
        num_items = self.objective.num_items(batch) if num_items is None else num_items
        if num_items <= 0:
            raise ValueError("the batch has nothing to train on (no label tokens, or no examples)")
        with self._guard(), torch.no_grad():
            prepared = self.objective.prepare(
                batch, self.device
            )  # host work and copies, queued before any kernel
            with self.streams.compute_scope():
                runner = _StepRunner(self, t, self.passes, cfg.grad_accum)
                losses = self.objective.losses(runner, prepared, self.passes, num_items)
                vector = loss_contribution(losses, cfg.num_queries)
                # the stop vote rides on the losses' all-reduce: filled on the device, no copy
                vector = torch.cat(
                    [
                        vector,
                        torch.full((1,), float(stop), dtype=vector.dtype, device=vector.device),
                    ]
                )
                if self.parallel.is_distributed:
                    vector = self.parallel.comm.all_reduce_sum(vector)  # the step's one collective
                read = self.parallel.comm.read_later(vector)  # queued on the compute stream
        return t, lr, num_tokens, read

    def _finish_step(
        self, t: int, lr: float, num_tokens: int, read: Callable[[], list[float]]
    ) -> StepResult:
        with self._guard():
            *reduced, votes = (
                read()
            )  # the step's one host sync: waits for the compute stream's losses only
        cfg = self.config
        grads = projected_gradients(reduced, cfg.eps)
        self.pending = self.momentum_update(PendingUpdate(t, grads, lr))
        self.step_index += 1
        q = cfg.num_queries
        loss_plus, loss_minus = sum(reduced[0::2]) / q, sum(reduced[1::2]) / q
        return StepResult(
            t,
            (loss_plus + loss_minus) / 2,
            loss_plus,
            loss_minus,
            sum(grads) / q,
            lr,
            num_tokens,
            grads,
            votes > 0,
        )

    def momentum_update(self, update: PendingUpdate) -> PendingUpdate:
        """The step's update with the recent steps' g as its momentum history (``sgd``: as it is)."""
        if self.config.optimizer != "momentum":
            return update
        self.recent_steps = ((update.step, update.projected_grads), *self.recent_steps)[
            : self.config.momentum_window
        ]
        return self.with_momentum(update, self.recent_steps)

    def with_momentum(self, update: PendingUpdate | None, recent_steps) -> PendingUpdate | None:
        """``update`` (a step's own g) with the momentum history that precedes it in
        ``recent_steps`` (newest first, the update's own step included): how a resumed run
        or a replay rebuilds the pending update from a checkpoint or a seed log."""
        if update is None or self.config.optimizer != "momentum":
            return update
        recent = tuple(recent_steps)
        history = recent[1:] if recent and recent[0][0] == update.step else recent
        return PendingUpdate(
            update.step,
            update.projected_grads,
            update.lr,
            history[: self.config.momentum_window - 1],
            self.config.beta1,
        )

    def forward(
        self, batch: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of every position (and mean loss, if the batch has labels) at the current,
        unperturbed parameters: the model's own forward, for inspection and tests.
        Evaluation uses ``evaluate``, which reads the head only where it is needed."""
        self._check_batch(batch)
        host_mask = (
            batch["attention_mask"].cpu() if batch.get("attention_mask") is not None else None
        )
        with self._guard(), torch.no_grad(), self.streams.compute_scope():
            input_ids, _, labels = self._prepare(batch)
            hidden = self._stream_pass(
                (UNPERTURBED,), self.step_index, {UNPERTURBED: input_ids}, host_mask
            )
            self._perturb_resident(UNPERTURBED, self.step_index)
            logits = self.family.logits(hidden[UNPERTURBED])
            loss = self.family.loss(logits, labels, None) if labels is not None else None
        self._hand_to_caller((logits, loss))
        return logits, loss

    def evaluate(self, measure: Callable[[PassRunner], Measured]) -> Measured:
        """``measure(runner)`` on the model at its current parameters (the pending update
        applied first, as a flush would): the one pass is ``UNPERTURBED``. Whatever tensors
        it returns are safe to use on the caller's stream."""
        with self._guard(), torch.no_grad(), self.streams.compute_scope():
            result = measure(_StepRunner(self, self.step_index, (UNPERTURBED,)))
        self._hand_to_caller(result)
        return result

    def _hand_to_caller(self, result: Any) -> None:
        """Tensors made on the compute stream and freed on the caller's (compute_scope
        already ordered the caller after the work that wrote them)."""
        if self.streams.is_async:
            caller = torch.cuda.current_stream(self.device)
            for leaf in tree_leaves(result):
                if isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda":
                    leaf.record_stream(caller)

    def flush(self) -> None:
        """Apply the pending update to every bucket now (before export or inspection).

        It is the same op the next step would apply, so flushing never changes the trajectory.
        """
        if self.pending is None and not self._backlog:
            return
        with self._guard(), torch.no_grad(), self.streams.compute_scope():
            self._stream_pass((), self.step_index, None, None)
        self.streams.synchronize()

    def catch_up(self, logged: list[tuple[int, tuple[float, ...], float]]) -> None:
        """Apply logged steps ``(step, projected_grads, lr)``, which must follow the engine's
        step, as if they had been trained: in one pass over the blocks, each uploaded and
        offloaded once whatever their number, every bucket taking the pending update and then
        each logged one in order (per element the same operations in the same order as the
        steps' own updates: bitwise the trajectory). A restarted run resumes this way from a
        checkpoint plus the seed log; a replay from the base weights plus the log."""
        if not logged:
            return
        first = logged[0][0]
        if first != self.step_index or [s for s, _, _ in logged] != list(
            range(first, first + len(logged))
        ):
            raise ValueError(
                f"logged steps must run on from step {self.step_index} in order, got {logged[0][0]}.."
            )
        updates = [self.pending] if self.pending is not None else []
        for step, grads, lr in logged:
            updates.append(self.momentum_update(PendingUpdate(step, grads, lr)))
        self.pending, self._backlog = updates[-1], updates[:-1]
        self.flush()
        self.step_index = logged[-1][0] + 1

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """Flushed values by Hugging Face name (aliases of tied weights included), as CPU
        copies in the master dtype. Collective under the sliced transfer: call on every rank."""
        self.flush()
        return self._collect()

    def state_dict(self) -> dict[str, Any]:
        """The full training state, pending update included (no flush: saving stays cheap)."""
        params = self._collect()
        return {
            "step": self.step_index,
            "run_seed": self.run_seed,
            "noise_chunk": self.config.noise_chunk,
            "noise": noise_identity(self.config.noise),
            "pending": asdict(self.pending) if self.pending is not None else None,
            "recent_steps": [[step, list(grads)] for step, grads in self.recent_steps],
            "params": {name: params[name] for name in self.canonical_names},
            "optimizer_state": self._moment_values(),
        }

    def _moment_values(self) -> dict[str, dict[str, torch.Tensor]]:
        """Each stored moment by torch's name for it, by canonical parameter name (CPU copies)."""
        out = {}
        for k, state_name in enumerate(self.moments.names):
            values = {
                entry.names[0]: value
                for bucket in self._buckets(moment=k)
                for entry, value in bucket
            }
            out[state_name] = {name: values[name] for name in self.canonical_names}
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a ``state_dict``; the continued trajectory equals the uninterrupted one."""
        self.check_noise(state.get("noise", "legacy"), int(state["noise_chunk"]), "the state")
        params = state["params"]
        expected = set(self.canonical_names)
        if set(params) != expected:
            missing, extra = sorted(expected - set(params)), sorted(set(params) - expected)
            raise ValueError(
                f"state does not match the model: missing {missing[:3]}, unexpected {extra[:3]}"
            )
        moments = state.get("optimizer_state") or {}
        if set(moments) != set(self.moments.names):
            raise ValueError(
                f"the state holds optimizer state {sorted(moments) or 'none'}, the engine keeps "
                f"{list(self.moments.names) or 'none'}; load it with the optimizer it was trained with"
            )
        self.streams.synchronize()
        with torch.no_grad():
            self._load_buckets(params, self.resident_master, self.store)
            for k, name in enumerate(self.moments.names):
                self._load_buckets(moments[name], self.moments.resident[k], self.moments.blocks[k])
        pending = PendingUpdate(**state["pending"]) if state["pending"] is not None else None
        self.restore(
            int(state["step"]), int(state["run_seed"]), pending, state.get("recent_steps", ())
        )

    def _load_buckets(
        self, values: Mapping[str, torch.Tensor], resident: torch.Tensor, store
    ) -> None:
        """Values by canonical name into the resident bucket ``resident`` and the blocks of ``store``."""
        for e in self.resident_layout.entries:
            resident[e.offset : e.offset + e.numel].copy_(values[e.names[0]].reshape(-1))
        for i, layout in enumerate(self.block_layouts):
            flat = torch.zeros(layout.numel, dtype=resident.dtype)
            for e in layout.entries:
                flat[e.offset : e.offset + e.numel] = values[e.names[0]].reshape(-1)
            store.load_block(i, flat)

    def check_noise(self, identity: str, chunk: int, source: str) -> None:
        """A state continues its run only with the same z: the same noise kind and version
        (``noise_identity``; a state from before noise kinds is ``legacy``), and for the
        legacy kind the same chunk size, which its z depends on."""
        ours = noise_identity(self.config.noise)
        if identity != ours:
            kind = identity_kind(identity)
            fix = (
                f"set noise {kind}"
                if drawable(identity)
                else ("use the distzo version that wrote it")
            )
            raise ValueError(
                f"{source} was trained with {identity} noise, the engine draws {ours}; {fix}"
            )
        if self.config.noise == "legacy" and chunk != self.config.noise_chunk:
            raise ValueError(
                f"{source} was trained with noise_chunk {chunk}, the engine has {self.config.noise_chunk}; "
                "set noise_chunk to match (legacy noise depends on it)"
            )

    def restore(
        self, step: int, run_seed: int, pending: PendingUpdate | None, recent_steps=()
    ) -> None:
        """Set the step counter, run seed, pending update and momentum history (``(step, g)``
        of the recent steps, newest first) after the buckets were loaded."""
        self.step_index = step
        self.run_seed = run_seed
        self.recent_steps = step_grads(recent_steps)
        self._make_noise(self.resident_master.dtype)
        for store in (self.store, *self.moments.blocks):
            if isinstance(store, StreamedBlocks):
                store.rounding_noise = self.rounding_noise
        self.pending = pending
        self._resident_holds = None
        self._broken = None

    # ------------------------------------------------------------------ internals

    def _entries(self):
        yield from self.resident_layout.entries
        for layout in self.block_layouts:
            yield from layout.entries

    @property
    def canonical_names(self) -> list[str]:
        """One name per distinct parameter (a tied weight appears once), in bucket order."""
        return [e.names[0] for e in self._entries()]

    def stream_parameters(
        self, materialize: bool = True, frozen: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Flushed values, one bucket at a time, as ``(canonical name, CPU tensor)`` with
        storage of their own: an export holds one block, never the model twice.
        ``frozen``: the frozen base of an adapter run instead of the trained parameters.

        Collective under the sliced transfer (each block is gathered through the device):
        every rank must drain it. A rank with ``materialize=False`` takes part in the
        gathers but copies nothing to the host and yields nothing.
        """
        self.flush()
        for _, entry, value in self._bucket_values(materialize, frozen):
            yield entry.names[0], value

    def stream_buckets(self, materialize: bool = True) -> Iterator[dict[str, torch.Tensor]]:
        """Flushed values, resident modules first, then block by block, as one dict per
        bucket by every alias, frozen base and adapter together (a merge of an adapter
        into its base needs both halves of a block at once). Collective as ``stream_parameters``."""
        self.flush()
        trained = self._buckets(materialize)
        frozen = self._buckets(materialize, frozen=True) if self.frozen_base else iter(())
        # zip_longest drains both, so every rank takes part in every gather of either
        for halves in itertools.zip_longest(trained, frozen, fillvalue=()):
            values = {
                name: value for half in halves for entry, value in half for name in entry.names
            }
            if materialize:
                yield values

    def _bucket_values(
        self, materialize: bool = True, frozen: bool = False
    ) -> Iterator[tuple[int, Entry, torch.Tensor]]:
        """Every parameter as stored (pending update not applied), bucket by bucket, as
        ``(bucket index, entry, value)``: -1 for the resident modules, i for block i."""
        for index, values in enumerate(self._buckets(materialize, frozen), start=-1):
            for entry, value in values:
                yield index, entry, value

    def _buckets(
        self, materialize: bool = True, frozen: bool = False, moment: int | None = None
    ) -> Iterator[list[tuple[Entry, torch.Tensor]]]:
        """Every bucket as stored (pending update not applied), resident first, as a list of
        ``(entry, CPU copy)`` (empty where ``materialize`` is False).
        ``frozen``: the frozen base's buckets instead of the trained ones; ``moment``: the
        trained buckets' optimizer moment of that index instead.

        Blocks are read back through the device (an upload): that is where a sliced rank
        sees the whole block and where a low-bit master becomes the master dtype. The
        uploads run on the upload stream, joined both ways with the caller's, and the
        read-back ends with a host sync: every gather this rank took part in is complete
        before it returns, on every rank (NCCL's waits block streams, not the host).
        """
        if frozen:
            store, resident, layouts = self.base_store, self.resident_base, self.base_layouts
            resident_layout = self.resident_base_layout
        elif moment is not None:
            store, resident = self.moments.blocks[moment], self.moments.resident[moment]
            layouts, resident_layout = self.block_layouts, self.resident_layout
        else:
            store, resident, layouts = self.store, self.resident_master, self.block_layouts
            resident_layout = self.resident_layout
        buckets = [(resident_layout, -1)] + [(layout, i) for i, layout in enumerate(layouts)]
        try:
            for layout, index in buckets:
                values = []
                with self.streams.compute_scope(), self.streams.on("upload"):
                    if index < 0:
                        bucket = resident
                    else:
                        store.upload(index)
                        bucket = store.device_bucket(index)
                    if (
                        materialize
                    ):  # copies to pageable host memory: the host waits for this stream
                        values = [
                            (
                                e,
                                bucket[e.offset : e.offset + e.numel]
                                .view(e.shape)
                                .to("cpu", copy=True),
                            )
                            for e in layout.entries
                        ]
                yield values  # outside the stream context: the consumer runs on its own stream
        finally:
            self.parallel.comm.host_sync()

    def blocks_at_rest(
        self, wanted: Callable[[int], bool], private: bool, moment: int | None = None
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """``(i, block i exactly as stored, in its at-rest dtype)`` for every block with
        ``wanted(i)`` (``moment``: that optimizer moment of the block): what a checkpoint holds. A host copy when ``private`` or when the
        block is gathered through the device (sliced: collective, so every rank runs every
        block, wanted or not), else the live host view. Ends with a host sync, as every
        collective read-back does."""
        sliced = self.state_sliced
        store = self.store if moment is None else self.moments.blocks[moment]
        try:
            for i in range(len(self.blocks)):
                if not (sliced or wanted(i)):
                    continue
                value = None
                with self.streams.compute_scope(), self.streams.on("upload"):
                    at_rest = store.block_at_rest(i)
                    if wanted(i):
                        value = at_rest.to("cpu", copy=True) if private or sliced else at_rest
                if value is not None:
                    yield i, value
        finally:
            self.parallel.comm.host_sync()

    def _collect(self) -> dict[str, torch.Tensor]:
        """Every trained parameter as stored, by every alias, as CPU copies (a tied weight's
        aliases share one tensor)."""
        return {name: value for _, entry, value in self._bucket_values() for name in entry.names}

    def _prepare(self, batch: Mapping[str, torch.Tensor]):
        """input_ids, attention_mask and labels (None if absent) on the device."""

        def move(t):
            return t.to(self.device, non_blocking=True) if t is not None else None

        return (
            move(batch["input_ids"]),
            move(batch.get("attention_mask")),
            move(batch.get("labels")),
        )

    def _check_batch(self, batch: Mapping[str, torch.Tensor]) -> None:
        if "input_ids" not in batch:
            raise ValueError(
                "a batch needs 'input_ids' (and optionally 'attention_mask', 'labels')"
            )
        limit = getattr(self.model.config, "max_position_embeddings", None)
        prefix = self.family.prefix_length  # its positions come first
        if limit is not None and batch["input_ids"].shape[-1] + prefix > limit:
            raise ValueError(
                f"sequences of {batch['input_ids'].shape[-1]} tokens{f' after a {prefix}-token prefix' if prefix else ''} "
                f"exceed the model's max_position_embeddings {limit}; truncate them"
            )

    def _guard(self):
        """Refuse to continue after a pass failed half-way: its buckets are half-updated."""
        engine = self

        class _Guard:
            def __enter__(self):
                if engine._broken is not None:
                    raise RuntimeError(
                        f"the engine is unusable after an earlier failure ({engine._broken}); "
                        "reload a checkpoint with load_state_dict"
                    )

            def __exit__(self, exc_type, exc, tb):
                if exc is not None:
                    engine._broken = f"{exc_type.__name__}: {exc}"
                return False

        return _Guard()

    def _perturb_resident(self, p: Pass, step: int) -> None:
        query, sign = p
        key = (query, sign, step) if sign else (0, 0, -1)
        if self._resident_holds != key and self.resident_master.numel():
            self.noise.perturb_into(
                self.resident_scratch,
                self.resident_master,
                sign * self.config.eps,
                step,
                RESIDENT_BLOCK_ID,
                query,
            )
            self._resident_holds = key

    def _apply(
        self,
        update: PendingUpdate,
        bucket: torch.Tensor,
        layout: BucketLayout,
        block_id: int,
        moments: list[torch.Tensor],
    ) -> None:
        if not layout.numel:
            return
        wd = self.config.weight_decay
        if self.moment_updater is not None:
            self.moment_updater.apply(
                self.noise,
                bucket,
                moments,
                layout.decay_end,
                update.lr,
                wd,
                update.step,
                update.projected_grads,
                block_id,
            )
            return
        terms = [(step, query, update.lr * c) for step, query, c in update.terms()]
        self.noise.apply_terms(
            bucket, layout.decay_end if wd else 0, 1.0 - update.lr * wd, terms, block_id
        )

    def _stream_pass(
        self,
        passes: tuple[Pass, ...],
        step: int,
        input_ids: Mapping[Pass, torch.Tensor] | None,
        attention_mask: torch.Tensor | None,
        micro_batches: int = 1,
    ) -> dict[Pass, torch.Tensor]:
        """Apply the pending update everywhere and run the blocks once for each pass, each
        on its own token ids (one shared mask).

        ``attention_mask`` is the host copy (None: every position is real). Returns each
        pass's last hidden state, the pass whose perturbation the resident bucket holds
        first (the order in which reading heads re-perturbs it least). With no passes
        (flush) it only updates. ``micro_batches`` (gradient accumulation) splits the rows
        into that many micro-batches, each run through a block while it is on the device:
        one upload per block whatever their number, the activations of one micro-batch at
        a time, and every micro-batch's hidden states carried between blocks.
        """
        updates = [*self._backlog, *([self.pending] if self.pending is not None else [])]
        self._backlog, self.pending = [], None
        self.store.step = step
        self.moments.set_step(step)
        if self._carried is not None:
            self._carried.carry = bool(updates)  # moments travel only to be updated
        if updates:
            self._resident_holds = None
        held = self._held_pass(step)
        order = sorted(
            passes, key=lambda p: p != held
        )  # embed the held pass first: one perturbation fewer
        groups = (
            self.pass_groups_of(tuple(order))
            if self.pass_scratch is not None
            else [(p,) for p in order]
        )
        # Each pass's hidden states as a list of micro-batches; a batched group's as one
        # list too, each micro-batch holding the group's passes' rows, pass-major.
        hiddens: dict[tuple[Pass, ...], list[torch.Tensor]] = {}
        contexts: dict[int, list[Any]] = {}  # by group size: one context per micro-batch
        eps = self.config.eps

        def embed() -> None:  # runs once the first uploads are queued
            for update in updates:
                self._apply(
                    update,
                    self.resident_master,
                    self.resident_layout,
                    RESIDENT_BLOCK_ID,
                    self.moments.resident,
                )
            if not order:
                return
            rows, length = input_ids[order[0]].shape
            bounds = micro_batch_bounds(rows, micro_batches)
            dtype = self.block_scratch.dtype
            for g in {len(group) for group in groups} | {
                1
            }:  # masks from the host copy: no device reads
                contexts[g] = [
                    self.family.context(
                        attention_mask[lo:hi].repeat(g, 1) if attention_mask is not None else None,
                        (g * (hi - lo), length),
                        self.device,
                        dtype,
                    )
                    for lo, hi in bounds
                ]
            own = {}
            for p in order:
                self._perturb_resident(p, step)
                own[p] = [
                    self.family.embed(input_ids[p][lo:hi], ctx)
                    for (lo, hi), ctx in zip(bounds, contexts[1])
                ]
            for group in groups:
                parts = [own.pop(p) for p in group]
                hiddens[group] = (
                    parts[0] if len(group) == 1 else [torch.cat(micro) for micro in zip(*parts)]
                )

        def compute(i: int, bucket: torch.Tensor) -> None:
            if self.frozen_base:  # the streamed bucket is the base: one copy serves every pass
                numel = self.base_layouts[i].numel
                self.base_scratch[:numel].copy_(bucket[:numel])
                bucket = self.store.device_bucket(i)  # the block's adapter
            for update in updates:
                self._apply(
                    update, bucket, self.block_layouts[i], i + 1, self.moments.device_buckets(i)
                )
            block = self.blocks[i]
            for group in groups:
                if len(group) == 1:
                    ((query, sign),) = group
                    if bucket.numel():
                        self.noise.perturb_into(
                            self.block_scratch, bucket, sign * eps, step, i + 1, query
                        )
                    hiddens[group] = [
                        self.family.block_forward(block, h, ctx)
                        for h, ctx in zip(hiddens[group], contexts[1])
                    ]
                    continue
                for k, (query, sign) in enumerate(group):  # each pass's adapter, side by side
                    self.noise.perturb_into(
                        self.pass_scratch[k], bucket, sign * eps, step, i + 1, query
                    )
                factors = self._batched_factors[i]
                for module, e in factors:
                    module.stacked = self.pass_scratch[
                        : len(group), e.offset : e.offset + e.numel
                    ].unflatten(1, e.shape)
                hiddens[group] = [
                    self.family.block_forward(block, h, ctx)
                    for h, ctx in zip(hiddens[group], contexts[len(group)])
                ]
                for module, _ in factors:
                    module.stacked = None

        # Unchanged blocks (no pending update) need not go back: their host copies are right,
        # and a frozen base never changes.
        self.scheduler.run(compute, prologue=embed, offload=bool(updates) and not self.frozen_base)
        out: dict[Pass, list[torch.Tensor]] = {p: [] for p in order}
        for group, micro in hiddens.items():
            for h in micro:  # a batched micro-batch holds its passes' rows one after another
                for p, rows in zip(group, h.chunk(len(group))):
                    out[p].append(rows)
        return {p: out[p][0] if len(out[p]) == 1 else torch.cat(out[p]) for p in reversed(order)}

    def _held_pass(self, step: int) -> Pass | None:
        """The pass whose perturbation the resident scratch holds now, if any."""
        if self._resident_holds is None:
            return None
        query, sign, held_step = self._resident_holds
        if sign == 0:
            return UNPERTURBED
        return (query, sign) if held_step == step else None


def micro_batch_bounds(rows: int, micro_batches: int) -> list[tuple[int, int]]:
    """Row ranges of ``micro_batches`` near-equal micro-batches (the first ones one row
    larger when ``rows`` does not divide); refused when there are fewer rows than that."""
    if micro_batches > rows:
        raise ValueError(
            f"--grad-accum {micro_batches} needs at least {micro_batches} rows per rank, the batch has {rows}; "
            "lower --grad-accum or raise --batch-size"
        )
    size, extra = divmod(rows, micro_batches)
    bounds, lo = [], 0
    for m in range(micro_batches):
        hi = lo + size + (1 if m < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def _pass_grouping(
    dual: bool, queries: bool
) -> Callable[[tuple[Pass, ...]], list[tuple[Pass, ...]]]:
    """How a rank's passes are grouped into batched forwards: the two signs of a query
    together (``dual``), one sign of every query together (``queries``), all of them
    (both), or each alone (neither). Groups keep the order of the passes given."""

    def key(p: Pass):
        query, sign = p
        return (None if queries else query, None if dual else sign)

    def groups(order: tuple[Pass, ...]) -> list[tuple[Pass, ...]]:
        out: dict[Any, list[Pass]] = {}
        for p in order:
            out.setdefault(key(p), []).append(p)
        return [tuple(g) for g in out.values()]

    return groups


class _StepRunner:
    """The engine seen by an objective: one step's passes, blocks streamed per call."""

    def __init__(
        self, engine: ZOEngine, step: int, passes: tuple[Pass, ...], micro_batches: int = 1
    ) -> None:
        self.engine, self.step, self.passes, self.micro_batches = (
            engine,
            step,
            passes,
            micro_batches,
        )
        self.device = engine.device

    def hidden_states(
        self, input_ids: Mapping[Pass, torch.Tensor], attention_mask: torch.Tensor | None
    ) -> dict[Pass, torch.Tensor]:
        if set(input_ids) != set(self.passes):
            raise ValueError(
                f"hidden_states needs token ids for the passes {self.passes}, got {tuple(input_ids)}"
            )
        return self.engine._stream_pass(
            self.passes, self.step, input_ids, attention_mask, self.micro_batches
        )

    def head(self, p: Pass, hidden: torch.Tensor) -> torch.Tensor:
        self.engine._perturb_resident(p, self.step)
        return self.engine.family.logits(hidden)
