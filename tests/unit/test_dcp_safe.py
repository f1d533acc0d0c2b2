"""A checkpoint is read without running code from it: its DCP metadata is unpickled from an
allowlist, and an entry that is not a tensor (DCP would ``torch.load`` it unsafely) is
refused."""

import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from distzo.job.checkpoint import check_complete
from distzo.job.dcp_safe import TensorOnlyReader, load_tensors, metadata_bytes


def save(path, state):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's note that it runs without a process group
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class RunsTorch:
    def __reduce__(self):
        return (torch.set_default_dtype, (torch.float64,))


def test_a_checkpoints_tensors_load_through_the_allowlist(tmp_path):
    state = {
        "meta/step": torch.tensor([7], dtype=torch.int64),
        "block/0": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
        "resident": torch.randn(5, dtype=torch.float64),
    }
    save(tmp_path / "step-7", state)
    ours = TensorOnlyReader(str(tmp_path / "step-7")).read_metadata()
    theirs = dcp.FileSystemReader(str(tmp_path / "step-7")).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_tensors(loaded, tmp_path / "step-7", no_dist=True)
    for key, value in state.items():
        assert torch.equal(loaded[key], value)


def test_metadata_that_would_run_code_is_refused_unrun(tmp_path):
    path = tmp_path / "step-6"
    save(path, {"meta/step": torch.tensor([6])})
    marker = tmp_path / "ran"
    (path / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(pickle.UnpicklingError, match="system, which checkpoint metadata never"):
        TensorOnlyReader(str(path)).read_metadata()
    with pytest.raises(ValueError, match=r"\.metadata is unreadable \(it asks for .*system"):
        check_complete(path)
    assert not marker.exists()


def test_an_entry_that_is_not_a_tensor_is_refused(tmp_path):
    path = tmp_path / "step-1"
    save(path, {"meta/step": torch.tensor([1]), "extra": {"any": "object"}})
    with pytest.raises(pickle.UnpicklingError, match="entry 'extra.any' is not a tensor"):
        TensorOnlyReader(str(path)).read_metadata()


def test_metadata_calling_a_torch_function_is_refused_unrun(tmp_path):
    # the allowlist takes torch's sizes and dtypes, not every name under torch
    path = tmp_path / "step-6"
    save(path, {"meta/step": torch.tensor([6])})
    (path / ".metadata").write_bytes(pickle.dumps(RunsTorch()))
    before = torch.get_default_dtype()
    try:
        with pytest.raises(pickle.UnpicklingError, match="torch.set_default_dtype, which"):
            TensorOnlyReader(str(path)).read_metadata()
        assert torch.get_default_dtype() == before
    finally:
        torch.set_default_dtype(before)


def _tampered(path, change):
    """Checkpoint ``path``'s metadata rewritten by ``change(metadata)``."""
    metadata = TensorOnlyReader(str(path)).read_metadata()
    metadata.storage_meta = None
    change(metadata)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


def _place(relative_path=None, offset=None, length=None):
    def change(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = info.relative_path if relative_path is None else relative_path
            info.offset = info.offset if offset is None else offset
            info.length = info.length if length is None else length

    return change


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: setattr(m, "storage_data", 5), "its storage_data is of type int, not a dict"),
        (
            lambda m: setattr(m, "state_dict_metadata", [1]),
            "its entries are of type list, not a dict",
        ),
        (lambda m: m.storage_data.update({k: 7 for k in m.storage_data}), "places an item at 7"),
        (_place(offset=-1), "not a file's byte range"),
        (_place(offset="0"), "not a file's byte range"),
        (_place("../step-2/__0_0.distcp"), "outside the checkpoint's folder"),
        (_place("/etc/passwd"), "outside the checkpoint's folder"),
        # a negative length, the folder itself, a Windows-style climb: each a traceback
        # inside DCP's reader (or a read elsewhere) unless refused here
        (_place(length=-1), "not a file's byte range"),
        (_place(length=True), "not a file's byte range"),
        (_place(""), "outside the checkpoint's folder"),
        (_place("..\\step-2\\__0_0.distcp"), "outside the checkpoint's folder"),
    ],
)
def test_metadata_placing_items_oddly_or_outside_is_one_line(tmp_path, change, message):
    path = tmp_path / "step-3"
    save(path, {"meta/step": torch.tensor([3])})
    _tampered(path, change)
    with pytest.raises(pickle.UnpicklingError, match=message):
        TensorOnlyReader(str(path)).read_metadata()
    with pytest.raises(ValueError, match=r"step-3 is damaged: .*\.metadata is unreadable"):
        check_complete(path)


def test_a_checkpoints_metadata_is_read_again_only_where_it_changed(tmp_path, monkeypatch):
    """A resume's checks and load read the chosen checkpoint's .metadata ten times on every
    rank (eighty opens of one shared file on a node of eight); the bytes are now kept for
    the file as it is, and a file replaced since is read again."""
    save(tmp_path / "step-1", {"a": torch.zeros(3)})
    save(tmp_path / "step-2", {"a": torch.zeros(3), "b": torch.ones(2)})
    opened = []
    real_open = Path.open

    def counted(self, *args, **kwargs):
        if self.name == ".metadata":
            opened.append(self.parent.name)
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", counted)

    def keys(step):
        return set(TensorOnlyReader(str(tmp_path / step)).read_metadata().state_dict_metadata)

    assert [keys("step-1") for _ in range(3)] == [{"a"}] * 3
    assert keys("step-2") == {"a", "b"} and keys("step-1") == {"a"}
    assert opened == ["step-1", "step-2", "step-1"]
    os.replace(tmp_path / "step-2" / ".metadata", tmp_path / "step-1" / ".metadata")
    assert keys("step-1") == {"a", "b"}  # the file replaced: read again
    assert opened[-1] == "step-1" and len(opened) == 4


def test_metadata_is_read_again_where_only_its_inode_size_or_mtime_changed(tmp_path):
    """Any one of them tells another file: a rewrite in place of the same size (a later
    mtime), one of another size within the same mtime tick, a replacement copied with its
    size and mtime kept (``cp -p``, rsync)."""
    meta = tmp_path / ".metadata"
    meta.write_bytes(b"first")
    later = meta.stat().st_mtime_ns + 10**9
    assert metadata_bytes(tmp_path) == b"first"
    meta.write_bytes(b"other")  # in place: the same inode and size
    os.utime(meta, ns=(later, later))
    assert metadata_bytes(tmp_path) == b"other"
    meta.write_bytes(b"longer")  # in place, the mtime as it was
    os.utime(meta, ns=(later, later))
    assert metadata_bytes(tmp_path) == b"longer"
    copy = tmp_path / "copy"
    copy.write_bytes(b"copied")  # another file: the same size and mtime
    os.utime(copy, ns=(later, later))
    os.replace(copy, meta)
    assert metadata_bytes(tmp_path) == b"copied"
