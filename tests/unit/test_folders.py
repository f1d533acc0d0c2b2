"""``distzo.runtime.folders``: a folder is writable only where this process may both write
in it and enter it, and why not is named (its permissions, or a read-only mount)."""

import os
import stat
from types import SimpleNamespace

import pytest

from distzo.runtime.folders import nearest_existing, unwritable


def as_its_owner(path, mode: int) -> bool:
    """os.access as the folder's owner without root's override (the tests may run as root,
    which os.access never denies): the owner's permission bits decide."""
    bits = os.stat(path).st_mode
    wanted = {os.W_OK: stat.S_IWUSR, os.X_OK: stat.S_IXUSR, os.R_OK: stat.S_IRUSR}
    return all(bits & bit for flag, bit in wanted.items() if mode & flag)


@pytest.mark.parametrize(
    "mode, why", [(0o700, None), (0o500, "permission denied"), (0o600, "permission denied")]
)
def test_a_folder_is_writable_only_where_it_may_be_written_and_entered(
    tmp_path, monkeypatch, mode, why
):
    folder = tmp_path / "folder"
    folder.mkdir()
    folder.chmod(mode)  # 0o600: files cannot be made in a folder that cannot be entered
    monkeypatch.setattr(os, "access", as_its_owner)
    try:
        assert unwritable(folder) == why
    finally:
        folder.chmod(0o700)


def test_a_read_only_mount_is_named_and_the_nearest_existing_folder_is_the_one_asked(
    tmp_path, monkeypatch
):
    assert nearest_existing(tmp_path / "a" / "b" / "c") == tmp_path
    assert nearest_existing(tmp_path) == tmp_path
    statvfs = os.statvfs
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    monkeypatch.setattr(
        os, "statvfs", lambda path: SimpleNamespace(f_flag=statvfs(path).f_flag | os.ST_RDONLY)
    )
    assert unwritable(tmp_path) == "a read-only file system"
