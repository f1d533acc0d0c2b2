"""``RunLock.acquire(wait_s)``: export-best takes its run directory again as the run ends,
where another job's start-up check may hold the lock an instant; it asks again for
``wait_s`` before refusing, and refuses a lock still held after that."""

import threading

import pytest

from distzo.job.run_lock import DirectoryLocked, RunLock


def test_a_lock_let_go_within_the_wait_is_taken_and_one_held_is_refused(tmp_path):
    holder = RunLock(tmp_path / "run")
    holder.acquire()
    with pytest.raises(DirectoryLocked):
        RunLock(tmp_path / "run").acquire(wait_s=0.1)  # still held after the wait
    letting_go = threading.Timer(0.1, holder.release)
    letting_go.start()
    waiting = RunLock(tmp_path / "run")
    waiting.acquire(wait_s=10.0)
    letting_go.join()
    assert waiting.held
    waiting.release()
