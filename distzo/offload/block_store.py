"""Where the master copies of the streamed blocks live, and how they reach the device.

The engine sees one interface: ``upload(i)`` brings block i to the device, ``unpack(i)``
makes its master available there as ``device_bucket(i)`` (updated in place by the fused
update), ``pack(i)`` turns the updated master back into what is stored, ``offload(i)``
writes that back. ``unpack`` and ``pack`` run on the compute stream, around the block's
compute (a low-bit store rebuilds its masters in one buffer there), unless the store
``double_buffered``: then ``unpack`` runs on the upload stream after the upload and
``pack`` on the offload stream before the copy, in two buffers that the compute stream
takes in turn. Resident mode (MeZO)
keeps every master on the device and its copies are no-ops, so both modes share every op
but the copies.
``StreamedBlocks`` (streamed_blocks.py) is the host-memory implementation.
"""

from __future__ import annotations

from typing import Protocol

import torch

from distzo.offload.bucket import BucketLayout


class BlockStore(Protocol):
    num_slots: int
    step: int  # the step of the pass under way (keys any rounding noise)
    # unpack on the upload stream and pack on the offload stream, in two buffers in turn
    double_buffered: bool

    def upload(self, index: int) -> None: ...

    def unpack(self, index: int) -> None: ...

    def pack(self, index: int) -> None: ...

    def offload(self, index: int) -> None: ...

    def device_bucket(self, index: int) -> torch.Tensor: ...

    def link_bytes(self, index: int) -> int:
        """Bytes of block ``index`` this rank moves over the host link each way per step."""
        ...

    def load_block(self, index: int, values: torch.Tensor) -> None: ...

    def block_at_rest(self, index: int) -> torch.Tensor:
        """The whole block exactly as stored (its at-rest dtype): what a checkpoint holds.
        Collective where the block is split over ranks; may be a view of live memory."""
        ...

    @property
    def rest_dtype(self) -> torch.dtype: ...

    @property
    def host_bytes(self) -> int: ...

    @property
    def device_bytes(self) -> int: ...


class ResidentBlocks:
    """Every block's master stays on the device (MeZO); nothing moves."""

    def __init__(self, layouts: list[BucketLayout], device: torch.device) -> None:
        self.masters = [
            torch.zeros(layout.numel, device=device, dtype=layout.dtype) for layout in layouts
        ]
        # No slot reuse: every block has its own buffer, so any look-ahead is safe.
        self.num_slots = len(layouts)
        self.step = 0
        self.double_buffered = False  # nothing to pack

    def upload(self, index: int) -> None:
        pass

    def unpack(self, index: int) -> None:
        pass

    def pack(self, index: int) -> None:
        pass

    def offload(self, index: int) -> None:
        pass

    def device_bucket(self, index: int) -> torch.Tensor:
        return self.masters[index]

    def link_bytes(self, index: int) -> int:
        return 0  # nothing moves

    def load_block(self, index: int, values: torch.Tensor) -> None:
        self.masters[index].copy_(values)

    def block_at_rest(self, index: int) -> torch.Tensor:
        return self.masters[index]

    @property
    def rest_dtype(self) -> torch.dtype:
        return self.masters[0].dtype

    @property
    def host_bytes(self) -> int:
        return 0

    @property
    def device_bytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self.masters)
