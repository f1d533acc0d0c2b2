"""One pass over the blocks, running every perturbed pass of a step.

Each block is uploaded once, takes the queued updates right there (so it crosses the
link once per step), and then runs every pass: alone, perturbed out of place into the
one block scratch, or several passes in one batched forward (P-RGE), each with its own
perturbed adapter. With gradient accumulation each pass's rows are split into
micro-batches run one after another while the block is on the device, the hidden states
of every micro-batch carried between blocks. A bound on a micro-batch's rows
(``micro_batch_rows``) adds micro-batches where a batch has more rows: a choice batch's
rows are candidates, which never attend to each other, so even one example's candidates
split without changing a score.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch

from distzo.engine.layouts import RESIDENT_BLOCK_ID
from distzo.engine.module_scratch import Fill
from distzo.engine.rebuilt_master import BlockVisit
from distzo.engine.resident_sides import EMBEDDING, HEAD
from distzo.engine.updates import PendingUpdate
from distzo.runtime.option_names import option_name as _n
from distzo.zo import Pass

if TYPE_CHECKING:
    from distzo.engine.engine import ZOEngine

UNPERTURBED: Pass = (0, 0)  # the pass of an evaluation forward: theta itself

Group = tuple[Pass, ...]  # passes that run in one forward, their rows one after another


def micro_batch_bounds(rows: int, micro_batches: int) -> list[tuple[int, int]]:
    """Row ranges of ``micro_batches`` near-equal micro-batches (the first ones one row
    larger when ``rows`` does not divide); refused when there are fewer rows than that."""
    if micro_batches > rows:
        raise ValueError(
            f"{_n('grad_accum')} {micro_batches} needs at least {micro_batches} rows per rank, "
            f"the batch has {rows}; lower {_n('grad_accum')} or raise "
            f"{_n('batch_size', python='the rows passed')}"
        )
    size, extra = divmod(rows, micro_batches)
    bounds, lo = [], 0
    for m in range(micro_batches):
        hi = lo + size + (1 if m < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def micro_batch_count(rows: int, micro_batches: int, most_rows: int) -> int:
    """The micro-batches a pass's ``rows`` run in: ``micro_batches`` (--grad-accum), or more
    where a near-equal split would leave one above ``most_rows`` (--micro-batch-rows; 0: no
    bound). ``micro_batch_bounds`` of that count holds at most ``most_rows`` a micro-batch."""
    if most_rows < 1:
        return micro_batches
    return max(micro_batches, -(-rows // most_rows))


def pass_grouping(dual: bool, queries: bool) -> Callable[[tuple[Pass, ...]], list[Group]]:
    """How a rank's passes are grouped into batched forwards: the two signs of a query
    together (``dual``), one sign of every query together (``queries``), all of them
    (both), or each alone (neither). Groups keep the order of the passes given."""

    def key(p: Pass) -> tuple[int | None, int | None]:
        query, sign = p
        return (None if queries else query, None if dual else sign)

    def groups(order: tuple[Pass, ...]) -> list[Group]:
        out: dict[Any, list[Pass]] = {}
        for p in order:
            out.setdefault(key(p), []).append(p)
        return [tuple(g) for g in out.values()]

    return groups


class BlockPass:
    """One pass over the blocks at ``step``, applying ``updates`` to every bucket it
    visits (a flush: no passes at all)."""

    def __init__(
        self,
        engine: ZOEngine,
        step: int,
        updates: list[PendingUpdate],
        micro_batches: int = 1,
    ) -> None:
        self.engine, self.step, self.updates = engine, step, updates
        self.micro_batches = micro_batches
        self.order: tuple[Pass, ...] = ()
        self.groups: list[Group] = []
        # Each group's hidden states as a list of micro-batches, each micro-batch holding
        # the group's passes' rows, pass-major.
        self.hiddens: dict[Group, list[torch.Tensor]] = {}
        self.contexts: dict[int, list[Any]] = {}  # by group size: one per micro-batch

    def run(
        self,
        passes: tuple[Pass, ...],
        input_ids: Mapping[Pass, torch.Tensor] | None,
        attention_mask: torch.Tensor | None,
    ) -> dict[Pass, torch.Tensor]:
        """Each pass's last hidden state, the pass whose perturbation the resident scratch
        holds first (the order in which reading heads re-perturbs it least)."""
        engine = self.engine
        engine.store.step = self.step
        engine.moments.set_step(self.step)
        if engine.carried is not None:
            engine.carried.carry = bool(self.updates)  # moments travel only to be updated
        if self.updates:
            engine.resident.forget()
        held = engine.resident.held_pass(self.step)
        # embed the held pass first: one perturbation fewer
        self.order = tuple(sorted(passes, key=lambda p: p != held))
        grouped = engine.pass_scratch is not None
        self.groups = engine.pass_groups_of(self.order) if grouped else [(p,) for p in self.order]
        # Unchanged blocks (no update) need not go back: their host copies are right, and
        # a frozen base never changes.
        engine.scheduler.run(
            self.compute,
            prologue=lambda: self.embed(input_ids, attention_mask),
            offload=bool(self.updates) and engine.tuning.streams_trained,
        )
        return self.outputs()

    def embed(
        self, input_ids: Mapping[Pass, torch.Tensor] | None, attention_mask: torch.Tensor | None
    ) -> None:
        """Update the resident bucket and embed every pass's micro-batches (runs once the
        first uploads are queued)."""
        engine = self.engine
        for update in self.updates:
            engine.update_rule.apply(
                engine.noise,
                update,
                engine.resident_master,
                engine.resident_layout,
                RESIDENT_BLOCK_ID,
                engine.moments.resident,
            )
        if input_ids is None or not self.order:
            return
        rows, length = input_ids[self.order[0]].shape
        bounds = micro_batch_bounds(rows, self.micro_batches)
        self._make_contexts(bounds, length, attention_mask)
        own = {}
        for p in self.order:
            with engine._reading_resident(EMBEDDING, p, self.step):
                own[p] = [
                    engine.family.embed(input_ids[p][lo:hi], ctx)
                    for (lo, hi), ctx in zip(bounds, self.contexts[1])
                ]
        for group in self.groups:
            parts = [own.pop(p) for p in group]
            self.hiddens[group] = (
                parts[0] if len(group) == 1 else [torch.cat(micro) for micro in zip(*parts)]
            )

    def _make_contexts(
        self, bounds: list[tuple[int, int]], length: int, attention_mask: torch.Tensor | None
    ) -> None:
        """Each group size's model context per micro-batch, masks from the host copy: no
        device reads."""
        engine = self.engine
        dtype = engine.block_scratch.dtype
        for g in {len(group) for group in self.groups} | {1}:
            self.contexts[g] = [
                engine.family.context(
                    attention_mask[lo:hi].repeat(g, 1) if attention_mask is not None else None,
                    (g * (hi - lo), length),
                    engine.device,
                    dtype,
                )
                for lo, hi in bounds
            ]

    def compute(self, i: int, bucket: torch.Tensor) -> None:
        """Block ``i`` on the device: take the updates, then run every group through it.
        A master rebuilt per read (``engine.rebuilt``) takes them wherever it is read,
        and is written back once every group has run."""
        engine = self.engine
        if engine.resident.shares_blocks:
            engine.resident.forget()  # the block overwrites the scratch the sides take turns in
        bucket = engine.tuning.visit(i, bucket)
        if engine.rebuilt is None:
            for update in self.updates:
                engine.update_rule.apply(
                    engine.noise,
                    update,
                    bucket,
                    engine.block_layouts[i],
                    i + 1,
                    engine.moments.device_buckets(i),
                )
        for group in self.groups:
            if len(group) == 1:
                self._alone(i, bucket, group)
            else:
                self._batched(i, bucket, group)
        if engine.rebuilt is not None and self.updates:
            engine.rebuilt.write_back(i, self._visit(i, bucket))

    def _visit(self, i: int, at_rest: torch.Tensor) -> BlockVisit:
        """What rebuilding block ``i``'s master from ``at_rest`` takes in this pass."""
        engine = self.engine
        layout = engine.block_layouts[i]
        return BlockVisit(at_rest, self.updates, engine.update_rule, engine.noise, layout, i + 1)

    def _fill(self, i: int, bucket: torch.Tensor, sign: int, query: int) -> Fill:
        """What writes elements ``[lo, hi)`` of block ``i``'s master, perturbed for the pass
        ``(query, sign)``, into ``out``: the whole block (``[0, n)``), or one module's
        weights at a time (``ModuleScratch``), the same values either way."""
        engine, step = self.engine, self.step
        scale, n = sign * engine.config.eps, bucket.numel()
        rebuilt = engine.rebuilt
        if rebuilt is None:

            def fill(out: torch.Tensor, lo: int, hi: int) -> None:
                engine.noise.perturb_into(out, bucket[lo:hi], scale, step, i + 1, query, lo, n)

            return fill
        visit = self._visit(i, bucket)
        return lambda out, lo, hi: rebuilt.perturb_range(out, visit, scale, step, query, lo, hi)

    def _alone(self, i: int, bucket: torch.Tensor, group: Group) -> None:
        engine = self.engine
        ((query, sign),) = group
        fill = self._fill(i, bucket, sign, query)
        reading: AbstractContextManager[None]
        if engine.module_scratch is not None:
            reading = engine.module_scratch.reading(i, fill)
        else:
            reading = nullcontext()
            if bucket.numel():
                fill(engine.block_scratch, 0, bucket.numel())
        with reading:
            self.hiddens[group] = [
                engine.family.block_forward(engine.blocks[i], h, ctx)
                for h, ctx in zip(self.hiddens[group], self.contexts[1])
            ]

    def _batched(self, i: int, bucket: torch.Tensor, group: Group) -> None:
        engine = self.engine
        with engine.tuning.stacked(i, len(group)) as rows:
            for k, (query, sign) in enumerate(group):  # each pass's adapter, side by side
                self._fill(i, bucket, sign, query)(rows[k], 0, bucket.numel())
            self.hiddens[group] = [
                engine.family.block_forward(engine.blocks[i], h, ctx)
                for h, ctx in zip(self.hiddens[group], self.contexts[len(group)])
            ]

    def outputs(self) -> dict[Pass, torch.Tensor]:
        """Each pass's rows out of its group's micro-batches, in reverse pass order."""
        out: dict[Pass, list[torch.Tensor]] = {p: [] for p in self.order}
        for group, micro in self.hiddens.items():
            for h in micro:  # a batched micro-batch holds its passes' rows one after another
                for p, rows in zip(group, h.chunk(len(group))):
                    out[p].append(rows)
        return {
            p: out[p][0] if len(out[p]) == 1 else torch.cat(out[p]) for p in reversed(self.order)
        }


