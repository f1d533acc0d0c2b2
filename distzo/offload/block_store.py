"""Where the master copies of the streamed blocks live, and how they reach the device.

The engine sees one interface: ``upload(i)`` makes block i's master available on the
device, ``device_bucket(i)`` is that device buffer (updated in place by the fused
update), ``offload(i)`` writes it back. Resident mode (MeZO) keeps every master on the
device and its copies are no-ops, so both modes share every op but the copies.
"""

from __future__ import annotations

from typing import Protocol

import torch

from distzo.offload.bucket import BucketLayout
from distzo.offload.device_slots import DeviceSlots
from distzo.offload.host_buckets import HostBuckets


class BlockStore(Protocol):
    num_slots: int

    def upload(self, index: int) -> None: ...

    def offload(self, index: int) -> None: ...

    def device_bucket(self, index: int) -> torch.Tensor: ...

    def master(self, index: int) -> torch.Tensor: ...


class ResidentBlocks:
    """Every block's master stays on the device (MeZO); nothing moves."""

    def __init__(self, layouts: list[BucketLayout], device: torch.device) -> None:
        self.masters = [torch.empty(layout.numel, device=device, dtype=layout.dtype) for layout in layouts]
        # No slot reuse: every block has its own buffer, so any look-ahead is safe.
        self.num_slots = len(layouts)

    def upload(self, index: int) -> None:
        pass

    def offload(self, index: int) -> None:
        pass

    def device_bucket(self, index: int) -> torch.Tensor:
        return self.masters[index]

    def master(self, index: int) -> torch.Tensor:
        return self.masters[index]

    @property
    def device_bytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self.masters)


class OffloadedBlocks:
    """Masters in host memory (ZO2); K device slots; whole-block copies each way."""

    def __init__(self, layouts: list[BucketLayout], device: torch.device, num_slots: int) -> None:
        device = torch.device(device)
        self.host = HostBuckets(layouts, pin=device.type == "cuda")
        self.slots = DeviceSlots(num_slots, max(layout.numel for layout in layouts), device, layouts[0].dtype)
        self.num_slots = num_slots
        self._non_blocking = device.type == "cuda"

    def upload(self, index: int) -> None:
        host = self.host.buckets[index]
        self.slots.for_block(index, host.numel()).copy_(host, non_blocking=self._non_blocking)

    def offload(self, index: int) -> None:
        host = self.host.buckets[index]
        host.copy_(self.slots.for_block(index, host.numel()), non_blocking=self._non_blocking)

    def device_bucket(self, index: int) -> torch.Tensor:
        return self.slots.for_block(index, self.host.buckets[index].numel())

    def master(self, index: int) -> torch.Tensor:
        return self.host.buckets[index]

    @property
    def device_bytes(self) -> int:
        return self.slots.nbytes
