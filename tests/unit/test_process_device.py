"""``process_device_bytes`` with NVML stood in: this process's figure from every GPU,
nothing where NVML is missing, fails or cannot see the process."""

from __future__ import annotations

import os
from types import SimpleNamespace

from distzo.bench.process_device import process_device_bytes


class FakeNVML:
    """The pynvml calls the function makes: per device, the compute processes listed."""

    def __init__(self, devices: list[list[tuple[int, int | None]]], fail: bool = False) -> None:
        self.devices, self.fail = devices, fail
        self.calls: list[str] = []

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.fail:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in self.devices[handle]]


def test_this_processs_memory_summed_over_the_gpus_that_list_it():
    me, other = os.getpid(), os.getpid() + 1
    nvml = FakeNVML([[(other, 7 << 30), (me, 3 << 30)], [], [(me, 1 << 20)]])
    assert process_device_bytes(nvml) == (3 << 30) + (1 << 20)
    assert nvml.calls == ["init", "shutdown"]


def test_no_figure_where_nvml_cannot_give_one():
    me = os.getpid()
    assert process_device_bytes(FakeNVML([[(me + 1, 1 << 30)]])) is None  # not listed
    assert process_device_bytes(FakeNVML([[(me, None)]])) is None  # usage not available
    assert process_device_bytes(FakeNVML([[(me, 1 << 30)]], fail=True)) is None
