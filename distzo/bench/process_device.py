"""This process's memory on the GPUs, as ``nvidia-smi`` lists it per process.

ZO2's README gives the device memory of one ZO2 process (``nvidia-smi``: the CUDA context
and everything the caching allocator holds, not only live tensors). Read through NVML per
process, the figure stays the process's own while other peers share the device, so an
interleaved run compares with the README without running the peers one at a time.

This file imports nothing of distzo (only ``os``, and ``pynvml`` when asked): the ZO2
peer, whose interpreter cannot import distzo, loads it by its path.
"""

from __future__ import annotations

import importlib
import os
from typing import Any


def process_device_bytes(nvml: Any = None) -> int | None:
    """The device memory NVML lists for this process, summed over the GPUs; None where
    NVML (``pynvml``, the nvidia-ml-py package) is missing or fails, or does not list the
    process (a PID namespace it cannot see into). ``nvml`` stands in for ``pynvml``."""
    if nvml is None:
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError:
            return None
    try:
        nvml.nvmlInit()
        try:
            pid, total, seen = os.getpid(), 0, False
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                for process in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if process.pid == pid and process.usedGpuMemory is not None:
                        total, seen = total + int(process.usedGpuMemory), True
            return total if seen else None
        finally:
            nvml.nvmlShutdown()
    except Exception:  # NVMLError and its kin: no figure rather than a failed benchmark
        return None
