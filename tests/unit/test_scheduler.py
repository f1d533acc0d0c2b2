import contextlib

import pytest
import torch

from distzo.offload import BlockScheduler, Streams, Timeline


class RecordingStore:
    def __init__(self, num_slots, double_buffered=False):
        self.num_slots = num_slots
        self.double_buffered = double_buffered
        self.log = []

    def upload(self, i):
        self.log.append(("up", i))

    def unpack(self, i):
        self.log.append(("unpack", i))

    def pack(self, i):
        self.log.append(("pack", i))

    def offload(self, i):
        self.log.append(("off", i))

    def device_bucket(self, i):
        return torch.empty(0)

    def master(self, i):
        return torch.empty(0)


@pytest.mark.parametrize("slots", [1, 2, 3, 8])
def test_schedule_obeys_the_slot_rules(slots):
    store, n = RecordingStore(slots), 6
    scheduler = BlockScheduler(store, Streams(torch.device("cpu")), n)
    for _ in range(2):  # two steps: the rules hold across the step boundary too
        scheduler.run(lambda i, bucket: store.log.append(("compute", i)))
    log = store.log
    pos = {event: idx for idx, event in enumerate(log[: 5 * n])}
    for i in range(n):
        assert pos[("up", i)] < pos[("compute", i)] < pos[("off", i)]
        # the master exists from unpack to pack, around the compute alone: the one master
        # buffer of a low-bit store is free again before the next block unpacks
        assert pos[("unpack", i)] == pos[("compute", i)] - 1
        assert pos[("pack", i)] == pos[("compute", i)] + 1
        if i >= slots:
            assert pos[("off", i - slots)] < pos[("up", i)]  # slot i % K was free
        if i + 1 < n and slots > 1:
            # look-ahead: i+1 is queued before i computes
            assert pos[("up", i + 1)] < pos[("compute", i)]
    assert log[5 * n :] == log[: 5 * n]


def test_timeline_records_every_phase_of_every_block():
    store = RecordingStore(2)
    scheduler = BlockScheduler(store, Streams(torch.device("cpu")), 3)
    scheduler.timeline = Timeline(scheduler.streams)
    scheduler.run(lambda i, bucket: None)
    spans = scheduler.timeline.spans()
    assert sorted((s.phase, s.block) for s in spans) == sorted(
        (p, b) for p in ("upload", "compute", "offload") for b in range(3)
    )
    assert min(s.start_ms for s in spans) == 0.0
    assert all(s.ms >= 0 for s in spans)
    # on CPU the phase runs in the call: the host's time in it is the span
    assert all(s.host_ms == pytest.approx(s.ms, abs=1e-5) for s in spans)


class StandInStreams(Streams):
    """CUDA's stream rules kept on the host: each phase a FIFO queue of the ops queued on it,
    an event a position in one queue, a wait an op that holds its queue until everything
    before the event's position has run. The work itself runs at once; ``before`` says
    what the queues and waits guarantee to run first on a device."""

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.is_async = True
        self.queues = {phase: [] for phase in ("upload", "compute", "offload")}
        self.current = "compute"

    @contextlib.contextmanager
    def on(self, phase):
        outer, self.current = self.current, phase
        try:
            yield
        finally:
            self.current = outer

    def record(self, phase, timing=False):
        return (phase, len(self.queues[phase]))

    def wait(self, phase, event):
        if event is not None:
            self.queues[phase].append(("wait", event))

    def queue(self, op):
        self.queues[self.current].append(op)

    def where(self, op):
        (place,) = [(p, i) for p, ops in self.queues.items() for i, o in enumerate(ops) if o == op]
        return place

    def before(self, a, b):
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
                    src, n = op[1]
                    todo.append((src, n))
        return False


class QueuedStore(RecordingStore):
    """A store whose ops land on the stand-in stream they were queued on, one name per
    (op, block, step)."""

    def __init__(self, streams, num_slots, double_buffered):
        super().__init__(num_slots, double_buffered)
        self.streams, self.step = streams, 0
        for op in ("upload", "unpack", "pack", "offload"):
            setattr(self, op, lambda i, op=op: streams.queue((op, i, self.step)))


