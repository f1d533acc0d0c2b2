"""Block masters in host memory, streamed through K device slots (ZO2 / DistZO2).

One class covers both transfer modes, because naive is sliced with one owner:

* **naive** (``shard`` None): this rank holds every block whole and moves all M
  elements each way.
* **sliced**: the n ranks of a node each own M/n elements (padded) of every block,
  in one host allocation made at start-up. Upload copies the own share over PCIe
  into its place in the slot, then all-gathers the shares over the node's
  interconnect into the full slot; offload copies only the own share back. Since
  every rank applies the same update to the full block, each owner's share is right.
  The share is striped in ``chunks`` pieces (rank k owns pieces j*n + k), so that
  piece j's all-gather, issued asynchronously, overlaps piece j+1's PCIe copy.

With a low-bit ``transfer_dtype`` the host copy and the wire carry bf16/fp16/fp8: the
K slots hold the wire format, and one fp32 master buffer serves them all, since a master
lives only while its block computes: ``unpack`` rebuilds it from the wire slot (upcast)
on the compute stream before the update, ``pack`` rounds it stochastically back into the
wire slot (see ``low_bit``) before the next block's ``unpack``, and ``offload`` copies the
wire slot to the host. K fp32 slots would cost K - 1 more blocks of device memory (3 x
2.4 GB at OPT-30B) for the same arithmetic. With two master buffers
(``master_buffers=2``, ``double_buffered``) the scheduler runs ``unpack`` on the upload
stream and ``pack`` on the offload stream instead, while the compute stream runs another
block in the other buffer (where ZO2 decompresses and compresses a block): one fp32
block more for a compute stream that runs the passes alone.
Without a master buffer (``master_buffers=0``), the block computes from its wire slot,
which keeps the values at rest until the block is done: whoever computes rebuilds the
master a piece at a time where it reads it, and hands the rebuilt pieces to
``round_piece`` for the way back.

``read_only``: the frozen base of an adapter run. Blocks only go up; nothing is ever
written back, so a low-bit host copy is rounded once, to nearest, when it is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from distzo.offload.bucket import ALIGN_ELEMENTS, BucketLayout, round_up
from distzo.offload.device_slots import DeviceSlots
from distzo.offload.low_bit import round_keyed_, round_nearest_
from distzo.offload.pinned import pinned_zeros

if TYPE_CHECKING:  # offload takes a noise source and the job's collectives; it reaches into neither
    from distzo.dist import Collectives
    from distzo.zo import NoiseSource

# Rounding noise ids live far above block ids, so they never reuse a perturbation's seeds;
# each other store that rounds (an optimizer's moments) takes a further multiple.
ROUNDING_STREAM = 1 << 40


@dataclass
class Shard:
    """This rank's share of the host copy: slice ``rank`` of ``size``, gathered over
    ``group`` by ``comm`` (the job's collectives: device placement and waits)."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    comm: Collectives | None = None


def _host_slices(
    lengths: list[int], dtype: torch.dtype, pin: bool
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One zeroed host allocation for every block's slice, and the slices, in order: pinned
    (for a CUDA device) at its exact size, which the caching allocator behind
    ``pin_memory=True`` would round up to 2^k."""
    total = sum(lengths)
    storage = pinned_zeros(total, dtype) if pin else torch.zeros(total, dtype=dtype)
    slices, offset = [], 0
    for length in lengths:
        slices.append(storage[offset : offset + length])
        offset += length
    return storage, slices


class StreamedBlocks:
    def __init__(
        self,
        layouts: list[BucketLayout],
        device: torch.device,
        num_slots: int,
        transfer_dtype: torch.dtype | None = None,
        shard: Shard | None = None,
        rounding_noise: NoiseSource | None = None,
        chunks: int = 1,
        read_only: bool = False,
        rounding_stream: int = ROUNDING_STREAM,
        master_buffers: int = 1,
    ) -> None:
        if chunks < 1:
            raise ValueError(f"transfer chunks must be >= 1, got {chunks}")
        if master_buffers not in (0, 1, 2):
            raise ValueError(f"master_buffers must be 0, 1 or 2, got {master_buffers}")
        device = torch.device(device)
        self.layouts = layouts
        self.shard = shard if shard is not None else Shard(None, 0, 1)
        n = self.shard.size
        master_dtype = layouts[0].dtype
        self.transfer_dtype = transfer_dtype or master_dtype
        self.low_bit = self.transfer_dtype != master_dtype
        self.read_only = read_only
        if self.low_bit and rounding_noise is None and not read_only:
            raise ValueError("a low-bit transfer needs a rounding noise source")
        self.rounding_noise = rounding_noise
        self.rounding_stream = rounding_stream  # noise ids of its rounding: rounding_stream + block
        self.step = 0  # the pass's step: keys the rounding noise on the way back
        # Sliced only: a single owner has nothing to overlap its copy with.
        self.chunks = chunks if n > 1 else 1
        # Padded so that every piece has the same length and starts aligned.
        self.padded = [
            round_up(layout.numel, n * self.chunks * ALIGN_ELEMENTS) for layout in layouts
        ]
        self.slice_len = [p // n for p in self.padded]

        pin = device.type == "cuda"
        self.host_storage, self.host_slices = _host_slices(self.slice_len, self.transfer_dtype, pin)
        self.host_pinned = pin

        biggest = max(self.padded)
        # The K slots hold what crosses the link: uploads land there, offloads leave from
        # there. Where that is a low-bit wire of a trained store, the block computes in
        # ``unpacked``, one buffer of the master dtype for all K slots (two where the
        # upload and offload streams upcast and round); otherwise (full precision, or a frozen base
        # whose reader upcasts) the slot is what computes.
        self.slots = DeviceSlots(num_slots, biggest, device, self.transfer_dtype)
        trained_low_bit = self.low_bit and not read_only
        # A trained low-bit store without the buffer has its master rebuilt by the caller.
        self.rebuilds = trained_low_bit and master_buffers == 0
        self.unpacked = (
            DeviceSlots(master_buffers, biggest, device, master_dtype)
            if trained_low_bit and master_buffers
            else None
        )
        # Two buffers: block i is upcast and rounded on the upload and offload streams
        # while another computes in the other one (the scheduler orders every use).
        self.double_buffered = self.unpacked is not None and len(self.unpacked) == 2
        self.num_slots = num_slots
        self._non_blocking = pin

    # -------------------------------------------------------------- BlockStore API

    def _pieces(self, index: int):
        """(host range, slot range) of each piece this rank owns, in host order."""
        piece = self.slice_len[index] // self.chunks
        n, k = self.shard.size, self.shard.rank
        for j in range(self.chunks):
            slot_lo = (j * n + k) * piece
            yield (j * piece, (j + 1) * piece), (slot_lo, slot_lo + piece)

    @property
    def _comm(self) -> Collectives:
        """The collectives that gather a sliced host copy (a whole copy gathers nothing)."""
        if self.shard.comm is None:
            raise ValueError("a sliced host copy is gathered by the job's collectives: Shard.comm")
        return self.shard.comm

    def wire(self, index: int) -> torch.Tensor:
        """Block ``index``'s slot in the wire format (padded)."""
        return self.slots.for_block(index, self.padded[index])

    def rounding(self, index: int) -> tuple[NoiseSource, int, int]:
        """How block ``index`` is rounded on its way back: the rounding's noise source, and
        the step and stream that key its uniforms."""
        assert self.rounding_noise is not None  # a low-bit store that writes back has one
        return self.rounding_noise, self.step, self.rounding_stream + index

    def _unpacked(self, index: int) -> torch.Tensor:
        assert self.unpacked is not None  # a trained low-bit store's
        return self.unpacked.for_block(index, self.padded[index])

    def upload(self, index: int) -> None:
        wire, host = self.wire(index), self.host_slices[index]
        gathers = []
        piece_len = self.slice_len[index] // self.chunks * self.shard.size
        for j, ((h_lo, h_hi), (s_lo, s_hi)) in enumerate(self._pieces(index)):
            wire[s_lo:s_hi].copy_(host[h_lo:h_hi], non_blocking=self._non_blocking)
            if self.shard.size > 1:
                # In place (the input is this rank's own piece of the output), as bytes: a
                # gather moves bits unchanged, and bytes work for every format on every
                # backend. Asynchronous, so the next piece's copy overlaps this gather.
                raw = wire[j * piece_len : (j + 1) * piece_len].view(torch.uint8)
                own = wire[s_lo:s_hi].view(torch.uint8)
                gathers.append(self._comm.all_gather_into(raw, own, self.shard.group))
        for work in gathers:
            # on CUDA: the current (upload) stream waits, the host does not
            self._comm.wait(work)

    def unpack(self, index: int) -> None:
        """Block ``index``'s master in ``device_bucket``, from its uploaded slot: a low-bit
        wire upcast into the one master buffer (a no-op where the slot is the master)."""
        if self.unpacked is not None:
            self._unpacked(index).copy_(self.wire(index))

    def pack(self, index: int) -> None:
        """The updated master back into the wire format, this rank's pieces (what
        ``offload`` copies): rounded stochastically, keyed by the element's place in the
        block, while the master buffer still holds this block (on the compute stream, or
        the offload stream where ``double_buffered``)."""
        if self.unpacked is None:
            return
        master, wire = self._unpacked(index), self.wire(index)
        for _, (s_lo, s_hi) in self._pieces(index):
            self._round_into(wire[s_lo:s_hi], master[s_lo:s_hi], index, s_lo)

    def round_piece(self, index: int, lo: int, master: torch.Tensor) -> None:
        """``pack`` for a store without the master buffer, a piece at a time: elements
        ``[lo, lo + n)`` of block ``index``'s rebuilt master rounded into its wire slot as
        ``pack`` rounds them (the caller covers this rank's ``share_ranges``)."""
        self._round_into(self.wire(index)[lo : lo + master.numel()], master, index, lo)

    def offload(self, index: int) -> None:
        """This rank's pieces of the slot to the host (a low-bit slot was ``pack``ed)."""
        if self.read_only:
            raise RuntimeError("a read-only block store (a frozen base) is never written back")
        slot, host = self.wire(index), self.host_slices[index]
        for (h_lo, h_hi), (s_lo, s_hi) in self._pieces(index):
            host[h_lo:h_hi].copy_(slot[s_lo:s_hi], non_blocking=self._non_blocking)

    def device_bucket(self, index: int) -> torch.Tensor:
        buffers = self.unpacked if self.unpacked is not None else self.slots
        return buffers.for_block(index, self.layouts[index].numel)

    def block_at_rest(self, index: int) -> torch.Tensor:
        """The whole block in its host format (the transfer dtype), exactly as stored: what
        a checkpoint must hold. A single owner's host copy is the block (a view, no
        transfer); shares of several ranks are gathered through the device (collective)."""
        numel = self.layouts[index].numel
        if self.shard.size == 1:
            return self.host_slices[index][:numel]  # one piece, in block order
        self.upload(index)
        return self.wire(index)[:numel]

    @property
    def rest_dtype(self) -> torch.dtype:
        return self.transfer_dtype

    def master(self, index: int) -> torch.Tensor:
        """This rank's host slice of block ``index`` (the whole block when naive)."""
        return self.host_slices[index]

    def load_block(self, index: int, values: torch.Tensor) -> None:
        """Take this rank's share of a whole block's initial values (round-to-nearest)."""
        self.load_block_ranges(index, lambda lo, hi: values[lo:hi])

    def share_ranges(self, index: int) -> list[tuple[int, int]]:
        """The elements ``[lo, hi)`` of block ``index`` this rank holds, in host order (the
        padding left out): what ``load_block_ranges`` reads."""
        numel = self.layouts[index].numel
        return [(s_lo, min(s_hi, numel)) for _, (s_lo, s_hi) in self._pieces(index) if s_lo < numel]

    def load_block_ranges(self, index: int, read, chunk: int | None = None) -> None:
        """Take this rank's share by reading only it: ``read(lo, hi)`` returns the block's
        elements [lo, hi) for each of ``share_ranges`` (a streaming load or a resume asks
        the checkpoint for just those), or for pieces of them ``chunk`` elements long: a
        source that builds what it returns (a bucket's range) then never holds a block
        of float32 at once (1.3 GB at OPT-13B's width, in fresh pages each time)."""
        numel = self.layouts[index].numel
        for (h_lo, h_hi), (s_lo, s_hi) in self._pieces(index):
            host = self.host_slices[index][h_lo:h_hi]
            stop = max(min(s_hi, numel), s_lo)
            host[stop - s_lo :].zero_()  # padding beyond the block stays 0
            step = chunk or max(stop - s_lo, 1)
            for lo in range(s_lo, stop, step):
                hi = min(lo + step, stop)
                round_nearest_(host[lo - s_lo : hi - s_lo], read(lo, hi))

    def link_bytes(self, index: int) -> int:
        """Bytes this rank copies over the host link for block ``index``, each way."""
        return self.slice_len[index] * self.host_storage.element_size()

    @property
    def host_bytes(self) -> int:
        return self.host_storage.numel() * self.host_storage.element_size()

    @property
    def device_bytes(self) -> int:
        return self.slots.nbytes + (self.unpacked.nbytes if self.unpacked is not None else 0)

    # -------------------------------------------------------------- rounding

    def _round_into(self, wire: torch.Tensor, master: torch.Tensor, index: int, lo: int) -> None:
        """Stochastic rounding of the own slice; the uniform draws are keyed by the
        element's place in the block, so any slicing rounds every element alike."""
        total = self.layouts[index].numel
        stop = min(lo + master.numel(), total)
        # a low-bit store that writes back has one (checked when it was made)
        assert self.rounding_noise is not None
        if stop > lo:
            round_keyed_(
                wire[: stop - lo],
                master[: stop - lo],
                self.rounding_noise,
                lo,
                total,
                self.step,
                self.rounding_stream + index,
            )
        if stop < lo + master.numel():  # the padding tail: zeros
            round_nearest_(wire[max(stop - lo, 0) :], master[max(stop - lo, 0) :])
