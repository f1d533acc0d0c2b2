"""The per-step block pipeline: upload i+1 while computing i while offloading i-1.

Ordering rules (each enforced by an event, never a global synchronize):
  compute(i)  waits upload(i)        -- the slot holds block i
  offload(i)  waits compute(i)       -- block i is updated
  upload(j)   waits offload(j - K)   -- slot j % K is free again
and each stream is FIFO. The last rule also orders a block's offload at step t
before its upload at step t+1, because that upload waits for a later offload on
the same FIFO stream.

Around each compute, on the compute stream, the store unpacks block i's master from its
slot and packs it back when the block is done (a low-bit store's one float32 buffer,
reused by the next block only after the pack, by the stream's order). A store that
``packs_on_offload`` has two buffers and packs block i on the offload stream, before its
copy, while block i + 1 computes in the other buffer; then a fourth rule:
  unpack(i)   waits pack(i - 2)       -- master buffer i % 2 is free again

A pass that changes no block (an evaluation forward, a decoding step: no pending
update) skips the offloads, whose host copies are already right: then a slot is free
again once its compute has read it, upload(j) waits compute(j - K).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from distzo.offload.block_store import BlockStore
from distzo.offload.streams import Streams
from distzo.offload.timeline import PROLOGUE, Timeline


class BlockScheduler:
    def __init__(self, store: BlockStore, streams: Streams, num_blocks: int) -> None:
        self.store = store
        self.streams = streams
        self.num_blocks = num_blocks
        # Per slot: the event after which the slot's last block has been offloaded.
        # Kept across steps so step t+1's first uploads wait for step t's last offloads.
        self._slot_free: list[torch.cuda.Event | None] = [None] * store.num_slots
        # Per master buffer (a store that packs on the offload stream has two): the event
        # after which its last block was packed, kept across steps like the slots'.
        self._master_free: list[torch.cuda.Event | None] = [None, None]
        self.timeline: Timeline | None = None

    def _phase(self, phase: str, block: int, work: Callable[[], None]) -> None:
        mark = self.timeline.start(phase) if self.timeline is not None else None
        work()
        if self.timeline is not None:
            self.timeline.end(phase, block, mark)

    def run(
        self,
        compute: Callable[[int, torch.Tensor], None],
        prologue: Callable[[], None] | None = None,
        offload: bool = True,
    ) -> None:
        """Stream every block through the device once, calling ``compute(i, bucket)``
        on the compute stream with block i's device master bucket.

        ``prologue`` runs on the compute stream after the first K uploads are queued (the
        embedding: the link starts moving blocks before the host queues any compute).
        ``offload=False``: the blocks were only read; nothing goes back to the host.
        """
        n, k = self.num_blocks, self.store.num_slots
        s = self.streams
        uploaded: list[torch.cuda.Event | None] = [None] * k

        def upload(j: int) -> None:
            with s.on("upload"):
                s.wait("upload", self._slot_free[j % k])
                self._phase("upload", j, lambda: self.store.upload(j))
                uploaded[j % k] = s.record("upload")

        for j in range(min(k, n)):
            upload(j)
        if prologue is not None:
            with s.on("compute"):
                self._phase("compute", PROLOGUE, prologue)

        # the master exists on the device from unpack to pack: on the compute stream alone,
        # or handed to the offload stream for its pack while the next block computes
        apart = self.store.packs_on_offload

        def compute_block(i: int) -> None:
            if apart:
                s.wait("compute", self._master_free[i % 2])
            self.store.unpack(i)
            compute(i, self.store.device_bucket(i))
            if offload and not apart:
                self.store.pack(i)

        def offload_block(i: int) -> None:
            if apart:
                self.store.pack(i)
                self._master_free[i % 2] = s.record("offload")
            self.store.offload(i)

        for i in range(n):
            with s.on("compute"):
                s.wait("compute", uploaded[i % k])
                self._phase("compute", i, lambda: compute_block(i))
                computed = s.record("compute")
            if offload:
                with s.on("offload"):
                    s.wait("offload", computed)
                    self._phase("offload", i, lambda: offload_block(i))
                    self._slot_free[i % k] = s.record("offload")
            else:
                self._slot_free[i % k] = computed
            if i + k < n:
                upload(i + k)
