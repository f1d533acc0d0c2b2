"""What distzo writes through safetensors is readable as the umask allows, like the
``config.json`` beside it. safetensors 0.8 writes through a temporary file it renames, so
its files came out private (0600 under any umask): an exported model or adapter that another
user, a serving container or the group on a shared filesystem loads was a missing file
there."""

from __future__ import annotations

import os
import stat

import pytest
from safetensors.torch import save_file

from distzo import ZOConfig, ZOEngine
from distzo.export.hf_model import export_model
from distzo.runtime import safetensors_write as writes
from tests.helpers.models import adapted, tiny_opt

UMASK = 0o027  # the group reads, others nothing: a shared project's setting


@pytest.fixture
def group_umask():
    previous = os.umask(UMASK)
    yield 0o640
    os.umask(previous)


def modes(folder):
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.rglob("*") if p.is_file()}


def engine_for(model):
    return ZOEngine(model, ZOConfig(mode="resident", lr=1e-3, eps=1e-3, seed=0, device="cpu"))


def test_an_exported_model_and_adapter_are_read_as_the_umask_allows(tmp_path, group_umask):
    out = export_model(engine_for(tiny_opt()), tmp_path / "model", max_shard_size="20KB")
    assert len(list(out.glob("*.safetensors"))) > 1
    assert set(modes(out).values()) == {group_umask}, modes(out)
    out = export_model(engine_for(adapted("opt")), tmp_path / "adapter")
    assert modes(out) == {
        "adapter_config.json": group_umask,
        "adapter_model.safetensors": group_umask,
    }


def test_a_folder_save_pretrained_wrote_and_a_file_get_the_ordinary_mode(tmp_path, group_umask):
    # the default model's base/ is a save_pretrained folder; the exported step's keys a file
    with writes.safetensors_write(tmp_path / "base"):
        tiny_opt().save_pretrained(tmp_path / "base")
    assert set(modes(tmp_path / "base").values()) == {group_umask}
    with writes.safetensors_write(tmp_path / "keys.safetensors"):
        save_file({}, str(tmp_path / "keys.safetensors"))
    assert modes(tmp_path)["keys.safetensors"] == group_umask
    assert writes.ordinary_mode(directory=True) == 0o750


def test_the_umask_is_read_without_setting_it(group_umask, monkeypatch):
    # os.umask sets the mask while it reads it: a checkpoint thread's file made then
    # would get the wrong mode; Linux shows it in /proc/self/status instead
    monkeypatch.setattr(os, "umask", lambda mask: pytest.fail("os.umask was called"))
    assert writes.ordinary_mode() == 0o640
