"""A low-bit block's master, rebuilt a piece at a time instead of held whole.

Under a low-bit transfer a block rests in bf16/fp16/fp8 and its float32 master exists
only while the block computes. By default the store holds it in one buffer the size of
the largest block: upcast once, updated once, perturbed from for every pass, rounded
back (``StreamedBlocks.unpack``/``pack``). With ``low_bit_master="recompute"`` there is
no such buffer: the block's slot keeps the values at rest until the block is done, and
whoever reads the master rebuilds it here, ``chunk`` elements at a time in one small
staging buffer: the piece upcast, then every queued update applied to it. Each pass
perturbs the rebuilt pieces into its scratch, and the write-back rounds them into the
slot (``StreamedBlocks.pack_rebuilt``).

Every element takes the operations it takes in the buffer, in the same order (the
upcast, each update's decay and noise terms, then the perturbation or the rounding), and
its noise is keyed by its place in the block, so the trajectory is the same bit for bit.
The price is noise work: the update's draws are made once per pass and once for the
write-back instead of once per step, which a transfer-bound step hides (the period is
the slowest of upload, compute and offload) and a compute-bound one pays.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from distzo.offload import BucketLayout, StreamedBlocks

if TYPE_CHECKING:
    from distzo.engine.updates import PendingUpdate, UpdateRule
    from distzo.zo import NoiseSource


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
        self,
        at_rest: torch.Tensor,
        lo: int,
        hi: int,
        updates: Sequence[PendingUpdate],
        rule: UpdateRule,
        noise: NoiseSource,
        layout: BucketLayout,
        block_id: int,
    ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """``(a, b, master)``: elements ``[a, b)`` of the block's master after ``updates``,
        covering ``[lo, hi)`` of ``at_rest`` (the block in its slot, as it rests). Each
        piece is a view of the staging buffer, valid until the next is made (work queued
        on one stream runs in order)."""
        size = self.stage.numel()
        for a in range(lo, hi, size):
            b = min(a + size, hi)
            master = self.stage[: b - a]
            master.copy_(at_rest[a:b])
            for update in updates:
                rule.apply(noise, update, master, layout, block_id, [], start=a)
            yield a, b, master

    def perturb_into(
        self,
        out: torch.Tensor,
        at_rest: torch.Tensor,
        updates: Sequence[PendingUpdate],
        rule: UpdateRule,
        noise: NoiseSource,
        layout: BucketLayout,
        block_id: int,
        scale: float,
        step: int,
        query: int,
    ) -> None:
        """``out`` <- the block's master after ``updates``, + scale * z of the pass: in one
        fused kernel where the noise has one (CUDA; a 16-bit block, a float32 master and at
        most one update, the step's), else piece by piece."""
        n = at_rest.numel()
        if self.stage.dtype == torch.float32 and len(updates) <= 1:
            decay_end, shrink, terms = (
                rule.noise_terms(updates[0], layout) if updates else (0, 1.0, [])
            )
            fused = noise.rebuild_perturb_into(
                out, at_rest, decay_end, shrink, terms, block_id, scale, step, query
            )
            if fused:
                return
        for a, b, master in self.pieces(at_rest, 0, n, updates, rule, noise, layout, block_id):
            noise.perturb_into(out[a:b], master, scale, step, block_id, query, a, n)

    def write_back(
        self, index: int, masters: Callable[[int, int], Iterator[tuple[int, int, torch.Tensor]]]
    ) -> None:
        """Block ``index``'s rebuilt master rounded into its slot, for the offload."""
        self.store.pack_rebuilt(index, masters)
