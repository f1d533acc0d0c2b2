"""Devices: the one way host tensors reach a device, and a device's name for reports."""

from __future__ import annotations

import platform

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor queued for ``device`` without making the host wait: staged through
    pinned memory on CUDA (from pageable memory the driver may block the host until the
    stream reaches the copy)."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
