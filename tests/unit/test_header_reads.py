"""A job reads each safetensors file's header once: its start checks that every file opens,
the model's build and the engine's check the shapes, and each of those read every
shard's header again (three reads a file, four for a single file), a 405B model's 191."""

import collections
from pathlib import Path

import pytest
import safetensors

from tests.helpers.launch import train_in_process
from tests.helpers.models import tiny_opt


class Counted:
    """``safe_open``, counting per file the opens that read no tensor (header reads)
    apart from those that read one (``tensors``)."""

    def __init__(self) -> None:
        self.safe_open = safetensors.safe_open
        self.headers: collections.Counter[str] = collections.Counter()
        self.tensors: collections.Counter[str] = collections.Counter()

    def __call__(self, path, *args, **kwargs) -> "_Handle":
        return _Handle(self, Path(path).name, self.safe_open(path, *args, **kwargs))


class _Handle:
    def __init__(self, counts: Counted, name: str, inner) -> None:
        self.counts, self.name, self.inner, self.read = counts, name, inner, False

    def __enter__(self) -> "_Handle":
        self.inner.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        (self.counts.tensors if self.read else self.counts.headers)[self.name] += 1
        self.inner.__exit__(*exc)

    def keys(self):
        return self.inner.keys()

    def metadata(self):
        return self.inner.metadata()

    def get_tensor(self, name):
        self.read = True
        return self.inner.get_tensor(name)

    def get_slice(self, name):
        return _Slice(self, self.inner.get_slice(name))


class _Slice:
    def __init__(self, handle: _Handle, inner) -> None:
        self.handle, self.inner = handle, inner

    def get_shape(self):
        return self.inner.get_shape()

    def get_dtype(self):
        return self.inner.get_dtype()

    def __getitem__(self, key):
        self.handle.read = True
        return self.inner[key]


@pytest.mark.parametrize("sharded", [False, True])
def test_a_job_reads_each_safetensors_header_once(tmp_path, monkeypatch, sharded):
    folder = tmp_path / "model"
    tiny_opt(seed=1).save_pretrained(folder, max_shard_size="20KB" if sharded else "5GB")
    files = sorted(file.name for file in folder.glob("*.safetensors"))
    assert len(files) == (5 if sharded else 1)
    counts = Counted()
    monkeypatch.setattr(safetensors, "safe_open", counts)
    args = ["--model", str(folder), "--max-steps", "0", "--output-dir", str(tmp_path / "run")]
    done = train_in_process(args)
    assert done.returncode == 0, done.stderr
    assert dict(counts.headers) == dict.fromkeys(files, 1)
    assert sorted(counts.tensors) == files  # each tensor's own read still opens its file


@pytest.mark.parametrize("form", ["safetensors", "bin"])
def test_a_file_rewritten_in_place_is_read_again(tmp_path, form):
    """The headers are kept per state of a file: one rewritten in place (``cp`` keeps the
    inode), in a notebook that goes on, is read anew, never checked by its old shapes."""
    import os

    import torch
    from safetensors.torch import save_file

    from distzo.models.weights import safetensors_header, torch_bin_header

    path = tmp_path / f"model.{form}"
    header = safetensors_header if form == "safetensors" else torch_bin_header

    def write(shape: tuple[int, ...], mtime_ns: int) -> None:
        tensors = {"w": torch.zeros(shape)}
        if form == "safetensors":
            data = tmp_path / "new"
            save_file(tensors, str(data))
        else:
            torch.save(tensors, data := tmp_path / "new")
        with open(path, "r+b" if path.exists() else "wb") as out:  # the same inode
            out.write(data.read_bytes())
            out.truncate()
        os.utime(path, ns=(mtime_ns, mtime_ns))

    write((2, 3), 10**18)
    inode = path.stat().st_ino
    assert dict(header(path)) == {"w": (2, 3)}
    write((3, 2), 10**18 + 10**9)  # the same size, a second later
    assert path.stat().st_ino == inode
    assert dict(header(path)) == {"w": (3, 2)}


def test_a_job_maps_each_bin_file_for_its_checks_once(tmp_path, monkeypatch):
    """The same for ``.bin`` shards: the start checks, the model's build and the engine's
    check would each map every file (its pickle read) again; once is enough. (The stream
    maps each shard again as its tensors are read, one shard at a time.)"""
    import sys

    from distzo.models import weights
    from tests.unit.test_weight_extras import as_bin

    folder = tmp_path / "model"
    tiny_opt(seed=1).save_pretrained(folder, max_shard_size="20KB")
    files = sorted(file.name for file in as_bin(folder).glob("*.bin"))
    assert len(files) == 5
    for_checks: collections.Counter[str] = collections.Counter()
    torch_bin_file = weights.torch_bin_file

    def counting(path: Path):
        if sys._getframe(1).f_code.co_name == "_bin_header":  # a check's, not the stream's
            for_checks[Path(path).name] += 1
        return torch_bin_file(path)

    monkeypatch.setattr(weights, "torch_bin_file", counting)
    args = ["--model", str(folder), "--max-steps", "0", "--output-dir", str(tmp_path / "run")]
    done = train_in_process(args)
    assert done.returncode == 0, done.stderr
    assert dict(for_checks) == dict.fromkeys(files, 1)
