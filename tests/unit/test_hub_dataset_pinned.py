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


def copied_as_other(prepared, folder) -> None:
    """A prepared copy copied to ``folder`` as config ``other``'s (its info renamed)."""
    shutil.copytree(prepared, folder)
    info = json.loads((folder / "dataset_info.json").read_text())
    (folder / "dataset_info.json").write_text(json.dumps(info | {"config_name": "other"}))


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
        with pytest.raises(ValueError) as raised:
            list(iter_numbered_rows("hf:org/tiny:test", HubPin(COMMIT, cached=True)))
    assert str(raised.value) == (
        "hf:org/tiny:test: org/tiny has no split 'test'; its splits are train, validation: "
        "write e.g. hf:org/tiny:train"
    )


def test_copies_of_several_configs_at_the_commit_need_one_named(monkeypatch, tmp_path):
    with stand_in_hub(monkeypatch, tmp_path):
        fill_hub_cache(SOURCE, COMMIT)
        tiny = tmp_path / "datasets" / "org___tiny"
        copied_as_other(tiny / "default" / "0.0.0" / COMMIT, tiny / "other" / "0.0.0" / COMMIT)
        with pytest.raises(ValueError) as raised:
            rows_at(COMMIT)
        named = iter_numbered_rows("hf:org/tiny:default:train", HubPin(COMMIT, cached=True))
        assert [row for _, row in named] == ROWS
    assert str(raised.value) == (
        f"{SOURCE}: the datasets cache holds configs default, other at commit {COMMIT}; "
        "name one: hf:org/tiny:CONFIG:train"
    )


def prepared_copy(folder, config):
    """A stand-in prepared copy: the folder and the ``dataset_info.json`` datasets writes."""
    folder.mkdir(parents=True)
    (folder / "dataset_info.json").write_text(json.dumps({"config_name": config}))
    return folder


def test_a_camel_case_name_is_found_where_datasets_prepares_it(monkeypatch, tmp_path):
    """datasets names a dataset's cache folder in snake case (org/TinySet: org___tiny_set)."""
    import datasets.config

    from distzo.data.hub_cache import pinned_folder

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path)
    copy = prepared_copy(tmp_path / "org___tiny_set" / "default" / "0.0.0" / COMMIT, "default")
    assert pinned_folder("org/TinySet", None, "train", COMMIT, "hf:org/TinySet:train") == copy


def test_copies_of_other_options_or_unreadable_infos_are_not_another_config(monkeypatch, tmp_path):
    """A copy prepared with other options (datasets' ``default-HASH`` folder, its info
    naming ``default``) or one whose info cannot be read is no config of its own: the
    pinned copy is read, not refused as one of several configs."""
    import datasets.config

    from distzo.data.hub_cache import pinned_folder

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path)
    tiny = tmp_path / "org___tiny"
    copy = prepared_copy(tiny / "default" / "0.0.0" / COMMIT, "default")
    prepared_copy(tiny / "default-6f2a9c" / "0.0.0" / COMMIT, "default")
    (prepared_copy(tiny / "cut" / "0.0.0" / COMMIT, "cut") / "dataset_info.json").write_text("{")
    (prepared_copy(tiny / "listed" / "0.0.0" / COMMIT, "x") / "dataset_info.json").write_text("[]")
    assert pinned_folder("org/tiny", None, "train", COMMIT, SOURCE) == copy


def test_a_named_config_is_read_from_its_own_copy_at_its_version(monkeypatch, tmp_path):
    """hf:org/tiny:other:train reads the ``other`` copy (rows of its own), whatever the
    version folder datasets prepared it under."""
    with stand_in_hub(monkeypatch, tmp_path):
        fill_hub_cache(SOURCE, COMMIT)
        fill_hub_cache(SOURCE, OLD_COMMIT)
        tiny = tmp_path / "datasets" / "org___tiny"
        copied_as_other(tiny / "default" / "0.0.0" / OLD_COMMIT, tiny / "other" / "1.2.0" / COMMIT)
        named = iter_numbered_rows("hf:org/tiny:other:train", HubPin(COMMIT, cached=True))
        assert [row for _, row in named] == OLD_ROWS


def test_a_node_told_no_commit_fills_from_its_cache_without_asking_the_hub(monkeypatch, tmp_path):
    """The hub did not answer rank 0: a node's first rank reads its cache as it is, not
    asking a hub that was silent."""
    with stand_in_hub(monkeypatch, tmp_path) as requests:
        fill_hub_cache(SOURCE, COMMIT)
        asked = list(requests)
        fill_hub_cache(SOURCE, None)
        assert requests == asked


def test_a_local_dataset_folder_is_read_in_a_launch_as_by_one_process(monkeypatch, tmp_path):
    """hf:FOLDER:SPLIT (a clone of a hub dataset's repository) is read from the folder by
    one process; a launch's rank 0 asked the hub which commit the folder was, a name the hub
    refuses ("Repo id must be in the form..."), so the launch was refused where the hub
    answers. A folder has no commit: every rank reads it, the hub asked nothing."""
    from datasets import Dataset

    from distzo.data.loaders import hub_dataset_revision

    folder = tmp_path / "clone"
    (folder / "data").mkdir(parents=True)
    Dataset.from_list(ROWS).to_parquet(str(folder / "data" / "train-00000-of-00001.parquet"))
    source = f"hf:{folder}:train"
    with stand_in_hub(monkeypatch, tmp_path / "hub") as requests:
        assert hub_dataset_revision(source) == ""  # rank 0: no commit to pin
        fill_hub_cache(source, None)  # a node's first rank
        rows = [row for _, row in iter_numbered_rows(source, HubPin(None, cached=True))]
    assert rows == ROWS and not [request for request in requests if "clone" in request]
