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
``double_buffered`` has two buffers: it unpacks block i on the upload stream, after its
upload, and packs it on the offload stream, before its copy, so that the compute stream
runs nothing but the passes (ZO2's placement of its decompression and compression); then
  compute(i)  waits unpack(i)         -- the buffer holds block i's master
  unpack(i)   waits pack(i - 2)       -- master buffer i % 2 is free again
(compute(i - 2) in a pass that offloads nothing), and unpack(i) is queued on the upload
stream before the upload that waits for offload(i - 2) wherever upload(i) is already
queued, so that the upcast waits for the rounding alone, never for a copy.

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
        # Per master buffer (a double-buffered store has two): the event after which its
        # last block was packed (or computed, in a pass that offloads nothing), kept across
        # steps like the slots'.
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
        # this pass's events: block j's upload (per slot) and upcast (per master buffer)
        self._uploaded: list[torch.cuda.Event | None] = [None] * k
        self._unpacked: list[torch.cuda.Event | None] = [None, None]
        # Two master buffers (a double-buffered store): block j's upcast runs on the upload
        # stream, queued as soon as the host has queued both its upload and the release of
        # its buffer by block j - 2 (``ahead`` blocks before its compute), and its rounding
        # on the offload stream: the compute stream runs the passes alone.
        apart = self.store.double_buffered
        ahead = min(k, 2)
        for j in range(min(k, n)):
            self._upload(j)
            if apart and j < ahead:  # block 0's upcast waits for no later upload
                self._unpack(j)
        if prologue is not None:
            with s.on("compute"):
                self._phase("compute", PROLOGUE, prologue)
        for i in range(n):
            with s.on("compute"):
                s.wait("compute", self._unpacked[i % 2] if apart else self._uploaded[i % k])
                self._phase("compute", i, lambda: self._compute_block(i, compute, offload))
                computed = s.record("compute")
            if offload:
                with s.on("offload"):
                    s.wait("offload", computed)
                    self._phase("offload", i, lambda: self._offload_block(i))
                    self._slot_free[i % k] = s.record("offload")
            else:
                self._slot_free[i % k] = computed
                if apart:  # read only: the buffer is free once the compute is done
                    self._master_free[i % 2] = computed
            self._queue_ahead(i, apart, ahead)

    def _upload(self, j: int) -> None:
        s, k = self.streams, self.store.num_slots
        with s.on("upload"):
            s.wait("upload", self._slot_free[j % k])
            self._phase("upload", j, lambda: self.store.upload(j))
            self._uploaded[j % k] = s.record("upload")

    def _unpack(self, j: int) -> None:
        """Block j's upcast into master buffer j % 2, after upload(j) on the same stream."""
        s = self.streams
        with s.on("upload"):
            s.wait("upload", self._master_free[j % 2])
            self._phase("upload", j, lambda: self.store.unpack(j))
            self._unpacked[j % 2] = s.record("upload")

    def _compute_block(
        self, i: int, compute: Callable[[int, torch.Tensor], None], offload: bool
    ) -> None:
        # one buffer: the master exists from unpack to pack, on this stream alone
        apart = self.store.double_buffered
        if not apart:
            self.store.unpack(i)
        compute(i, self.store.device_bucket(i))
        if offload and not apart:
            self.store.pack(i)

    def _offload_block(self, i: int) -> None:
        if self.store.double_buffered:
            self.store.pack(i)
            self._master_free[i % 2] = self.streams.record("offload")
        self.store.offload(i)

    def _queue_ahead(self, i: int, apart: bool, ahead: int) -> None:
        """After block i: the upload into its slot (block i + K) and, with two buffers,
        block i + ahead's upcast. Each queue is FIFO: an upcast waiting for pack(i) must not
        sit behind the upload waiting for offload(i)'s copy, or compute(i + 2) waits for
        that copy; so it goes first wherever its own upload is already queued (K > ahead)."""
        n, k = self.num_blocks, self.store.num_slots
        unpack_next = apart and i + ahead < n
        if unpack_next and ahead < k:
            self._unpack(i + ahead)
            unpack_next = False
        if i + k < n:
            self._upload(i + k)
        if unpack_next:
            self._unpack(i + ahead)
