"""A low-bit block's master, rebuilt a piece at a time instead of held whole.

Under a low-bit transfer a block rests in bf16/fp16/fp8 and its float32 master exists
only while the block computes. By default the store holds it in one buffer the size of
the largest block: upcast once, updated once, perturbed from for every pass, rounded
back (``StreamedBlocks.unpack``/``pack``). With ``low_bit_master="recompute"`` there is
no such buffer: the block's slot keeps the values at rest until the block is done, and
whoever reads the master rebuilds it here, ``chunk`` elements at a time in one small
staging buffer: the piece upcast, then every queued update applied to it. Each pass
perturbs the rebuilt pieces into its scratch, and the write-back rounds them into the
slot (``StreamedBlocks.round_piece``). On CUDA a bf16 or fp16 block skips the staging:
one kernel per pass rebuilds and perturbs (``rebuild_perturb``), one per owned piece
rebuilds and rounds in place (``rebuild_round``).

Every element takes the operations it takes in the buffer, in the same order (the
upcast, each update's decay and noise terms, then the perturbation or the rounding), and
its noise is keyed by its place in the block, so the trajectory is the same bit for bit.
The price is noise work: the update's draws are made once per pass and once for the
write-back instead of once per step, which a transfer-bound step hides (the period is
the slowest of upload, compute and offload) and a compute-bound one pays.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from distzo.offload import BucketLayout, StreamedBlocks

if TYPE_CHECKING:
    from distzo.engine.updates import PendingUpdate, UpdateRule
    from distzo.zo import NoiseSource


@dataclass(frozen=True)
class BlockVisit:
    """What rebuilding a block's master takes while the block is on the device: its values
    at rest (its slot), the updates it has not taken, the rule and noise that apply them,
    its layout and its block id (its noise's key)."""

    at_rest: torch.Tensor
    updates: Sequence[PendingUpdate]
    rule: UpdateRule
    noise: NoiseSource
    layout: BucketLayout
    block_id: int


class RebuiltMaster:
    """The staging buffer (``chunk`` elements of the master dtype), how a block's master is
    rebuilt in it from the block's values at rest, and the store it is written back to."""

    def __init__(
        self, store: StreamedBlocks, chunk: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.store = store
        self.stage = torch.empty(min(chunk, max(store.padded)), device=device, dtype=dtype)

    @property
    def device_bytes(self) -> int:
        return self.stage.numel() * self.stage.element_size()

    def pieces(
        self, visit: BlockVisit, lo: int, hi: int
    ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """``(a, b, master)``: elements ``[a, b)`` of the block's master after its updates,
        covering ``[lo, hi)``. Each piece is a view of the staging buffer, valid until the
        next is made (work queued on one stream runs in order)."""
        size = self.stage.numel()
        for a in range(lo, hi, size):
            b = min(a + size, hi)
            master = self.stage[: b - a]
            master.copy_(visit.at_rest[a:b])
            for update in visit.updates:
                visit.rule.apply(visit.noise, update, master, visit.layout, visit.block_id, [], a)
            yield a, b, master

    def perturb_into(
        self, out: torch.Tensor, visit: BlockVisit, scale: float, step: int, query: int
    ) -> None:
        """``out`` <- the block's master after its updates, + scale * z of the pass: in one
        fused kernel where the noise has one (CUDA; a 16-bit block, a float32 master and at
        most one update, the step's), else piece by piece. An unperturbed pass (scale 0, an
        evaluation's, FZOO's) is a copy of the master, as ``perturb_into`` makes it: the
        fused kernel's ``theta + 0 * z`` would turn a -0.0 into +0.0."""
        self.perturb_range(out, visit, scale, step, query, 0, visit.at_rest.numel())

    def perturb_range(
        self,
        out: torch.Tensor,
        visit: BlockVisit,
        scale: float,
        step: int,
        query: int,
        lo: int,
        hi: int,
    ) -> None:
        """``perturb_into`` of elements ``[lo, hi)`` alone, into ``out`` (``hi - lo``
        elements): the whole block, or one module's weights (``perturb_scope="module"``),
        the fused kernel taking the part at its offset."""
        n, noise = visit.at_rest.numel(), visit.noise
        update = self._fusable_update(visit)
        if scale != 0.0 and update is not None:
            decay_end, shrink, terms = update
            rest = visit.at_rest[lo:hi]
            if noise.rebuild_perturb_into(
                out, rest, decay_end, shrink, terms, visit.block_id, scale, step, query, lo
            ):
                return
        for a, b, master in self.pieces(visit, lo, hi):
            noise.perturb_into(
                out[a - lo : b - lo], master, scale, step, visit.block_id, query, a, n
            )

    def write_back(self, index: int, visit: BlockVisit) -> None:
        """Block ``index``'s rebuilt master rounded into this rank's pieces of its slot, for
        the offload: in place, one fused kernel per piece where the noise has one (CUDA; a
        16-bit block, a float32 master, the step's one update), else piece by piece."""
        store, update = self.store, self._fusable_update(visit)
        rounding, step, stream = store.rounding(index)
        wire = store.wire(index)
        for lo, hi in store.share_ranges(index):
            if update is not None and visit.noise.rebuild_round_into(
                wire[lo:hi], lo, *update, visit.block_id, rounding, step, stream
            ):
                continue
            for a, _, master in self.pieces(visit, lo, hi):
                store.round_piece(index, a, master)

    def _fusable_update(self, visit: BlockVisit) -> tuple[int, float, list] | None:
        """The update as a fused kernel takes it (``UpdateRule.noise_terms``; none: no
        decay, no terms), where one could: a float32 master and at most one update."""
        if self.stage.dtype != torch.float32 or len(visit.updates) > 1:
            return None
        if not visit.updates:
            return 0, 1.0, []
        return visit.rule.noise_terms(visit.updates[0], visit.layout)
