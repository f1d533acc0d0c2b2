"""The seed log syncs to disk off the training's path: a slow fsync (a network
filesystem) never holds a step, a failed one is raised by the next write, and closing the
log syncs everything."""

from __future__ import annotations

import errno
import json
import threading

import pytest

from distzo.job import seed_log
from distzo.job.seed_log import SeedLogWriter


class SlowDisk:
    """os.fsync that blocks until released, counting the syncs."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.calls = 0

    def fsync(self, fd: int) -> None:
        self.started.set()
        self.release.wait(timeout=30)
        self.calls += 1


def test_a_slow_fsync_never_holds_a_write(tmp_path, monkeypatch):
    disk = SlowDisk()
    monkeypatch.setattr(seed_log.os, "fsync", disk.fsync)
    writer = SeedLogWriter(tmp_path / "seedlog.jsonl", sync_every=1)
    writer.write({"kind": "header"})
    assert disk.started.wait(timeout=10)  # the syncer is inside fsync, blocked ...
    for step in range(5):  # ... and the steps' records are written all the same
        writer.write({"step": step, "projected_grads": [0.0], "lr": 1e-3})
    lines = (tmp_path / "seedlog.jsonl").read_text().splitlines()
    assert [json.loads(line).get("step") for line in lines] == [None, 0, 1, 2, 3, 4]
    assert disk.calls == 0
    disk.release.set()
    writer.close()  # the syncer stops, then everything is synced once more
    assert disk.calls >= 2


def test_a_failed_sync_is_raised_by_the_next_write(tmp_path, monkeypatch):
    synced = threading.Event()

    def full_disk(fd: int) -> None:
        synced.set()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(seed_log.os, "fsync", full_disk)
    writer = SeedLogWriter(tmp_path / "seedlog.jsonl", sync_every=1)
    writer.write({"kind": "header"})
    assert synced.wait(timeout=10)
    writer._syncer.join(timeout=0.5)  # give the syncer time to record its failure
    with pytest.raises(OSError, match="No space left"):
        writer.write({"step": 0, "projected_grads": [0.0], "lr": 1e-3})


def test_close_raises_a_failed_sync_with_the_file_closed(tmp_path, monkeypatch):
    # The failure was raised before the file was closed, and the run's logs close once.
    failed = threading.Event()

    def failing_syncer(fd: int) -> None:
        if threading.current_thread().name == "seedlog-fsync":
            failed.set()
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(seed_log.os, "fsync", failing_syncer)
    writer = SeedLogWriter(tmp_path / "seedlog.jsonl", sync_every=1)
    writer.write({"kind": "header"})
    assert failed.wait(timeout=10)
    writer._syncer.join(timeout=0.5)  # give the syncer time to record its failure
    with pytest.raises(OSError, match="Input/output error"):
        writer.close()
    assert writer._file.closed
