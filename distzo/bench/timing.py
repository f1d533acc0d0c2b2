"""Timing device work honestly: synchronise around each repeat, keep every sample."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timer:
    samples: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the repeats were."""
        return (max(self.samples) - min(self.samples)) / self.median if self.median else 0.0


def time_repeated(
    fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1
) -> Timer:
    """Wall time of ``fn`` per call, device-synchronised, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return Timer(samples)
