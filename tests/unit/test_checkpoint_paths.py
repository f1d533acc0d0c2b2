"""The checkpoint's paths at scale, on CPU stand-ins: a save never holds a torn block,
DCP's writer thread runs on the rank's device, a sliced resume reads only each rank's
ranges."""

import json
import threading
import warnings

import torch
import torch.distributed.checkpoint as dcp

from distzo.job.checkpoint import Checkpointer, latest_checkpoint
from distzo.job.dcp_ranges import load_ranges
from tests.helpers.dcp_reads import counting_reads
from tests.helpers.engines import LateOffloads, engine_for, train
from tests.helpers.launch import child_env, free_port, run_python, torchrun_command
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


def test_a_sliced_resume_reads_only_each_ranks_share_of_the_blocks(tmp_path):
    # 2 sliced ranks of one node resume Adam from a checkpoint written by the saving path
    # (each block and moment stored whole by one rank): each rank reads its half of them
    # (and the resident bucket whole), not every block; the resumed run follows.
    # the ranks forked from a launcher that imported the probe (the fork server's child)
    command = torchrun_command(
        2, [str(tmp_path)], free_port(), module="tests.helpers.checkpoint_read_probe", preload=True
    )
    proc = run_python(command, child_env(), 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["same_step"] and record["same_params"], record
        # each stored item costs its archive directory and read-ahead (~8 kB) besides its data
        share = record["resident"] + record["blocks"] / 2 + 16384 * record["items"]
        assert record["read"] <= share, (rank, record)
        assert record["read"] >= record["resident"] + record["blocks"] / 2, (rank, record)


def test_ranges_of_saved_tensors_are_read_alone_and_exactly(tmp_path):
    # A sliced rank's share of a block: pieces far apart (striped), in the block's own
    # dtype. DCP's own reader reads a stored tensor whole for each range (2.5 MB here).
    weights = torch.randn(200_000, generator=torch.Generator().manual_seed(0))
    low_bit = torch.randn(30_000).to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": weights, "h": low_bit}, checkpoint_id=str(tmp_path), no_dist=True)
        ranges = {"w": [(0, 16), (100_000, 120_000), (199_990, 200_000)], "h": [(7, 4007)]}
        with counting_reads() as counter:
            got = load_ranges(tmp_path, ranges)
    for key, saved in (("w", weights), ("h", low_bit)):
        assert sorted(got[key]) == ranges[key]
        for (lo, hi), value in got[key].items():
            assert value.dtype == saved.dtype and torch.equal(value, saved[lo:hi]), (key, lo)
    data = (16 + 20_000 + 10) * 4 + 4000 * 2
    assert data <= counter[0] <= data + 2 * 16384  # not the 800 kB + 60 kB saved


def test_an_empty_range_is_left_out_of_what_is_read(tmp_path):
    """``load_ranges`` drops a range of no elements: handed to the reader, one beside a
    real range failed the whole load (``torch.frombuffer`` of no bytes)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.arange(1000.0)}, checkpoint_id=str(tmp_path), no_dist=True)
        got = load_ranges(tmp_path, {"w": [(5, 8), (10, 10)]})
    assert list(got["w"]) == [(5, 8)] and got["w"][(5, 8)].tolist() == [5.0, 6.0, 7.0]


def test_a_records_size_is_read_from_the_zip_directory_of_its_window_zip64_too():
    # DCP's files hold several torch.save archives back to back; a window over one of them
    # reads its directory alone. An archive over 4 GB (a 70B model's block) is ZIP64: forced
    # here on a small record, so the large case's layout is tested without its bytes.
    import io
    import zipfile

    from distzo.job.dcp_ranges import _stored_size, _Window

    def archive(payload: bytes, zip64: bool, compress: int = zipfile.ZIP_STORED) -> bytes:
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", compression=compress) as z:
            z.writestr("archive/byteorder", b"little")
            with z.open("archive/data/0", "w", force_zip64=zip64) as f:
                f.write(payload)
        return out.getvalue()

    first, second = archive(b"\1" * 1000, False), archive(b"\2" * 24, True)
    third = archive(b"\3" * 4096, False, zipfile.ZIP_DEFLATED)
    stream = io.BytesIO(b"head" + first + second + third)
    offsets = [4, 4 + len(first), 4 + len(first) + len(second)]
    sizes = [
        _stored_size(_Window(stream, start, len(blob)), "data/0")
        for start, blob in zip(offsets, (first, second, third))
    ]
    assert sizes == [1000, 24, None]  # a compressed record has no range in place
    assert _stored_size(_Window(stream, offsets[0], len(first)), "data/1") is None


def test_a_completed_save_deletes_the_saves_a_dead_process_left(tmp_path):
    """Once a save killed mid-way (its process dead) left step-N.tmp for good when the
    resumed run saved at other steps: a checkpoint's size of disk each."""
    engine = engine_for(tiny_opt(seed=1), num_slots=2)
    train(engine, vocab=64, steps=1)
    (tmp_path / "step-3.tmp" / "dcp").mkdir(parents=True)
    (tmp_path / "step-3.tmp" / "dcp" / "__0_0.distcp").write_bytes(b"half")
    Checkpointer(tmp_path, engine).save()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]
