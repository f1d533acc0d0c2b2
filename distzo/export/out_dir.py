"""A command's output folder (``--out``): refused when it exists unless replacing it was
asked for, written under ``<out>.tmp`` and renamed when complete, so a reader never sees
a half-written folder and nothing a user already has is destroyed unasked."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from distzo.runtime.argument_values import check_flag
from distzo.runtime.folders import nearest_existing, unwritable


def staging_dir(out: Path) -> Path:
    """Where ``out`` is written before it is published."""
    return out.with_name(out.name + ".tmp")


def check_out(out: Path, overwrite: bool) -> Path:
    """An existing --out (a folder or a file) is replaced only when asked, and its staging
    folder must not be someone's: the command deletes and renames it. Returns ``out``
    normalised (``x/..`` is ``.``), the path to write: ``--out .. --overwrite`` deleted the
    working directory's parent, then staged into ``...tmp`` inside it and failed. A folder
    it cannot be written in is refused here: a replay found out after its last step."""
    full = Path(os.path.abspath(out))
    here = Path.cwd()
    if full == here or full in here.parents:
        raise ValueError(
            f"--out {out}: {full} {'is' if full == here else 'holds'} the working directory, "
            f"which replacing it would delete; give a folder of its own, such as --out "
            f"{Path(out) / 'model'}"
        )
    if (out.exists() or out.is_symlink()) and not overwrite:
        kind = "folder" if out.is_dir() else "file"
        raise ValueError(
            f"--out {out}: the {kind} exists; add --overwrite to replace it, or give another --out"
        )
    staging = staging_dir(full)
    if staging.exists() or staging.is_symlink():
        raise ValueError(
            f"--out {out}: {staging} exists (the output is written there first, then renamed); "
            "move it aside or give another --out"
        )
    existing = nearest_existing(full.parent)
    if not existing.is_dir():
        raise ValueError(f"--out {out}: {existing} is a file, not a directory")
    why = unwritable(existing)  # known now, not after the work the output holds
    if why is not None:
        raise ValueError(f"--out {out}: {existing} is not writable ({why}); give another --out")
    return full


def check_replaceable(directory: Path, overwrite: bool) -> None:
    """An export from Python replaces an empty folder, or anything with ``overwrite``; a
    file or a folder with files in it is someone's, refused before any work. ``overwrite``
    must be a bool: ``overwrite="no"`` is truthy and replaced the folder it meant to keep."""
    check_flag(overwrite, "overwrite", "pass overwrite=True to replace an existing directory")
    if overwrite or not (directory.exists() or directory.is_symlink()):
        return
    if directory.is_dir() and not directory.is_symlink() and not any(directory.iterdir()):
        return
    kind = "folder holds files" if directory.is_dir() else "file exists"
    raise ValueError(
        f"{directory}: the {kind}; pass overwrite=True to replace it, or export to another "
        "directory"
    )


def publish(tmp: Path, directory: Path) -> Path:
    """The finished ``<name>.tmp`` becomes ``<name>``: never a half-written output."""
    if directory.is_file() or directory.is_symlink():  # an --out replaced with --overwrite
        directory.unlink()
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)
    return directory
