"""K reusable device buffers for streamed blocks: block i always lands in slot i % K."""

from __future__ import annotations

import torch


class DeviceSlots:
    """Allocated once, sized for the largest block, so the step loop allocates nothing."""

    def __init__(
        self, num_slots: int, numel: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        if num_slots < 1:
            raise ValueError(
                f"num_slots must be >= 1 (1 = no overlap, least memory), got {num_slots}"
            )
        self.buffers = [torch.empty(numel, device=device, dtype=dtype) for _ in range(num_slots)]

    def __len__(self) -> int:
        return len(self.buffers)

    def for_block(self, index: int, numel: int) -> torch.Tensor:
        return self.buffers[index % len(self.buffers)][:numel]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)
