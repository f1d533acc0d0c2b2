import pytest
import torch

from distzo.offload import BlockScheduler, Streams, Timeline
from distzo.offload.queue_model import ModelStreams, modelled_period, queued_passes


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


def test_a_timeline_with_nothing_recorded_has_no_spans():
    assert Timeline(Streams(torch.device("cpu"))).spans() == []


class DeviceMark:
    """A CUDA timing event's stand-in: the device time (ms) at which its stream reached it."""

    def __init__(self, at: float) -> None:
        self.at = at

    def elapsed_time(self, end: "DeviceMark") -> float:
        return end.at - self.at


def test_device_spans_start_at_the_earliest_one_whichever_the_host_queued_first(monkeypatch):
    # On CUDA the host queues an offload first that its stream runs after a compute queued
    # later on another stream: the origin is the earliest start, not the first mark's.
    streams = Streams(torch.device("cpu"))
    streams.is_async = True
    times = iter([5.0, 7.0, 1.0, 4.0])  # offload 5..7 queued first, compute 1..4 after it
    monkeypatch.setattr(streams, "record", lambda phase, timing=False: DeviceMark(next(times)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    timeline = Timeline(streams)
    for phase in ("offload", "compute"):
        timeline.end(phase, 0, timeline.start(phase))
    spans = {s.phase: (s.start_ms, s.end_ms) for s in timeline.spans()}
    assert spans == {"offload": (4.0, 6.0), "compute": (0.0, 3.0)}


class SpyStream:
    def __init__(self) -> None:
        self.waited: list = []

    def wait_event(self, event) -> None:
        self.waited.append(event)


def test_a_stream_waits_for_no_event_where_none_was_recorded_yet():
    # the scheduler's first waits (a slot never used, a master buffer never released)
    # are for None: on CUDA the stream must not be handed it
    streams = Streams(torch.device("cpu"))
    streams.is_async, spy = True, SpyStream()
    streams._streams = {"upload": spy}
    streams.wait("upload", None)
    streams.wait("upload", mark := DeviceMark(1.0))
    assert spy.waited == [mark]


def test_the_stream_models_current_stream_comes_back_after_a_nested_one():
    # as torch.cuda.stream restores the stream it replaced
    streams = ModelStreams()
    with streams.on("upload"):
        with streams.on("offload"):
            streams.queue(("offload", 0, 0))
        streams.queue(("upload", 1, 0))
    streams.queue(("compute", 0, 0))
    assert streams.queues == {
        "upload": [("upload", 1, 0)],
        "compute": [("compute", 0, 0)],
        "offload": [("offload", 0, 0)],
    }


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
    n, passes = 5, (True, False, True)  # whether each pass offloads
    streams = queued_passes(n, slots, apart, passes)
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


@pytest.mark.parametrize("apart", [False, True])
def test_with_three_slots_the_compute_stream_never_waits_inside_a_pass(apart):
    """Where the compute takes longer than a block's upload or offload (Qwen3-1.7B at
    1 x 2048 on the H100: per block, ms), the compute stream runs each pass back to back
    from its first block. With two master buffers a FIFO upload stream once held block
    i + 2's upcast behind the upload that waits for block i's copy (4.0 ms a block where
    the compute took 3.12), and block 0's behind the uploads of blocks 1 and 2."""
    took = {"upload": 2.26, "unpack": 0.22, "compute": 3.12, "pack": 0.31, "offload": 2.13}
    n, slots = 8, 3
    streams = queued_passes(n, slots, apart, (True, True))
    times = streams.device_times(took)
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
    assert modelled_period(slots, apart, took) == pytest.approx(per_block)


@pytest.mark.parametrize("slots", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "upload, compute, offload",
    [(5, 2, 1), (1, 2, 5), (1, 5, 1), (4, 4, 4), (3, 1, 3), (2.26, 3.12, 2.13)],
)
def test_the_modelled_period_of_one_buffer_is_the_stream_models_formula(
    slots, upload, compute, offload
):
    """The scheduler's queues replayed with one master buffer: upload(i) waits offload(i -
    K) and each stream is FIFO, so the period is the longest phase or the three in sequence
    over the K slots (docs/ARCHITECTURE.md)."""
    took = {"upload": upload, "compute": compute, "offload": offload}
    expected = max(upload, compute, offload, (upload + compute + offload) / slots)
    assert modelled_period(slots, False, took) == pytest.approx(expected, rel=1e-9)


def test_the_modelled_period_of_two_buffers_names_what_the_old_queue_order_cost():
    """Two master buffers at the H100's op times (Qwen3-1.7B): 3.12 ms a block, the
    compute alone; an upcast on the upload stream that takes longer than the compute
    leaves slack, and its time shows in the period once the upload stream is the longest."""
    took = {"upload": 2.26, "unpack": 0.22, "compute": 3.12, "pack": 0.31, "offload": 2.13}
    assert modelled_period(3, True, took) == pytest.approx(3.12)
    assert modelled_period(3, False, took) == pytest.approx(3.12 + 0.22 + 0.31)
    # the upload stream's work per block (upload + upcast) sets the period when longest
    slow = took | {"upload": 3.0, "unpack": 0.5}
    assert modelled_period(3, True, slow) == pytest.approx(3.5)
    # one slot: nothing overlaps (block i + 1's upload waits for block i's offload)
    assert modelled_period(1, True, took) == pytest.approx(sum(took.values()))


def test_a_replay_of_thousands_of_queued_ops_needs_no_recursion():
    """OPT-175B streams 96 blocks a pass: the model walks its queues without recursing."""
    streams = queued_passes(2000, 3, True, (True, True))
    times = streams.device_times({"upload": 1, "unpack": 0, "compute": 1, "pack": 0, "offload": 1})
    # the link bounds both passes: 2000 uploads, then the second pass's 2000
    assert times[("compute", 1999, 0)][1] == pytest.approx(2001)
    assert times[("compute", 1999, 1)][1] > times[("upload", 1999, 0)][1] + 1999
