"""An optimizer's moment buckets, stored beside the trained buckets and moved with them.

Moment k of a bucket has the bucket's layout, so the update walks both in step. The
resident bucket's moments stay on the device with it. A block's moments live in a store
shaped like the block's own: under offload, host shards of their own (sliced over the
node like the weights under the sliced transfer, optionally bf16 at rest) that cross the
link with the block, in the same slots' pipeline (``CarriedStore``); otherwise on the
device beside the masters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distzo.offload.block_store import BlockStore


class Moments:
    """``names[k]`` (torch's name for the state) of every trained bucket:
    ``resident[k]`` beside the resident bucket, ``blocks[k]`` beside the blocks."""

    def __init__(
        self, names: Sequence[str], resident: list[torch.Tensor], blocks: list[BlockStore]
    ) -> None:
        self.names = tuple(names)
        self.resident = resident
        self.blocks = blocks

    def device_buckets(self, index: int) -> list[torch.Tensor]:
        """Block ``index``'s moments on the device (uploaded, when they travel)."""
        return [store.device_bucket(index) for store in self.blocks]

    def set_step(self, step: int) -> None:
        for store in self.blocks:
            store.step = step  # keys the stochastic rounding of a bf16 moment on its way back

    @property
    def host_bytes(self) -> int:
        return sum(store.host_bytes for store in self.blocks)

    @property
    def device_bytes(self) -> int:
        return sum(t.nbytes for t in self.resident) + sum(
            store.device_bytes for store in self.blocks
        )


class CarriedStore:
    """The block store the scheduler moves when blocks carry their moments: uploading or
    offloading block i moves its weights, then (while ``carry``) each moment, on the same
    stream and into slot i % K of each, so the scheduler's events cover them all. An
    evaluation pass (no update) leaves ``carry`` off: the moments stay at rest."""

    def __init__(self, weights: BlockStore, moments: Sequence[BlockStore]) -> None:
        if any(m.num_slots != weights.num_slots for m in moments):
            raise ValueError(
                "moments must have as many device slots as the blocks they travel with"
            )
        self.weights = weights
        self.moments = list(moments)
        self.carry = True

    @property
    def num_slots(self) -> int:
        return self.weights.num_slots

    @property
    def double_buffered(self) -> bool:
        """Where the weights pack, the moments do too: a low-bit moment is made with as many
        master buffers as its blocks (``engine.build.make_moments``)."""
        return self.weights.double_buffered

    def upload(self, index: int) -> None:
        self.weights.upload(index)
        if self.carry:
            for store in self.moments:
                store.upload(index)

    def unpack(self, index: int) -> None:
        self.weights.unpack(index)
        if self.carry:
            for store in self.moments:
                store.unpack(index)

    def pack(self, index: int) -> None:
        self.weights.pack(index)
        if self.carry:
            for store in self.moments:
                store.pack(index)

    def offload(self, index: int) -> None:
        self.weights.offload(index)
        if self.carry:
            for store in self.moments:
                store.offload(index)

    def device_bucket(self, index: int) -> torch.Tensor:
        return self.weights.device_bucket(index)

    def link_bytes(self, index: int) -> int:
        """Bytes of block ``index`` over the host link each way in a training step, its
        moments included (an evaluation, which leaves them at rest, moves the weights' alone)."""
        return self.weights.link_bytes(index) + sum(
            store.link_bytes(index) for store in self.moments
        )
