"""One ZO step over embed -> streamed blocks -> head.

Per step t, with the pending update (t-1, c_0..c_{q-1}, lr) of the previous step:

* the resident bucket (embeddings, head, final norm) gets the pending update, then
  is perturbed out of place into its scratch bucket for each pass;
* each block is uploaded into a device slot, gets the pending update right there (so
  it crosses the link once per step), is perturbed out of place into the one block
  scratch bucket for each pass (query j, sign) and run on that pass's hidden states,
  then offloaded: q queries cost 2q forward passes under SPSA (N + 1 under FZOO) but
  one transfer;
* the head gives each pass's loss; one all-reduce of the step's loss vector (identity
  in one process) gives every rank the same losses, which the estimator turns into the
  update coefficients c_j of the new pending update (SPSA's g_j; ``distzo.zo.estimators``).

The module parameters are bound once to the scratch buckets, so the model's own
layers compute with whatever perturbation the scratch currently holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast, overload

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from distzo.config.engine_checks import SEED_LIMIT
from distzo.config.engine_options import ZOConfig
from distzo.dist import ParallelContext
from distzo.engine import state
from distzo.engine.arguments import check_engine_arguments, check_objective_fits, check_stop
from distzo.engine.batches import (
    check_batch,
    check_mapping,
    count_tokens,
    global_items,
    on_device,
)
from distzo.engine.build import make_noise, resolve_run_seed, resolve_transfer
from distzo.engine.failures import FailureLatch
from distzo.engine.layouts import unwrap_peft
from distzo.engine.parts import Placement, build_parts, check_unbound, describe
from distzo.engine.passes import UNPERTURBED, BlockPass, StepRunner, micro_batch_bounds
from distzo.engine.reads import ReadBacks
from distzo.engine.resident_sides import HEAD
from distzo.engine.state import BucketReader
from distzo.engine.tuning import Streamed
from distzo.engine.updates import History, PendingUpdate, UpdateQueue
from distzo.models import ModelFamily, family_for
from distzo.models.prefix import BlockPrefix
from distzo.models.weights import WeightSource
from distzo.objectives import LanguageModeling, Objective, PassRunner
from distzo.objectives.lm import check_lm_keys
from distzo.offload import BlockScheduler, BlockStore, BucketLayout, StreamedBlocks, Streams
from distzo.zo import Pass, learning_rate, loss_contribution
from distzo.zo.estimators import StepLosses
from distzo.zo.moments import MomentRule, MomentUpdater

__all__ = ["StepResult", "ZOEngine", "count_tokens"]

logger = logging.getLogger(__name__)

Measured = TypeVar("Measured")
T = TypeVar("T")


@dataclass(frozen=True)
class StepResult:
    """One step's losses and estimate; with several queries, means over the queries.

    ``projected_grads`` are the update coefficients c_j (the update moves along
    ``mean_j c_j z_j``): SPSA's projected gradients g_j, FZOO's N g_j."""

    step: int  # 0-based index of the step just taken
    loss: float  # SPSA: mean of (L+ + L-) / 2, the loss at theta to first order; FZOO: L(theta)
    loss_plus: float  # the mean loss along +z
    loss_minus: float  # the other ends: SPSA's mean L-, FZOO's L(theta)
    projected_grad: float  # mean of projected_grads
    lr: float
    num_tokens: int  # input tokens this rank processed (all passes count once)
    projected_grads: tuple[float, ...]  # c_j of each query j
    stop: bool = False  # some rank asked to stop after this step (a preemption notice)
    losses: tuple[float, ...] = ()  # the step's reduced loss vector, in the estimator's order

    @classmethod
    def of(
        cls,
        step: int,
        lr: float,
        num_tokens: int,
        losses: Sequence[float],
        reported: StepLosses,
        grads: tuple[float, ...],
        votes: float,
    ) -> StepResult:
        """The result from the reduced loss vector, what the estimator reports of it and
        the coefficients it made of it."""
        mean_grad = sum(grads) / len(grads)
        return cls(
            step,
            reported.loss,
            reported.loss_plus,
            reported.loss_minus,
            mean_grad,
            lr,
            num_tokens,
            grads,
            votes > 0,
            tuple(losses),
        )


class Delegate(Generic[T]):
    """An engine attribute (or method) that one of the engine's parts owns, kept on the
    engine for its callers: ``Delegate("updates")`` reads (and writes) the attribute of
    the same name on ``engine.updates``, so the state has one home."""

    def __init__(self, part: str, name: str | None = None) -> None:
        self.part, self.name = part, name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    @overload
    def __get__(self, engine: None, owner: type | None = None) -> Delegate[T]: ...

    @overload
    def __get__(self, engine: object, owner: type | None = None) -> T: ...

    def __get__(self, engine: object | None, owner: type | None = None) -> Any:
        return self if engine is None else getattr(getattr(engine, self.part), str(self.name))

    def __set__(self, engine: object, value: T) -> None:
        setattr(getattr(engine, self.part), str(self.name), value)


class ZOEngine(ReadBacks):
    """MeZO-SGD on a model whose blocks are resident (MeZO) or streamed from host memory (ZO2).

    ``parallel`` places this rank in a torchrun job (DistZO2): which perturbed passes it
    runs, the all-reduce that gives every rank the same g, and the node-local group that
    shares one host copy of the blocks. ``run_seed`` must be equal on every rank (the
    trainer broadcasts it); it defaults to ``config.seed``, else a random draw (rank 0's,
    broadcast to every rank under torchrun).
    ``weights`` fills the buckets, one at a time, for a model whose parameters are still on
    the meta device (streaming load, random init of large shapes); without it the model's
    own parameter values are packed. ``objective`` is what a step minimises (default: the
    causal-LM loss on the batch's labels; see ``distzo.objectives``).

    The parts: ``trained`` (the trained buckets as stored), ``tuning`` (what is trained:
    every parameter, or an adapter on a frozen base), ``updates`` (the update the buckets
    have not taken yet), ``resident`` (the resident scratch), ``moments`` and ``reader``.
    """

    # Attributes of the parts, by the names the engine's callers know them by.
    store = Delegate[BlockStore]("trained")  # the trained blocks' store
    resident_master = Delegate[torch.Tensor]("trained", "resident")
    block_layouts = Delegate[list[BucketLayout]]("trained")
    resident_layout = Delegate[BucketLayout]("trained")
    canonical_names = Delegate[list[str]]("trained")  # one name per distinct parameter
    num_parameters = Delegate[int]("trained")  # what a step perturbs and updates
    pending = Delegate[PendingUpdate | None]("updates")  # the last step's, not yet applied
    recent_steps = Delegate[History]("updates")  # momentum: (step, g), newest first
    resident_scratch = Delegate[torch.Tensor]("resident", "values")
    frozen_base = Delegate[bool]("tuning")  # whether an adapter trains on a frozen base
    prefixes = Delegate[list[BlockPrefix]]("tuning")
    base_layouts = Delegate[list[BucketLayout]]("tuning")
    # None under full tuning; Any as before: the export reads it only under a frozen base
    resident_base_layout = Delegate[Any]("tuning")
    base_store = Delegate[BlockStore | None]("tuning")
    resident_base = Delegate[torch.Tensor | None]("tuning")
    _resident_base_compute = Delegate[torch.Tensor | None]("tuning", "resident_base_compute")
    base_scratch = Delegate[torch.Tensor | None]("tuning")
    pass_scratch = Delegate[torch.Tensor | None]("tuning")
    num_frozen = Delegate[int]("tuning")  # the parameters of a frozen base
    # bytes of the host copy of the streamed blocks, and of block masters or slots (with an
    # adapter's buckets and base scratch) on the device; optimizer state apart
    host_bytes = Delegate[int]("tuning")
    device_bytes = Delegate[int]("tuning")
    state_host_bytes = Delegate[int]("moments", "host_bytes")  # the moments' host shards
    moment_rule = Delegate[MomentRule | None]("update_rule")
    moment_updater = Delegate[MomentUpdater | None]("update_rule")
    # the step's update with its momentum history; a saved update with the history before it
    momentum_update = Delegate[Callable[[PendingUpdate], PendingUpdate]]("updates")
    with_momentum = Delegate[Callable[[PendingUpdate | None, Any], PendingUpdate | None]]("updates")

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
        check_engine_arguments(model, config, family, parallel, weights, objective)
        config.validate()
        if weights is None and any(p.is_meta for p in model.parameters()):
            raise ValueError(
                "the model's parameters are on the meta device (a skeleton): pass weights= "
                "(open_checkpoint(path), or RandomWeights(seed) for a random init)"
            )
        model, self.peft_model = unwrap_peft(model)  # a peft model of one adapter, default
        check_unbound(model)
        self.objective: Objective = objective if objective is not None else LanguageModeling()
        self.family = family if family is not None else family_for(model)
        check_objective_fits(self.family, self.objective, objective is None)
        self.config, self.model = config, model
        self.device = config.torch_device()
        self.parallel = parallel if parallel is not None else ParallelContext.single(self.device)
        self.estimator = config.estimator_rule
        self.step_passes = config.step_passes()  # every pass of a step, in loss-vector order
        # a pert rank with none of them would fail deep in the build: refused in one line
        self.parallel.dims.check_passes(config.estimator, config.num_queries)
        self.passes = self.parallel.own_passes(self.step_passes)  # (query, sign) this rank runs
        self.transfer = resolve_transfer(config, self.device, self.parallel)
        self.run_seed = resolve_run_seed(run_seed, config.seed, self.parallel)
        if not 0 <= self.run_seed < SEED_LIMIT:
            raise ValueError(f"run_seed must be in [0, 2^63), got {self.run_seed}")
        self.step_index = 0
        self.updates = UpdateQueue(config)
        self.failures = FailureLatch()  # closed by a pass that fails half-written
        # ZO takes two forward passes of one function: dropout would make them two functions.
        model.eval()
        self.blocks = self.family.blocks()
        if not self.blocks:
            raise ValueError("the model has no transformer blocks to stream")
        at = Placement(
            config, self.device, self.parallel, self.transfer, self.passes, self.run_seed
        )
        parts = build_parts(model, self.peft_model, self.blocks, at, weights)
        self.tuning, self.trained, self.update_rule = parts.tuning, parts.trained, parts.update_rule
        self.noise, self.rounding_noise = parts.noise, parts.rounding_noise
        self.moments, self.carried = parts.moments, parts.carried
        self.block_scratch, self.resident = parts.block_scratch, parts.resident
        self.module_scratch = parts.module_scratch
        self.pass_groups_of = parts.pass_groups_of
        self.rebuilt = parts.rebuilt
        model.to(self.device)  # parameters already live on the device; this moves buffers only
        if self.device.type == "cuda":
            # The buffers were filled on the default stream; the three streams start after that.
            torch.cuda.current_stream(self.device).synchronize()
        self.streams = Streams(self.device)
        # the scheduler only moves blocks (upload, offload, device_bucket, num_slots), which
        # a CarriedStore does as well as a BlockStore
        store = cast(BlockStore, self.streamed_store)
        self.scheduler = BlockScheduler(store, self.streams, len(self.blocks))
        self.reader = BucketReader(self.streams, self.parallel)
        self.tuning.init_prefixes(self.forward, self.streams, self.store, self.block_layouts)
        logger.info(describe(self, parts.compute_dtype))

    # ------------------------------------------------------------------ the step

    def step(
        self, batch: Mapping[str, torch.Tensor], num_items: int | None = None, stop: bool = False
    ) -> StepResult:
        """One ZO-SGD step on ``batch``, in the form the objective reads (for the default
        ``lm``: ``input_ids``, optional ``attention_mask``/``labels``).

        ``num_items`` is what the objective averages over (label tokens, examples) in the
        *global* batch; it defaults to this batch's, which is right without data
        parallelism, and must be given under it (dp > 1: refused otherwise). ``stop``:
        this rank's vote to stop after this step, carried by the step's one all-reduce,
        so every rank learns in the same step whether any rank voted (``StepResult.stop``):
        ranks that got a signal at different moments stop together.
        """
        return self._finish_step(*self._queue_step(batch, num_items, stop))

    def _queue_step(
        self, batch: Mapping[str, torch.Tensor], num_items: int | None, stop: bool = False
    ) -> tuple[int, float, int, Callable[[], list[float]]]:
        """Everything of a step up to its one host read, queued without reading the device
        (the CUDA tests hold it to that with the sync debug mode set to "error")."""
        check_mapping(batch)
        check_stop(stop)
        t, cfg = self.step_index, self.config
        lr = learning_rate(cfg.lr, t, cfg.lr_schedule, cfg.warmup_steps, cfg.max_steps)
        check_objective_batch = getattr(self.objective, "check_batch", None)
        if check_objective_batch is not None:  # its own keys first (a choice objective's)
            check_objective_batch(batch)
        self._check_batch(batch, getattr(self.objective, "batch_dims", 2))  # a choice one's: 3
        num_tokens, _ = count_tokens(batch)
        num_items = global_items(self.objective, batch, num_items, self.parallel.dims.dp)
        if num_items <= 0:
            raise ValueError("the batch has nothing to train on (no label tokens, or no examples)")
        with self.failures.guard(), torch.no_grad():
            # host work and copies, queued before any kernel
            prepared = self.objective.prepare(batch, self.device)
            with self.streams.compute_scope():
                runner = StepRunner(self, t, self.passes, cfg.grad_accum, cfg.micro_batch_rows)
                losses = self.objective.losses(runner, prepared, self.passes, num_items)
                vector = loss_contribution(losses, self.step_passes)
                # the stop vote rides on the losses' all-reduce: filled on the device, no copy
                vote = torch.full((1,), float(stop), dtype=vector.dtype, device=vector.device)
                vector = torch.cat([vector, vote])
                if self.parallel.is_distributed:
                    vector = self.parallel.comm.all_reduce_sum(vector)  # the step's one collective
                read = self.parallel.comm.read_later(vector)  # queued on the compute stream
        return t, lr, num_tokens, read

    def _finish_step(
        self, t: int, lr: float, num_tokens: int, read: Callable[[], list[float]]
    ) -> StepResult:
        # the step's one host sync, where the device's errors in its queued pass surface
        with self.failures.guard(), self.failures.writing():
            *reduced, votes = read()
        grads = self.estimator.update_coefficients(reduced, self.config.eps)
        self.pending = self.momentum_update(PendingUpdate(t, grads, lr))
        self.step_index += 1
        reported = self.estimator.step_losses(reduced)
        return StepResult.of(t, lr, num_tokens, reduced, reported, grads, votes)

    def _stream_pass(
        self,
        passes: tuple[Pass, ...],
        step: int,
        input_ids: Mapping[Pass, torch.Tensor] | None,
        attention_mask: torch.Tensor | None,
        micro_batches: int = 1,
    ) -> dict[Pass, torch.Tensor]:
        """Apply the queued updates everywhere and run the blocks once for each pass, each
        on its own token ids (one shared host mask; None: every position is real), in
        ``micro_batches`` micro-batches. With no passes (flush) it only updates."""
        if input_ids:  # a batch too short to split is refused before any update is taken
            micro_batch_bounds(next(iter(input_ids.values())).shape[0], micro_batches)
        updates = self.updates.take()
        with self.failures.writing(bool(updates)):
            block_pass = BlockPass(self, step, updates, micro_batches)
            return block_pass.run(passes, input_ids, attention_mask)

    def _reading_resident(self, side: str, p: Pass, step: int) -> AbstractContextManager[None]:
        """While the body reads ``side`` (``EMBEDDING`` or ``HEAD``) of the resident bucket,
        the scratch holds it perturbed for pass ``p``."""
        return self.resident.reading(
            side, self.noise, self.resident_master, self.config.eps, p, step
        )

    # ------------------------------------------------------------------ other passes

    def forward(
        self, batch: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of every position (and mean loss, if the batch has labels) at the current,
        unperturbed parameters: the model's own forward, for inspection and tests.
        Evaluation uses ``evaluate``, which reads the head only where it is needed."""
        check_mapping(batch)
        check_lm_keys(batch)  # the model's own forward: a causal-LM batch, whatever objective
        self._check_batch(batch)
        mask = batch.get("attention_mask")
        host_mask = mask.cpu() if mask is not None else None
        with self.failures.guard(), torch.no_grad(), self.streams.compute_scope():
            input_ids, _, labels = on_device(batch, self.device)
            hidden = self._stream_pass(
                (UNPERTURBED,), self.step_index, {UNPERTURBED: input_ids}, host_mask
            )
            with self._reading_resident(HEAD, UNPERTURBED, self.step_index):
                logits = self.family.logits(hidden[UNPERTURBED])
            loss = self.family.loss(logits, labels, None) if labels is not None else None
        self._hand_to_caller((logits, loss))
        return logits, loss

    def evaluate(self, measure: Callable[[PassRunner], Measured]) -> Measured:
        """``measure(runner)`` on the model at its current parameters (the pending update
        applied first, as a flush would): the one pass is ``UNPERTURBED``. Whatever tensors
        it returns are safe to use on the caller's stream."""
        if not callable(measure):  # evaluate(3) was "'int' object is not callable"
            raise TypeError(
                "evaluate takes a measure, a function of the pass runner (measure(runner), as "
                f"distzo.job.evaluation builds them), got a {type(measure).__name__}"
            )
        self._in_eval_mode()
        with self.failures.guard(), torch.no_grad(), self.streams.compute_scope():
            result = measure(StepRunner(self, self.step_index, (UNPERTURBED,)))
        self._hand_to_caller(result)
        return result

    def flush(self) -> None:
        """Apply the pending update to every bucket now (before export or inspection).

        It is the same op the next step would apply, so flushing never changes the trajectory.
        """
        if not self.updates:
            return
        with self.failures.guard(), torch.no_grad(), self.streams.compute_scope():
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
        self.updates.queue_logged(logged, self.step_index)
        self.flush()
        self.step_index = logged[-1][0] + 1

    def _hand_to_caller(self, result: Any) -> None:
        """Tensors made on the compute stream and freed on the caller's (compute_scope
        already ordered the caller after the work that wrote them)."""
        if self.streams.is_async:
            caller = torch.cuda.current_stream(self.device)
            for leaf in tree_leaves(result):
                if isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda":
                    leaf.record_stream(caller)

    def _in_eval_mode(self) -> None:
        """Back in eval mode after a ``model.train()`` since the engine was made: dropout
        would make the two perturbed passes two functions, and ``g`` noise."""
        if self.model.training:
            logger.warning(
                "the model was in training mode: put back in eval mode (dropout would make "
                "each pass a different function)"
            )
            self.model.eval()

    def _check_batch(self, batch: Mapping[str, torch.Tensor], dims: int = 2) -> None:
        """``dims``: ``input_ids``' dimensions (a step's batch: its objective's)."""
        self._in_eval_mode()
        limit = getattr(self.model.config, "max_position_embeddings", None)
        vocab = self.family.model.get_input_embeddings().weight.shape[0]
        # the prefix's positions come first, after those the model reserves (RoBERTa's)
        reserved = self.family.reserved_positions(self.model.config)
        check_batch(batch, limit, self.family.prefix_length, vocab, dims, reserved)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The full training state, pending update included (no flush: saving stays cheap)."""
        return state.state_dict(self)

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Restore a ``state_dict``; the continued trajectory equals the uninterrupted one."""
        state.load_state_dict(self, saved)

    def check_noise(
        self, identity: str, chunk: int, source: str, lowrank: dict | None = None
    ) -> None:
        """Refuse a state drawn with other noise than this engine's (``state.check_noise``)."""
        state.check_noise(self.config, identity, chunk, source, lowrank)

    def restore(
        self, step: int, run_seed: int, pending: PendingUpdate | None, recent_steps: Any = ()
    ) -> None:
        """Set the step counter, run seed, pending update and momentum history (``(step, g)``
        of the recent steps, newest first) after the buckets were loaded."""
        self.step_index, self.run_seed = step, run_seed
        self.updates.restore(pending, recent_steps)
        # the noise is keyed by the run seed; the stores that round draw from the new source
        rounds, dtype = self.tuning.rounds(self.config), self.resident_master.dtype
        self.noise, self.rounding_noise = make_noise(
            self.config,
            run_seed,
            self.device,
            dtype,
            rounds,
            [self.resident_layout, *self.block_layouts],
        )
        for store in (self.store, *self.moments.blocks):
            if isinstance(store, StreamedBlocks):
                store.rounding_noise = self.rounding_noise
        self.resident.forget()
        self.failures.reset()

    # ------------------------------------------------------------------ sizes

    @property
    def streamed_store(self) -> Streamed:
        """The store whose blocks the scheduler moves: the frozen base under an adapter,
        the blocks with their moments when those travel too."""
        return self.tuning.streamed(self.carried if self.carried is not None else self.store)

    @property
    def link_bytes_per_step(self) -> int:
        """Bytes this rank uploads over the host link in a training step (and offloads, unless
        the blocks are a frozen base): every streamed block once, with its moments; 0 resident."""
        return sum(self.streamed_store.link_bytes(i) for i in range(len(self.blocks)))

    @property
    def state_device_bytes(self) -> int:
        """The moments on the device (resident bucket's, blocks' or their slots) and the
        update's scratch."""
        return self.moments.device_bytes + self.update_rule.device_bytes