@pytest.mark.parametrize("slots", [1, 2, 3])
@pytest.mark.parametrize("apart", [False, True])
def test_each_master_buffer_is_released_before_the_block_after_next_unpacks_into_it(slots, apart):
    """A low-bit store's master buffers, on CUDA's rules, over a training pass, a pass
    that only reads (an evaluation: no pack, no offload) and another training pass. With
    one buffer, unpack(i) and pack(i) surround compute(i) on the compute stream. With two
    (``double_buffered``), unpack(i) runs on the upload stream after upload(i) and pack(i)
    on the offload stream after compute(i) and before the copy; unpack(i + 2) waits for
    the buffer's release (pack(i), or compute(i) in the evaluation), across the passes'
    ends too (where an odd count of blocks gives block 0 the last block's buffer), while
    neither the upcast of block i + 1 nor the rounding of block i holds up the compute."""
    streams, n = StandInStreams(), 5
    store = QueuedStore(streams, slots, apart)
    scheduler = BlockScheduler(store, streams, n)

    def compute(i, bucket):
        streams.queue(("compute", i, store.step))

    passes = [True, False, True]  # whether each pass offloads
    for step, offload in enumerate(passes):
        store.step = step
        scheduler.run(compute, offload=offload)
    order = [(i, t) for t in range(len(passes)) for i in range(n)]  # the visits in turn
    buffers = 2 if apart else 1  # block i computes in buffer i % buffers
    for k, (i, step) in enumerate(order):
        unpack, compute_i = ("unpack", i, step), ("compute", i, step)
        assert streams.where(unpack)[0] == ("upload" if apart else "compute")
        assert streams.before(("upload", i, step), unpack)
        assert streams.before(unpack, compute_i)
        released = compute_i
        if passes[step]:
            pack = ("pack", i, step)
            assert streams.where(pack)[0] == ("offload" if apart else "compute")
            assert streams.before(compute_i, pack)
            assert streams.before(pack, ("offload", i, step))
            released = pack
        after = [(j, t) for j, t in order[k + 1 :] if j % buffers == i % buffers]
        if after:  # the next visit to the same master buffer
            assert streams.before(released, ("unpack", *after[0]))
        if apart and slots > 1 and k + 1 < len(order) and order[k + 1][0] % 2 != i % 2:
            # the next upcast and the rounding overlap the compute, in the other buffer
            # (one slot overlaps nothing: block i + 1's upload waits for block i's offload)
            assert not streams.before(compute_i, ("unpack", *order[k + 1]))
            if passes[step]:
                assert not streams.before(released, ("compute", *order[k + 1]))
        if k >= slots and passes[step]:  # the slot holds block i once block k - K left it
            j, earlier = order[k - slots]
            left = ("offload" if passes[earlier] else "compute", j, earlier)
            assert streams.before(left, ("upload", i, step))


def device_times(streams, took):
    """Each op's (start, end) on a device that runs the three queues side by side, an op
    taking ``took[name]`` and a wait nothing but its event: CUDA's rules, the H100's
    clock."""
    ends = {}

    def end(phase, i):  # when the queue's i-th op is done (-1: the queue's start)
        if i < 0:
            return 0.0
        if (phase, i) not in ends:
            op, ready = streams.queues[phase][i], end(phase, i - 1)
            if op[0] == "wait":
                src, n = op[1]
                ends[phase, i] = max(ready, end(src, n - 1))
            else:
                ends[phase, i] = ready + took[op[0]]
        return ends[phase, i]

    return {
        op: (end(phase, i) - took[op[0]], end(phase, i))
        for phase, ops in streams.queues.items()
        for i, op in enumerate(ops)
        if op[0] != "wait"
    }


@pytest.mark.parametrize("apart", [False, True])
def test_with_three_slots_the_compute_stream_never_waits_inside_a_pass(apart):
    """Where the compute takes longer than a block's upload or offload (Qwen3-1.7B at
    1 x 2048 on the H100: per block, ms), the compute stream runs each pass back to back
    from its first block. With two master buffers a FIFO upload stream once held block
    i + 2's upcast behind the upload that waits for block i's copy (4.0 ms a block where
    the compute took 3.12), and block 0's behind the uploads of blocks 1 and 2."""
    took = {"upload": 2.26, "unpack": 0.22, "compute": 3.12, "pack": 0.31, "offload": 2.13}
    streams, n, slots = StandInStreams(), 8, 3
    store = QueuedStore(streams, slots, apart)
    scheduler = BlockScheduler(store, streams, n)
    for step in range(2):
        store.step = step
        scheduler.run(lambda i, bucket: streams.queue(("compute", i, store.step)))
    times = device_times(streams, took)
    on_compute = [op for op in streams.queues["compute"] if op[0] != "wait"]
    for step in range(2):
        ops = [op for op in on_compute if op[2] == step]
        for a, b in zip(ops, ops[1:]):
            assert times[b][0] == pytest.approx(times[a][1]), (a, b)
    # the first pass starts as soon as block 0 is on the device and upcast (on either
    # stream), not after the uploads of blocks 1 and 2
    first = took["upload"] + took["unpack"]
    assert times[("compute", 0, 0)][0] == pytest.approx(first)
    # the period is the compute stream's work per block: with two buffers, the passes alone
    per_block = took["compute"] + (0 if apart else took["unpack"] + took["pack"])
    start = [times[("compute", i, 0)][0] for i in range(n)]
    assert (start[-1] - start[0]) / (n - 1) == pytest.approx(per_block)
