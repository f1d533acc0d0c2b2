"""The update a step leaves behind, and how it reaches the buckets.

A step does not write its update: it keeps ``(step, g, lr)`` (a few numbers) and each
bucket applies it the next time it is on the device, so a streamed block crosses the
link once per step. A catch-up (a resumed run, a replay) queues logged steps behind the
pending one and applies them all in one pass over the blocks. Momentum recomputed from
the gradient history rides on the update as that history; stored moments (Adam, a
stored momentum) are updated beside the bucket by a ``MomentUpdater``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from distzo.config.engine_options import ZOConfig
from distzo.offload import BucketLayout
from distzo.zo import NoiseSource
from distzo.zo.lowrank import LowRankNoise
from distzo.zo.lowrank_momentum import LowRankMomentum
from distzo.zo.moments import MomentRule, MomentUpdater

# (step, projected_grads) of recent steps, newest first: a momentum's history
History = tuple[tuple[int, tuple[float, ...]], ...]


def step_grads(entries: Iterable[Sequence]) -> History:
    """``(step, projected_grads)`` pairs as ints and float tuples (from lists, a state
    dict or a checkpoint): a momentum's history."""
    return tuple((int(step), tuple(float(g) for g in grads)) for step, grads in entries)


@dataclass(frozen=True)
class PendingUpdate:
    """The last step's update, applied lazily when each bucket next reaches the device:
    theta -= lr * (mean_j g_j z_j + wd theta), z_j drawn for (step, query j).

    With momentum recomputed from the gradient history (MeZO, appendix B.2) ``history``
    holds the earlier steps' ``(step, projected_grads)``, newest first, and the update is
    theta -= lr * (m_t + wd theta), m_t = sum_k beta1^k mean_j g_{t-k,j} z_{t-k,j}: the
    momentum regenerated from its seeds, truncated to ``1 + len(history)`` steps."""

    step: int
    projected_grads: tuple[float, ...]
    lr: float
    history: History = ()
    beta1: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "projected_grads", tuple(float(g) for g in self.projected_grads))
        object.__setattr__(self, "history", step_grads(self.history))
        if not self.projected_grads:
            raise ValueError("a pending update needs one projected gradient per query, got none")

    def terms(self) -> list[tuple[int, int, float]]:
        """``(step, query, coefficient of z)`` of every noise draw the update adds, over lr."""
        steps = [(self.step, self.projected_grads), *self.history]
        return [
            (step, query, -(self.beta1**k) * g / len(grads))
            for k, (step, grads) in enumerate(steps)
            for query, g in enumerate(grads)
        ]


class UpdateQueue:
    """The updates the buckets have not taken yet: the last step's (``pending``), after a
    catch-up the logged steps before it (``backlog``), and the momentum's history of
    recent steps, from which each new update is built."""

    def __init__(self, config: ZOConfig) -> None:
        self.config = config
        self.pending: PendingUpdate | None = None
        self.backlog: list[PendingUpdate] = []  # logged steps to apply before the pending one
        self.recent_steps: History = ()  # momentum: (step, g) newest first

    def __bool__(self) -> bool:
        return self.pending is not None or bool(self.backlog)

    def take(self) -> list[PendingUpdate]:
        """Every queued update, oldest first, leaving the queue empty: a pass over the
        blocks applies them all to each bucket it visits."""
        updates = [*self.backlog, *([self.pending] if self.pending is not None else [])]
        self.backlog, self.pending = [], None
        return updates

    def queue_logged(self, logged: list[tuple[int, tuple[float, ...], float]], step: int) -> None:
        """Queue logged steps ``(step, projected_grads, lr)`` behind the pending update, as
        if they had been trained; they must run on from ``step`` in order."""
        first = logged[0][0]
        if first != step or [s for s, _, _ in logged] != list(range(first, first + len(logged))):
            raise ValueError(
                f"logged steps must run on from step {step} in order, got {logged[0][0]}.."
            )
        updates = [self.pending] if self.pending is not None else []
        for logged_step, grads, lr in logged:
            updates.append(self.momentum_update(PendingUpdate(logged_step, grads, lr)))
        self.pending, self.backlog = updates[-1], updates[:-1]

    def restore(self, pending: PendingUpdate | None, recent_steps: Iterable[Sequence]) -> None:
        """Continue from a saved pending update and momentum history."""
        self.recent_steps = step_grads(recent_steps)
        self.pending = pending

    def momentum_update(self, update: PendingUpdate) -> PendingUpdate:
        """The step's update with the recent steps' g as its momentum history (``sgd``: as
        it is); the step joins the history."""
        if self.config.optimizer != "momentum":
            return update
        self.recent_steps = ((update.step, update.projected_grads), *self.recent_steps)[
            : self.config.momentum_window
        ]
        return self._with_history(update, self.recent_steps)

    def with_momentum(
        self, update: PendingUpdate | None, recent_steps: Iterable[Sequence]
    ) -> PendingUpdate | None:
        """``update`` (a step's own g) with the momentum history that precedes it in
        ``recent_steps`` (newest first, the update's own step included): how a resumed run
        or a replay rebuilds the pending update from a checkpoint or a seed log."""
        if update is None or self.config.optimizer != "momentum":
            return update
        return self._with_history(update, recent_steps)

    def _with_history(
        self, update: PendingUpdate, recent_steps: Iterable[Sequence]
    ) -> PendingUpdate:
        recent = tuple(recent_steps)
        history = recent[1:] if recent and recent[0][0] == update.step else recent
        return PendingUpdate(
            update.step,
            update.projected_grads,
            update.lr,
            step_grads(history[: self.config.momentum_window - 1]),
            self.config.beta1,
        )


