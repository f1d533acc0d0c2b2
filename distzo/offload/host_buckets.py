"""Master copies of the streamed blocks in host memory: one allocation, one view per block."""

from __future__ import annotations

import torch

from distzo.offload.bucket import BucketLayout


class HostBuckets:
    """All blocks' flat buckets carved out of one (pinned, on CUDA) host allocation.

    One allocation made at start-up keeps pinning cost and fragmentation out of the
    step loop; pinned memory is what lets the uploads and offloads run asynchronously.
    """

    def __init__(self, layouts: list[BucketLayout], pin: bool) -> None:
        dtype = layouts[0].dtype
        total = sum(layout.numel for layout in layouts)
        self.storage = torch.empty(total, dtype=dtype, pin_memory=pin)
        self.pinned = pin
        self.buckets: list[torch.Tensor] = []
        offset = 0
        for layout in layouts:
            self.buckets.append(self.storage[offset : offset + layout.numel])
            offset += layout.numel

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()
