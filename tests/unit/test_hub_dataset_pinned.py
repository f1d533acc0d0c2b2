"""A launch's ranks read an ``hf:`` dataset offline from their node's datasets cache at the
commit rank 0 was told: ``datasets`` offline reads the cache's most recently prepared copy,
whatever its commit, so a node whose cache held another commit's copy, prepared later,
trained on that copy's rows; a rank's row digests agree with its node's, so one node (or
nodes sharing one cache) did so without a word."""

import json
import os
import shutil

import pytest

from distzo.data.loaders import HubPin, fill_hub_cache, iter_numbered_rows
from tests.helpers.stand_in_hub import COMMIT, OLD_COMMIT, OLD_ROWS, ROWS, stand_in_hub

SOURCE = "hf:org/tiny:train"


def rows_at(commit: str) -> list[dict]:
    """The rows a launch's rank reads from its node's cache at ``commit``."""
    return [row for _, row in iter_numbered_rows(SOURCE, HubPin(commit, cached=True))]


def test_the_pinned_commits_copy_is_read_where_the_cache_has_a_newer_one(monkeypatch, tmp_path):
    with stand_in_hub(monkeypatch, tmp_path) as requests:
        fill_hub_cache(SOURCE, COMMIT)  # a past run's copy, of the commit the hub is on now
        copies = tmp_path / "datasets" / "org___tiny" / "default" / "0.0.0"
        os.utime(copies / COMMIT, (1e9, 1e9))
        fill_hub_cache(SOURCE, OLD_COMMIT)  # then a script read an earlier commit
        asked = list(requests)
        assert rows_at(COMMIT) == ROWS
        assert rows_at(OLD_COMMIT) == OLD_ROWS
        assert requests == asked  # offline: the node's cache alone


def test_a_cache_without_the_pinned_commits_copy_is_one_line(monkeypatch, tmp_path):
    with stand_in_hub(monkeypatch, tmp_path):
        fill_hub_cache(SOURCE, OLD_COMMIT)
        with pytest.raises(ValueError) as raised:
            rows_at(COMMIT)
    assert str(raised.value) == (
        f"{SOURCE}: this node's datasets cache ({tmp_path / 'datasets' / 'org___tiny'}) holds "
        f"no copy at commit {COMMIT}, which rank 0 pinned and the node's first rank "
        "downloaded; give a node's ranks one HF_DATASETS_CACHE"
    )


def test_a_node_the_hub_is_silent_to_refuses_a_cache_without_the_commit(monkeypatch, tmp_path):
    """Its first rank read the cache as it was (another commit's copy): refused there, once,
    naming the cause, not on every rank as a cache the ranks do not share."""
    import time

    from huggingface_hub import constants

    from distzo.models import hub_reads

    with stand_in_hub(monkeypatch, tmp_path):
        fill_hub_cache(SOURCE, OLD_COMMIT)
        monkeypatch.setitem(hub_reads.SILENT_SINCE, constants.ENDPOINT, time.monotonic())
        with pytest.raises(ValueError) as raised:
            fill_hub_cache(SOURCE, COMMIT)
    assert str(raised.value) == (
        f"{SOURCE}: this node's datasets cache ({tmp_path / 'datasets' / 'org___tiny'}) holds "
        f"no copy at commit {COMMIT}, which rank 0 pinned and the hub did not give this node "
        "(its warning says why); let the node reach the hub, or download the dataset at that "
        "commit on it first"
    )


def test_an_unknown_split_of_the_pinned_copy_is_the_loads_line(monkeypatch, tmp_path):
    with stand_in_hub(monkeypatch, tmp_path):
        fill_hub_cache(SOURCE, COMMIT)
        with pytest.raises(ValueError, match=r"^hf:org/tiny:test: cannot load from the hub \("):
            list(iter_numbered_rows("hf:org/tiny:test", HubPin(COMMIT, cached=True)))


def test_copies_of_several_configs_at_the_commit_need_one_named(monkeypatch, tmp_path):
    with stand_in_hub(monkeypatch, tmp_path):
        fill_hub_cache(SOURCE, COMMIT)
        tiny = tmp_path / "datasets" / "org___tiny"
        other = tiny / "other" / "0.0.0" / COMMIT
        shutil.copytree(tiny / "default" / "0.0.0" / COMMIT, other)
        info = json.loads((other / "dataset_info.json").read_text())
        (other / "dataset_info.json").write_text(json.dumps(info | {"config_name": "other"}))
        with pytest.raises(ValueError) as raised:
            rows_at(COMMIT)
        named = iter_numbered_rows("hf:org/tiny:default:train", HubPin(COMMIT, cached=True))
        assert [row for _, row in named] == ROWS
    assert str(raised.value) == (
        f"{SOURCE}: the datasets cache holds configs default, other at commit {COMMIT}; "
        "name one: hf:org/tiny:CONFIG:train"
    )