class UpdateRule:
    """How an update changes one bucket in place: the noise terms of ZO-SGD (a recomputed
    momentum is more terms), or the stored moments' rule, which updates the bucket's
    moments first. The same op for every bucket, whatever pass applies it."""

    def __init__(self, config: ZOConfig, noise: NoiseSource) -> None:
        self.weight_decay = config.weight_decay
        self.moment_rule = MomentRule.of(config)
        # its scratch is sized by the first noise source; each apply draws from the current one
        self.moment_updater = MomentUpdater(self.moment_rule, noise) if self.moment_rule else None
        # LOZO-M: the momentum's factors of every bucket, on the device whatever the layout
        self.lowrank_momentum = (
            LowRankMomentum(noise, config.beta1)
            if config.lowrank_state and isinstance(noise, LowRankNoise)
            else None
        )

    @property
    def moment_names(self) -> tuple[str, ...]:
        """torch's names of the stored moments (none for ZO-SGD and recomputed momentum)."""
        return self.moment_rule.names if self.moment_rule else ()

    @property
    def device_bytes(self) -> int:
        """The moment update's scratch, or LOZO-M's factors, on the device."""
        lowrank = self.lowrank_momentum.device_bytes if self.lowrank_momentum else 0
        return (self.moment_updater.device_bytes if self.moment_updater else 0) + lowrank

    def apply(
        self,
        noise: NoiseSource,
        update: PendingUpdate,
        bucket: torch.Tensor,
        layout: BucketLayout,
        block_id: int,
        moments: list[torch.Tensor],
        start: int = 0,
    ) -> None:
        """theta of ``bucket`` (and its ``moments``) after ``update``; z drawn by ``noise``.
        ``bucket`` may be elements ``[start, start + n)`` of the layout's bucket where no
        moments are stored (a master rebuilt a piece at a time)."""
        if not layout.numel:
            return
        wd = self.weight_decay
        if self.lowrank_momentum is not None:
            if start or bucket.numel() != layout.numel or not isinstance(noise, LowRankNoise):
                raise ValueError("LOZO-M updates whole buckets with low-rank noise")
            self.lowrank_momentum.apply(
                noise,
                bucket,
                layout.decay_end,
                update.lr,
                wd,
                update.step,
                update.projected_grads[0],
                block_id,
            )
            return
        if self.moment_updater is not None:
            if start or bucket.numel() != layout.numel:
                raise ValueError("stored moments update whole buckets, not a piece of one")
            self.moment_updater.apply(
                noise,
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
        decay_end, shrink, terms = self.noise_terms(update, layout)
        noise.apply_terms(bucket, decay_end, shrink, terms, block_id, start, layout.numel)

    def noise_terms(
        self, update: PendingUpdate, layout: BucketLayout
    ) -> tuple[int, float, list[tuple[int, int, float]]]:
        """ZO-SGD's update of a bucket as ``NoiseSource.apply_terms`` takes it: where the
        decay ends, the shrink it applies, and each noise draw's ``(step, query, alpha)``."""
        wd = self.weight_decay
        terms = [(step, query, update.lr * c) for step, query, c in update.terms()]
        return layout.decay_end if wd else 0, 1.0 - update.lr * wd, terms
