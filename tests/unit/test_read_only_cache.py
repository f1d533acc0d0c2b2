"""An ``hf:`` dataset a group's read-only Hugging Face cache holds is read from it: ``datasets``
locked the cache to read it and failed with ``Read-only file system`` (or ``Permission
denied``) where every row was there."""

import errno
import os
import shutil
from pathlib import Path

import pytest

from distzo.data.loaders import HubPin, iter_numbered_rows, load_rows
from tests.helpers.read_only import read_only

ROWS = [{"sentence": f"row {i}", "label": i % 2} for i in range(4)]


def cache_dataset(cache: Path, staging: Path) -> None:
    """What an earlier ``load_dataset("org/tiny", split="train")`` leaves in the datasets
    cache ``cache``: the prepared split, under the dataset's name."""
    import datasets

    datasets.Dataset.from_list(ROWS).to_json(staging / "train.jsonl")
    datasets.load_dataset(
        "json", data_files={"train": str(staging / "train.jsonl")}, cache_dir=str(staging / "cache")
    )
    prepared = next((staging / "cache" / "json").glob("*/*/*/dataset_info.json")).parent
    target = cache / "org___tiny" / "default" / "0.0.0" / prepared.name
    shutil.copytree(prepared, target)
    for arrow in target.glob("json-*.arrow"):
        arrow.rename(target / arrow.name.replace("json-", "tiny-", 1))


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """datasets offline (``HF_HUB_OFFLINE=1``), its cache in tmp_path holding org/tiny."""
    import datasets.config
    from huggingface_hub import constants

    cache = tmp_path / "datasets"
    cache_dataset(cache, tmp_path)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_dataset_in_a_read_only_cache_is_read_from_it(offline_cache, monkeypatch):
    before = sorted(offline_cache.rglob("*"))
    with read_only(offline_cache, monkeypatch):
        assert load_rows("hf:org/tiny:train") == ROWS
    assert sorted(offline_cache.rglob("*")) == before  # nothing written, nothing tried half


def test_a_launchs_copy_at_its_commit_is_read_from_a_read_only_cache(offline_cache, monkeypatch):
    """A launch's rank reads the copy at rank 0's commit (``HubPin``), not datasets' newest."""
    commit = next(offline_cache.glob("org___tiny/default/0.0.0/*")).name
    with read_only(offline_cache, monkeypatch):
        read = iter_numbered_rows("hf:org/tiny:train", HubPin(commit, cached=True))
        assert [row for _, row in read] == ROWS


def test_a_writable_cache_is_still_locked(offline_cache):
    """Where the lock file can be made, datasets takes it (a load preparing the dataset
    beside another's keeps it), and its own lock class is back after the load."""
    import datasets.builder

    lock_class = datasets.builder.FileLock
    assert load_rows("hf:org/tiny:train") == ROWS
    assert list(offline_cache.glob("*.lock"))  # the builder's lock, as datasets leaves it
    assert datasets.builder.FileLock is lock_class


def test_only_a_read_only_folder_goes_unlocked(tmp_path, monkeypatch):
    """Another failure to lock (a full disk, a filesystem without locks) is raised as it
    was, and so is a lock refused in a folder this user may write (another user's lock
    file, private to them: a second writer would prepare the dataset beside the first)."""
    from distzo.data.read_only_cache import LockUnlessReadOnly

    class Refusing:
        def __init__(self, path: str, error: int) -> None:
            self.error = error

        def acquire(self) -> None:
            raise OSError(self.error, os.strerror(self.error))

    shared, writable = tmp_path / "shared", tmp_path / "mine"
    shared.mkdir(), writable.mkdir()
    with read_only(shared, monkeypatch):
        with LockUnlessReadOnly(Refusing, str(shared / "x.lock"), errno.EROFS) as lock:
            assert not lock.held
        with pytest.raises(OSError, match="No space left"):
            with LockUnlessReadOnly(Refusing, str(shared / "x.lock"), errno.ENOSPC):
                pass
    with pytest.raises(PermissionError):
        with LockUnlessReadOnly(Refusing, str(writable / "x.lock"), errno.EACCES):
            pass