class StepRunner:
    """The engine seen by an objective: one step's passes, blocks streamed per call."""

    def __init__(
        self,
        engine: ZOEngine,
        step: int,
        passes: tuple[Pass, ...],
        micro_batches: int = 1,
        most_rows: int = 0,
    ) -> None:
        self.engine, self.step, self.passes = engine, step, passes
        self.micro_batches, self.most_rows = micro_batches, most_rows
        self.device = engine.device

    def hidden_states(
        self, input_ids: Mapping[Pass, torch.Tensor], attention_mask: torch.Tensor | None
    ) -> dict[Pass, torch.Tensor]:
        """Each pass's last hidden states; the first call of a step applies its updates."""
        if set(input_ids) != set(self.passes):
            raise ValueError(
                f"hidden_states needs token ids for the passes {self.passes}, "
                f"got {tuple(input_ids)}"
            )
        rows = next(iter(input_ids.values())).shape[0] if input_ids else 0
        micro_batches = micro_batch_count(rows, self.micro_batches, self.most_rows)
        return self.engine._stream_pass(
            self.passes, self.step, input_ids, attention_mask, micro_batches
        )

    def head(self, p: Pass, hidden: torch.Tensor) -> torch.Tensor:
        """Logits under pass ``p``'s perturbation of the resident bucket."""
        with self.engine._reading_resident(HEAD, p, self.step):
            return self.engine.family.logits(hidden)
