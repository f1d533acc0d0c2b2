"""The launch gate: a rank that refuses its input before the process group forms ends
every other rank's wait at once, on every node, through the launcher's store."""

import threading
import time

import pytest
import torch.distributed as dist

from distzo.dist import LaunchEnv, launch_gate
from distzo.dist.launch_gate import await_every_rank, refusal_line, report_refusal


def place(rank: int, node: int = 0) -> LaunchEnv:
    return LaunchEnv(rank=rank, world_size=2, local_rank=0, node_rank=node, launched=True)


def test_a_waiting_rank_raises_another_nodes_refusal_at_once(monkeypatch):
    store = dist.HashStore()
    monkeypatch.setattr(launch_gate, "rendezvous_store", lambda env, timeout: store)
    failed: list[BaseException] = []

    def wait() -> None:
        try:
            await_every_rank(store, place(0), timeout_s=300)
        except BaseException as err:  # noqa: BLE001 - the test reads it
            failed.append(err)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.3)  # rank 0 passed its checks and waits
    started = time.monotonic()
    report_refusal(place(1, node=1), ValueError("data file /x/train.tsv does not exist"))
    waiter.join(5)
    assert not waiter.is_alive() and time.monotonic() - started < 2
    assert isinstance(failed[0], ValueError)
    assert str(failed[0]) == (
        "rank 1 on node 1 refused its input: data file /x/train.tsv does not exist; "
        "fix it on that node and launch again"
    )


def test_the_first_refusal_is_the_one_every_rank_raises(monkeypatch):
    # ranks refusing one after another: the first line stands, not the last written
    store = dist.HashStore()
    monkeypatch.setattr(launch_gate, "rendezvous_store", lambda env, timeout: store)
    report_refusal(place(1, node=1), ValueError("data file /x/train.tsv does not exist"))
    report_refusal(place(1, node=2), ValueError("--model /m: no such directory"))
    with pytest.raises(ValueError, match="^rank 1 on node 1 refused its input: data file"):
        await_every_rank(store, place(0), timeout_s=5)


def test_every_rank_passed_lets_them_form_the_group():
    store = dist.HashStore()
    passed = threading.Thread(target=await_every_rank, args=(store, place(1), 300))
    passed.start()
    await_every_rank(store, place(0), 300)
    passed.join(5)
    assert not passed.is_alive()


def test_a_rank_that_never_checks_in_times_out_as_a_peer_failure():
    with pytest.raises(dist.DistError, match="1 of 2 ranks did not finish checking"):
        await_every_rank(dist.HashStore(), place(0), timeout_s=0.3)


def test_a_restarted_attempt_ignores_the_failed_attempts_refusal(monkeypatch):
    store = dist.HashStore()
    monkeypatch.setattr(launch_gate, "REPORT_S", 0.2)
    monkeypatch.setattr(launch_gate, "rendezvous_store", lambda env, timeout: store)
    report_refusal(place(1), ValueError("bad"))
    again = [LaunchEnv(rank=r, world_size=2, launched=True, restart_count=1) for r in (0, 1)]
    other = threading.Thread(target=await_every_rank, args=(store, again[1], 5))
    other.start()
    await_every_rank(store, again[0], 5)
    other.join(5)


def test_a_refusal_with_no_store_to_reach_is_left_to_the_timeout(monkeypatch):
    def unreachable(env, timeout):
        raise dist.DistNetworkError("connection refused")

    monkeypatch.setattr(launch_gate, "rendezvous_store", unreachable)
    report_refusal(place(1), ValueError("bad"))  # returns: nothing to tell
    report_refusal(LaunchEnv(), ValueError("bad"))  # a plain run has no peers


def test_an_unexpected_failure_is_named_by_its_type():
    assert refusal_line(ValueError("--lr must be positive")) == "--lr must be positive"
    assert refusal_line(PermissionError(13, "Permission denied")) == (
        "PermissionError: [Errno 13] Permission denied"
    )
    assert refusal_line(RuntimeError()) == "RuntimeError"


def test_the_group_forms_behind_the_gate_under_its_attempts_own_prefix(monkeypatch):
    """Several ranks wait at the gate (one has nothing to wait for), and each torchrun
    restart's group keys live apart from the failed attempt's in the surviving store."""
    from distzo.dist import process_group as pg

    store = dist.HashStore()
    gated: list[int] = []
    formed: list[dict] = []
    monkeypatch.setattr(pg, "rendezvous_store", lambda env, timeout: store)
    monkeypatch.setattr(pg, "await_every_rank", lambda _s, env, _t: gated.append(env.world_size))
    monkeypatch.setattr(pg.dist, "init_process_group", lambda **options: formed.append(options))
    for world, attempt in ((1, 0), (2, 0), (2, 3)):
        env = LaunchEnv(rank=0, world_size=world, launched=True, restart_count=attempt)
        pg.init_process_group(env, "gloo", 60.0)
    assert gated == [2, 2]
    formed[2]["store"].set("rank0", "here")
    assert store.check(["distzo/attempt-3/rank0"])  # (a get would wait for a missing key)
    assert not store.check(["distzo/attempt-0/rank0"])
