"""A checkpoint is read without running code from it: its DCP metadata is unpickled from an
allowlist, and an entry that is not a tensor (DCP would ``torch.load`` it unsafely) is
refused."""

import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from distzo.job.checkpoint import check_complete
from distzo.job.dcp_safe import TensorOnlyReader, load_tensors


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
