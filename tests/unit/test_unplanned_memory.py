"""Memory the plan did not count (issue 29, item 5): the resident bucket built whole on
the host by every rank, ``.bin`` shards kept mapped, the attention masks kept per
micro-batch and group size, and NCCL's buffers. Each is either no longer done or
planned, and a refusal names the term that does not fit."""

import torch

from distzo import ZOConfig, ZOEngine
from distzo.engine import layouts
from distzo.models.shapes import shape_config
from distzo.models.weights import RandomWeights, skeleton


def test_the_resident_bucket_reaches_the_device_a_chunk_at_a_time(monkeypatch):
    monkeypatch.setattr(layouts, "LOAD_CHUNK", 1 << 20, raising=False)
    reads = []
    whole = layouts.bucket_range

    def spied(layout, weights, lo, hi):
        reads.append((layout, hi - lo))
        return whole(layout, weights, lo, hi)

    monkeypatch.setattr(layouts, "bucket_range", spied)
    model = skeleton(shape_config("opt-125m", layers=1), torch.float32)
    engine = ZOEngine(model, ZOConfig(device="cpu", seed=0), weights=RandomWeights(3))
    resident = engine.resident_layout
    sizes = [n for layout, n in reads if layout is resident]
    assert resident.numel > 30 << 20 and max(sizes) == 1 << 20
    assert sum(sizes) == resident.numel
    # the same values as one read of the whole bucket
    assert torch.equal(engine.resident_master, whole(resident, RandomWeights(3), 0, resident.numel))
