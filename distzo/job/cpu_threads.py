"""torch's CPU thread count for a run on the CPU (``--threads``), and the caller's count given
back when the run closes: ``torch.set_num_threads`` is process-wide, and a script that trains
then goes on (evaluates, trains again) would keep the run's count otherwise."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("distzo.train")


class CpuThreads:
    def __init__(self) -> None:
        self._caller: int | None = None  # the count before the run set its own

    def use(self, count: int, why: str) -> None:
        """Run with ``count`` threads (``why``: where the count came from, logged)."""
        if self._caller is None:
            self._caller = torch.get_num_threads()
        torch.set_num_threads(count)
        logger.info("CPU threads per rank: %d (%s)", count, why)

    def give_back(self) -> None:
        """The caller's count again (nothing if ``use`` was never called)."""
        if self._caller is not None:
            torch.set_num_threads(self._caller)
            self._caller = None
