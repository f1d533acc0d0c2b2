"""The checkpoint's paths at scale, on CPU stand-ins: a save never holds a torn block,
DCP's writer thread runs on the rank's device, a sliced resume reads only each rank's
ranges."""

import threading
import warnings

import torch
import torch.distributed.checkpoint as dcp

from distzo.job.checkpoint import Checkpointer, latest_checkpoint
from tests.helpers.engines import LateOffloads, engine_for, train
from tests.helpers.models import tiny_opt


def saved_blocks(path, engine, prefix="block"):
    blocks = {
        f"{prefix}/{i}": torch.empty(layout.numel, dtype=engine.store.rest_dtype)
        for i, layout in enumerate(engine.block_layouts)
    }
    with warnings.catch_warnings():  # DCP's note that it loads in one process: meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(blocks, checkpoint_id=str(path), no_dist=True)
    return blocks


def test_an_asynchronous_save_copies_each_block_after_its_offload_has_landed(tmp_path, monkeypatch):
    # Naive offload: a block's private copy is a host memcpy of its host memory, which the
    # last step's last offloads may still be writing (here: until the host waits for them).
    engine = engine_for(tiny_opt(seed=1, num_hidden_layers=4), num_slots=2)
    late = LateOffloads(engine, monkeypatch)
    train(engine, vocab=64, steps=2)
    assert len(late.pending) >= 2  # the step returned with offloads still in flight
    checkpointer = Checkpointer(tmp_path, engine)
    checkpointer.save(asynchronous=True)
    checkpointer.wait()
    late.land()
    saved = saved_blocks(latest_checkpoint(tmp_path), engine)
    for i in range(len(engine.block_layouts)):
        assert torch.equal(saved[f"block/{i}"], engine.store.block_at_rest(i)), i


def test_the_writer_thread_is_put_on_the_ranks_device_before_dcp_touches_cuda(
    tmp_path, monkeypatch
):
    # As on a node of GPUs: CUDA is available and this rank's device is cuda:1. DCP writes
    # from a thread of its own, whose device is 0 until it is set: any CUDA call there
    # before ``set_device(cuda:1)`` opens a context on GPU 0.
    engine = engine_for(tiny_opt(seed=1), num_slots=2)
    train(engine, vocab=64, steps=1)
    monkeypatch.setattr(engine, "device", torch.device("cuda", 1))
    checkpointer = Checkpointer(tmp_path, engine)
    calls, device = [], threading.local()

    def set_device(d):
        calls.append((threading.current_thread().name, "set_device", torch.device(d)))
        device.index = torch.device(d).index

    def touched(name):
        def call(*args, **kwargs):
            where = (threading.current_thread().name, name, getattr(device, "index", 0))
            calls.append(where)
            raise RuntimeError(f"CUDA touched: {where}")

        return call

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    for name in ("current_stream", "current_device", "synchronize", "Stream", "stream"):
        monkeypatch.setattr(torch.cuda, name, touched(name))
    checkpointer.save(asynchronous=True)
    checkpointer.wait()
    writer = [c for c in calls if c[0] != threading.main_thread().name]
    assert writer and writer[0] == (writer[0][0], "set_device", torch.device("cuda", 1))
    assert all(c[1] == "set_device" for c in calls), calls
    monkeypatch.undo()
    assert torch.equal(
        saved_blocks(latest_checkpoint(tmp_path), engine)["block/0"], engine.store.block_at_rest(0)
    )
