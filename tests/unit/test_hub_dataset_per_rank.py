"""An ``hf:`` dataset's questions are rank 0's (which commit is it?), told to the others
through the launcher's store; each node's first rank downloads it at that commit into the
node's cache, which the node's other ranks read offline: each rank asking for itself made
15 requests (distzo's 3, datasets' 12), 960 as 64 ranks launched. A refusal is every
waiting rank's line."""

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from distzo.config.job import resolve
from distzo.dist import LaunchEnv, launch_gate
from distzo.dist.launch_gate import node_first_answers, report_refusal
from distzo.job.validation import task_rows
from tests.helpers.stand_in_hub import COMMIT, ROWS, VALIDATION_ROWS, stand_in_hub

JOB = ["--task", "sst2", "--train-file", "hf:org/tiny:train"]
JOB += ["--eval-file", "hf:org/tiny:validation"]


def place(rank: int) -> LaunchEnv:
    """Rank ``rank`` of three: ranks 0 and 1 on node 0, rank 2 on node 1."""
    local = (0, 1, 0)[rank]
    return LaunchEnv(
        rank=rank,
        world_size=3,
        local_rank=local,
        local_world_size=2 - rank // 2,
        node_rank=rank // 2,
        launched=True,
    )


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> dist.Store:
    """The launcher's store every rank reaches."""
    shared = dist.HashStore()
    monkeypatch.setattr(launch_gate, "rendezvous_store", lambda env, timeout: shared)
    return shared


def test_a_nodes_first_rank_alone_asks_the_hub_about_a_dataset(store, monkeypatch, tmp_path, capfd):
    import datasets.config
    from huggingface_hub import constants

    job = resolve(JOB)
    with stand_in_hub(monkeypatch, tmp_path / "node0") as requests:
        by_rank = [task_rows(job, place(0))]
        asked = list(requests)
        by_rank.append(task_rows(job, place(1)))  # node 0's cache, offline
        assert requests == asked
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "node1"))
        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "node1" / "ds")
        by_rank.append(task_rows(job, place(2)))
        node_1 = requests[len(asked) :]
    # rank 0 asked which commit, and whether the hub answers, once: its download asked no more
    assert asked.count("GET /api/datasets/org/tiny") == 1 == asked.count("HEAD /")
    assert node_1.count("HEAD /") == 1  # node 1's first rank asks for its own route
    # datasets resolved org/tiny once a node: its train split's download prepared both splits
    listing = f"GET /api/datasets/org/tiny/tree/{COMMIT}"
    assert asked.count(listing) == 1 == node_1.count(listing)
    assert [r for r in asked if "/resolve/" in r and "/train.jsonl" in r]  # and downloaded
    # node 1 downloaded its own copy, at the commit rank 0 was told
    assert any(r.startswith("GET /datasets/org/tiny/resolve/") for r in node_1)
    assert all(COMMIT in r for r in node_1 if "/resolve/" in r)
    assert all("/main" not in r for r in node_1)
    for rows in by_rank:
        assert rows is not None and len(rows.train) == len(ROWS)
        assert len(rows.eval) == len(VALIDATION_ROWS)
        assert rows.digests == by_rank[0].digests
    # a node's other ranks read its cache without datasets' warnings about being offline
    assert "couldn't be found on the Hugging Face Hub" not in capfd.readouterr().err


def waiting(rank: int, job: list[str]) -> tuple[threading.Thread, list[BaseException]]:
    """Rank ``rank`` reading the task's rows in a thread, its failure kept."""
    failed: list[BaseException] = []

    def read() -> None:
        try:
            task_rows(resolve(job), place(rank))
        except BaseException as err:  # noqa: BLE001 - the test reads it
            failed.append(err)

    thread = threading.Thread(target=read)
    thread.start()
    return thread, failed


@pytest.mark.parametrize(
    "source, asked",
    [("hf:org/none:train", "revision"), ("hf:org/tiny:nosplit", "node's cache")],
)
def test_a_refusal_is_the_waiting_ranks_line(store, monkeypatch, tmp_path, source, asked):
    """Rank 0 asking which commit (a dataset the hub does not have), or the node's first
    rank filling its cache (a split the dataset does not have), fails: rank 1, waiting on
    its answer, raises its line at once."""
    job = JOB[:3] + [source] + JOB[4:]
    thread, failed = waiting(1, job)
    gate = launch_gate.gate_store(store, place(0))
    with stand_in_hub(monkeypatch, tmp_path / "hub"), pytest.raises(ValueError) as raised:
        while int(gate.add(launch_gate.ASKING, 0)) == 0 and thread.is_alive():
            time.sleep(0.01)  # rank 1 waits for an answer
        task_rows(resolve(job), place(0))
    report_refusal(place(0), raised.value)  # as the trainer does, before its node's exit
    thread.join(5)
    assert not thread.is_alive()
    assert str(failed[0]) == (
        f"rank 0 on node 0 refused its input: {raised.value}; fix it on that node and launch again"
    )
    assert str(raised.value).startswith(
        f"{source}: cannot load from the hub ("
        if asked == "revision"
        else f"{source}: org/tiny has no split 'nosplit'; its splits are train, validation"
    )
    # rank 0 had answered which commit where the node's cache failed, not where that did
    told = gate.check([launch_gate.ANSWER + f"{source}'s revision"])
    assert told == (asked == "node's cache")


def test_a_nodes_first_rank_that_never_answers_is_a_timeout(store):
    with pytest.raises(dist.DistError) as raised:
        node_first_answers(
            place(1), "q", lambda: pytest.fail("rank 1 asked"), timedelta(seconds=0.2)
        )
    assert str(raised.value) == (
        "node 0's first rank did not answer (q, on node 0) within 0.2s (a node's download)"
    )


def test_each_config_of_a_dataset_is_filled_and_once(store, monkeypatch):
    """One download a config: a train and an eval split of two configs of one dataset fill
    both configs' copies (the second's was refused as missing), one of one config once."""
    from distzo.job import validation

    filled: list[str] = []
    monkeypatch.setattr(validation, "hub_dataset_revision", lambda source: COMMIT)
    monkeypatch.setattr(
        validation, "fill_hub_cache", lambda source, *_, **kw: filled.append(source)
    )
    monkeypatch.setattr(validation, "load_task_rows", lambda *args: None)
    two = ["--task", "sst2", "--train-file", "hf:org/tiny:a:train"]
    task_rows(resolve([*two, "--eval-file", "hf:org/tiny:b:validation"]), place(0))
    assert filled == ["hf:org/tiny:a:train", "hf:org/tiny:b:validation"]
    filled.clear()
    task_rows(resolve([*two, "--eval-file", "hf:org/tiny:a:validation"]), place(0))
    assert filled == ["hf:org/tiny:a:train"]
