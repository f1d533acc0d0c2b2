"""Reading a checkpoint without running code from it.

DCP's ``FileSystemReader`` unpickles a checkpoint's ``.metadata`` with plain
``pickle.load``, and its default planner loads an entry the metadata calls bytes with
``torch.load(weights_only=False)``: a checkpoint someone hands a user could run code on
``--resume``. ``TensorOnlyReader`` unpickles the metadata with an allowlist (DCP's own
metadata dataclasses and enums, torch's sizes, dtypes and layouts, paths) and refuses
metadata with an entry that is not a tensor, which no distzo checkpoint has; the tensors
themselves DCP already reads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import os
import pickle
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from distzo.runtime.file_state import file_state

DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
FUNCTIONS = {("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}


def _allowed(module: str, name: str) -> bool:
    if module in DCP_MODULES:
        found = getattr(importlib.import_module(module), name, None)
        return isinstance(found, type) and (
            dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)
        )
    if module == "torch":
        return name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
    if module == "pathlib" or module.startswith("pathlib."):
        return name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path")
    return (module, name) in FUNCTIONS


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise pickle.UnpicklingError(
                f"it asks for {module}.{name}, which checkpoint metadata never holds"
            )
        return super().find_class(module, name)


class TensorOnlyReader(dcp.FileSystemReader):
    """A ``FileSystemReader`` whose metadata is unpickled from an allowlist and holds
    tensors only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = _MetadataUnpickler(io.BytesIO(metadata_bytes(Path(self.path)))).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP metadata")
        entries = metadata.state_dict_metadata
        if not isinstance(entries, dict):
            raise pickle.UnpicklingError(
                f"its entries are of type {type(entries).__name__}, not a dict"
            )
        for key, entry in entries.items():
            if not isinstance(entry, TensorStorageMetadata):
                raise pickle.UnpicklingError(
                    f"its entry {key!r} is not a tensor (distzo checkpoints hold tensors only)"
                )
        _check_storage(metadata.storage_data)
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


_last_read: tuple[tuple[str, int, int, int, int], bytes] | None = None  # (path, state), bytes


def metadata_bytes(checkpoint: Path) -> bytes:
    """The bytes of ``checkpoint``'s ``.metadata``, read again only where the file changed
    (another file, size or mtime): a resume's checks and load read the chosen checkpoint's
    metadata ten times on every rank, a node's eight ranks eighty opens of one shared file.
    The last file's alone is kept; each reader unpickles its own copy of it."""
    global _last_read
    path = checkpoint / ".metadata"
    if _last_read is not None and _last_read[0] == (str(path), *file_state(os.stat(path))):
        return _last_read[1]
    with path.open("rb") as stream:  # the file opened's own stat, never a replaced one's
        _last_read = ((str(path), *file_state(os.fstat(stream.fileno()))), stream.read())
    return _last_read[1]


def _check_storage(storage: Any) -> None:
    """Each stored item a byte range of a file in the checkpoint's own folder: a field of
    another type would be a traceback inside DCP's reader, and a path with ``..`` or an
    absolute one a read of a file elsewhere, which DCP opens without a question."""
    if not isinstance(storage, dict):
        raise pickle.UnpicklingError(
            f"its storage_data is of type {type(storage).__name__}, not a dict"
        )
    for info in storage.values():
        if not (
            isinstance(info, _StorageInfo)
            and isinstance(info.relative_path, str)
            and all(_count(value) for value in (info.offset, info.length))
        ):
            raise pickle.UnpicklingError(f"it places an item at {info!r}, not a file's byte range")
        path = PurePosixPath(info.relative_path.replace("\\", "/"))
        if path.is_absolute() or ".." in path.parts or not path.parts:
            raise pickle.UnpicklingError(
                f"it places an item in {info.relative_path!r}, outside the checkpoint's folder"
            )


def _count(value: Any) -> bool:
    """Whether ``value`` is a whole number >= 0 (a bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def load_tensors(state: dict[str, torch.Tensor], path: Path, **kwargs: Any) -> None:
    """``dcp.load`` of ``state`` (in place) from checkpoint ``path`` through
    ``TensorOnlyReader``."""
    dcp.load(state, storage_reader=TensorOnlyReader(str(path)), **kwargs)
