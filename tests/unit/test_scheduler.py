import pytest
import torch

from distzo.offload import BlockScheduler, Streams, Timeline


class RecordingStore:
    def __init__(self, num_slots):
        self.num_slots = num_slots
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
