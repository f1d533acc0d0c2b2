"""The block scheduler's own queues, replayed on a model device: the stream model.

``BlockScheduler`` is run here against stand-in streams that keep CUDA's rules on the host
(each stream a FIFO queue of ops, an event a position in one queue, a wait an op that
holds its queue until everything before that position has run) and a store that only
queues its ops. The queues are then timed as a device would run them, each op taking a
given time and the three streams side by side. So the model has every wait the
scheduler queues and in its order: where a FIFO stream holds an op behind a wait it does
not need (a block's upcast behind an upload that waits for a copy), the model's period
shows it, where a formula over the phases' times would not. With one master buffer its
steady state is ``max(U, C, O, (U + C + O) / K)``; the tests hold it to that.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch

from distzo.offload.block_store import BlockStore
from distzo.offload.scheduler import BlockScheduler
from distzo.offload.streams import PHASES, Streams

# an op: (what, block, pass); an event: (stream, position)
Op = tuple[str, int, int]
Event = tuple[str, int]
OPS = ("upload", "unpack", "compute", "pack", "offload")


class ModelStreams(Streams):
    """Stand-in streams that queue instead of running: CUDA's queue and event rules kept
    on the host. ``before`` says what those rules make run first on any device, and
    ``device_times`` when each op runs on a device of given op times."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.is_async = True  # the scheduler records and waits as on CUDA
        self.queues: dict[str, list[Any]] = {phase: [] for phase in PHASES}
        self.current = "compute"

    @contextlib.contextmanager
    def on(self, phase: str) -> Iterator[None]:
        outer, self.current = self.current, phase
        try:
            yield
        finally:
            self.current = outer

    def record(self, phase: str, timing: bool = False) -> Any:
        return (phase, len(self.queues[phase]))

    def wait(self, phase: str, event: Any) -> None:
        if event is not None:
            self.queues[phase].append(("wait", event))

    def queue(self, op: Op) -> None:
        """Queue ``op`` on the stream the scheduler made current."""
        self.queues[self.current].append(op)

    def where(self, op: Op) -> Event:
        (place,) = [(p, i) for p, ops in self.queues.items() for i, o in enumerate(ops) if o == op]
        return place

    def before(self, a: Op, b: Op) -> bool:
        """Whether op ``a`` must have run before op ``b`` starts, on any device."""
        target, seen, todo = self.where(a), set(), [self.where(b)]
        while todo:  # walk back from b along its queue and across every wait
            phase, i = todo.pop()
            for j in range(i - 1, -1, -1):
                if (phase, j) == target:
                    return True
                op = self.queues[phase][j]
                if op[0] == "wait" and op[1] not in seen:
                    seen.add(op[1])
                    todo.append(op[1])
        return False

    def device_times(self, took: Mapping[str, float]) -> dict[Op, tuple[float, float]]:
        """Each op's (start, end) on a device that runs the three queues side by side, an
        op named ``name`` taking ``took[name]`` and a wait nothing but its event."""
        ends: dict[Event, float] = {}
        for phase, ops in self.queues.items():  # each queue's ends, in an order that works
            for i in range(len(ops)):
                self._end(phase, i, took, ends)
        return {
            op: (ends[phase, i] - took[op[0]], ends[phase, i])
            for phase, ops in self.queues.items()
            for i, op in enumerate(ops)
            if op[0] != "wait"
        }

    def _end(
        self, phase: str, i: int, took: Mapping[str, float], ends: dict[Event, float]
    ) -> float:
        """When the queue's i-th op is done (its start when i is -1: 0), walking back
        along queues and waits without recursion (a queue may hold thousands of ops)."""
        todo = [(phase, i)]
        while todo:
            at = todo[-1]
            if at in ends or at[1] < 0:
                todo.pop()
                continue
            op = self.queues[at[0]][at[1]]
            needed = [(at[0], at[1] - 1)] + ([(op[1][0], op[1][1] - 1)] if op[0] == "wait" else [])
            missing = [n for n in needed if n[1] >= 0 and n not in ends]
            if missing:
                todo.extend(missing)
                continue
            ready = [ends.get(n, 0.0) for n in needed]
            ends[at] = max(ready) if op[0] == "wait" else ready[0] + took[op[0]]
            todo.pop()
        return ends.get((phase, i), 0.0)


class QueuedStore:
    """A store whose ops land on the model stream they were queued on, one name per
    (op, block, pass)."""

    def __init__(self, streams: ModelStreams, num_slots: int, double_buffered: bool) -> None:
        self.streams, self.num_slots, self.double_buffered = streams, num_slots, double_buffered
        self.step = 0  # the pass under way: names its ops

    def upload(self, index: int) -> None:
        self.streams.queue(("upload", index, self.step))

    def unpack(self, index: int) -> None:
        self.streams.queue(("unpack", index, self.step))

    def pack(self, index: int) -> None:
        self.streams.queue(("pack", index, self.step))

    def offload(self, index: int) -> None:
        self.streams.queue(("offload", index, self.step))

    def device_bucket(self, index: int) -> torch.Tensor:
        return torch.empty(0)


def queued_passes(
    num_blocks: int, num_slots: int, double_buffered: bool, offloads: tuple[bool, ...] = (True,)
) -> ModelStreams:
    """The queues ``BlockScheduler`` builds over one pass per entry of ``offloads``
    (whether it offloads), the compute of block i in pass t named ("compute", i, t)."""
    streams = ModelStreams()
    store = QueuedStore(streams, num_slots, double_buffered)
    scheduler = BlockScheduler(cast(BlockStore, store), streams, num_blocks)
    for t, offload in enumerate(offloads):
        store.step = t

        def compute(i: int, bucket: torch.Tensor, t: int = t) -> None:
            streams.queue(("compute", i, t))

        scheduler.run(compute, offload=offload)
    return streams


def modelled_period(num_slots: int, double_buffered: bool, took: Mapping[str, float]) -> float:
    """The steady-state period per block of a training pass (it offloads), op times
    ``took`` (ms; ``OPS`` missing take 0): over a pass long enough to fill the pipeline,
    the time between the computes' starts of blocks ``2 x num_slots x 6`` apart (whole
    turns of the slots and of the two master buffers), per block."""
    span = 12 * num_slots
    blocks = 2 * span + 1  # the first ``span`` blocks fill the pipeline
    times = queued_passes(blocks, num_slots, double_buffered).device_times(
        {op: float(took.get(op, 0.0)) for op in OPS}
    )
    return (times["compute", blocks - 1, 0][0] - times["compute", blocks - 1 - span, 0][0]) / span
