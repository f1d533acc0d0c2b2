"""Where the hub answers rank 0 nothing (``HF_HUB_OFFLINE=1``, a firewall), a launch's
``hf:`` dataset is pinned to the commit of the copy rank 0 reads from its own cache: each
node read its own cache's newest copy, of whatever commit, so two nodes whose caches held
different commits' copies trained on different rows (the eval split's, unchecked)."""

import logging

import pytest
import torch.distributed as dist

from distzo.config.job import resolve
from distzo.data.loaders import fill_hub_cache
from distzo.dist import launch_gate
from distzo.job.validation import task_rows
from tests.helpers.stand_in_hub import COMMIT, OLD_COMMIT, OLD_ROWS, stand_in_hub
from tests.unit.test_hub_dataset_per_rank import place

SOURCE = "hf:org/tiny:train"
JOB = ["--task", "sst2", "--train-file", SOURCE, "--eval-file", SOURCE]


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> dist.Store:
    """The launcher's store every rank reaches."""
    shared = dist.HashStore()
    monkeypatch.setattr(launch_gate, "rendezvous_store", lambda env, timeout: shared)
    return shared


def on_node(monkeypatch: pytest.MonkeyPatch, cache) -> None:
    """This process as a node whose datasets cache is ``cache``."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)


def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub answers no rank (``HF_HUB_OFFLINE=1``)."""
    import datasets.config
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def filled(monkeypatch, tmp_path, node: str, *commits: str):
    """Node ``node``'s datasets cache holding org/tiny's copies at ``commits``, the last
    prepared last (the copy ``datasets`` offline reads)."""
    cache = tmp_path / node
    on_node(monkeypatch, cache)
    for commit in commits:
        fill_hub_cache(SOURCE, commit)
    return cache


def test_every_node_reads_the_commit_rank_0s_cache_holds(store, monkeypatch, tmp_path, caplog):
    with stand_in_hub(monkeypatch, tmp_path / "hub") as requests:
        node_0 = filled(monkeypatch, tmp_path, "node0", COMMIT, OLD_COMMIT)
        node_1 = filled(monkeypatch, tmp_path, "node1", OLD_COMMIT, COMMIT)
        offline(monkeypatch)
        asked = list(requests)
        job = resolve(JOB)
        on_node(monkeypatch, node_0)
        with caplog.at_level(logging.INFO, logger="distzo.train"):
            by_rank = [task_rows(job, place(0))]
        by_rank.append(task_rows(job, place(1)))
        on_node(monkeypatch, node_1)  # its newest copy is COMMIT's: its rows were those
        by_rank.append(task_rows(job, place(2)))
        assert requests == asked  # no rank asked the hub
    for rows in by_rank:
        assert rows is not None and rows.digests == by_rank[0].digests
    assert len(by_rank[0].train) == len(OLD_ROWS)  # rank 0's newest copy, as read alone
    assert (
        f"{SOURCE}: the hub did not answer rank 0; every node reads the copy at commit "
        f"{OLD_COMMIT} in its datasets cache, as rank 0 does"
    ) in caplog.messages


def test_a_node_without_rank_0s_cached_commit_refuses_naming_it(store, monkeypatch, tmp_path):
    with stand_in_hub(monkeypatch, tmp_path / "hub"):
        node_0 = filled(monkeypatch, tmp_path, "node0", OLD_COMMIT)
        node_1 = filled(monkeypatch, tmp_path, "node1", COMMIT)
        offline(monkeypatch)
        job = resolve(JOB)
        on_node(monkeypatch, node_0)
        task_rows(job, place(0))
        on_node(monkeypatch, node_1)
        with pytest.raises(ValueError) as raised:
            task_rows(job, place(2))
    assert str(raised.value) == (
        f"{SOURCE}: this node's datasets cache ({node_1 / 'org___tiny'}) holds no copy at "
        f"commit {OLD_COMMIT}, which rank 0 pinned from its own cache (the hub did not answer "
        "it); give the nodes one HF_DATASETS_CACHE (a shared filesystem), or run with the hub "
        "reachable"
    )


def test_one_process_offline_reads_its_caches_newest_copy_as_before(monkeypatch, tmp_path):
    """Alone, no pin: ``datasets``' own offline read, its cache's newest copy."""
    from distzo.dist import LaunchEnv

    with stand_in_hub(monkeypatch, tmp_path / "hub"):
        filled(monkeypatch, tmp_path, "node0", COMMIT, OLD_COMMIT)
        offline(monkeypatch)
        rows = task_rows(resolve(JOB), LaunchEnv())
    assert rows is not None and len(rows.train) == len(OLD_ROWS)


def test_rank_0s_copy_is_its_newest_whole_one_of_the_config(monkeypatch, tmp_path):
    """As ``datasets`` offline chooses: the most recently modified copy of the config, not
    one being prepared (``COMMIT.incomplete``) nor another config's."""
    import os

    from distzo.data.hub_cache import cached_commit
    from tests.unit.test_hub_dataset_pinned import prepared_copy

    on_node(monkeypatch, tmp_path)
    tiny = tmp_path / "org___tiny"
    assert cached_commit("org/tiny", None) == ""
    for age, (config, name) in enumerate(
        [("other", "c" * 40), ("default", COMMIT + ".incomplete"), ("default", OLD_COMMIT)]
    ):
        os.utime(prepared_copy(tiny / config / "0.0.0" / name, config), (1e9 - age, 1e9 - age))
    prepared_copy(tiny / "default" / "0.0.0" / COMMIT, "default")  # prepared now: newest
    os.utime(tiny / "default" / "0.0.0" / (COMMIT + ".incomplete"))  # being written now
    assert cached_commit("org/tiny", None) == COMMIT
    assert cached_commit("org/tiny", "other") == "c" * 40
    os.utime(tiny / "default" / "0.0.0" / OLD_COMMIT)
    assert cached_commit("org/tiny", "default") == OLD_COMMIT


def test_a_node_the_hub_answers_asks_it_nothing_for_rank_0s_cached_commit(monkeypatch, tmp_path):
    """Rank 0 pinned its cache's commit (the hub silent to it): a node the hub does answer
    reads its own copy of that commit, and asks the hub nothing (``from_cache``)."""
    from tests.unit.test_hub_dataset_pinned import prepared_copy

    with stand_in_hub(monkeypatch, tmp_path / "hub") as requests:
        on_node(monkeypatch, tmp_path / "node1")
        prepared_copy(
            tmp_path / "node1" / "org___tiny" / "default" / "0.0.0" / OLD_COMMIT, "default"
        )
        fill_hub_cache(SOURCE, OLD_COMMIT, from_cache=True)
        assert requests == []
