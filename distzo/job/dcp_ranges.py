"""Reading element ranges of a 1-D tensor out of a DCP checkpoint, and only those bytes.

A sliced rank holds 1/n of every block, but a checkpoint stores each block whole (one
chunk, written by one rank). Asking DCP for a narrower chunk (``RangePlanner``, a load
planner whose local chunks are the ranges) is not enough: ``FileSystemReader`` reads
every stored item whole (``torch.load`` of its bytes) and narrows it afterwards, so each
rank would still read the whole model. ``RangeReader`` reads an item's ranges in place:
DCP stores a tensor as a ``torch.save`` archive, whose one storage record is kept
uncompressed, so a range is a byte range at the offset torch's own archive reader gives
(``PyTorchFileReader.get_record_offset``). Items it cannot place that way (a transformed
stream, another layout) take DCP's own path. Checkpoints need no new format: every one
written so far reads this way.
"""

from __future__ import annotations

import io
import sys
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

from distzo.job.dcp_safe import TensorOnlyReader

Range = tuple[int, int]


class _Window(io.RawIOBase):
    """Bytes ``[start, start + length)`` of a seekable stream as a file of their own, for
    ``zipfile``, which reads to the end with ``read()`` (DCP's own file view passes the -1
    on as a negative length)."""

    def __init__(self, stream: IO[bytes], start: int, length: int) -> None:
        super().__init__()
        self.stream, self.start, self.length, self.pos = stream, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        want = min(len(buffer), self.length - self.pos)
        if want <= 0:
            return 0
        self.stream.seek(self.start + self.pos)
        data = self.stream.read(want)
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _stored_size(archive: io.RawIOBase, record: str) -> int | None:
    """The byte length of ``record`` in a ``torch.save`` zip, None if it is compressed.

    Read from the zip's central directory: ``PyTorchFileReader.get_record_size`` exists
    only in recent torch (2.11 lacks it), and reading the record itself would read it all."""
    with zipfile.ZipFile(archive) as names:
        for entry in names.infolist():
            if entry.filename.split("/", 1)[-1] == record:
                return entry.file_size if entry.compress_type == zipfile.ZIP_STORED else None
    return None


class RangePlanner(dcp.DefaultLoadPlanner):
    """Loads elements ``[lo, hi)`` of 1-D saved tensors, each range into a tensor of its
    own (``values[key][range]``): DCP's resharding reads what these local chunks overlap
    of whatever chunks were saved."""

    def __init__(self, ranges: Mapping[str, Sequence[Range]]) -> None:
        super().__init__()
        self.ranges = {key: [r for r in wanted if r[1] > r[0]] for key, wanted in ranges.items()}
        self.values: dict[str, dict[Range, torch.Tensor]] = {}

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items: list[ReadItem] = []
        for key, wanted in self.ranges.items():
            saved = self.metadata.state_dict_metadata[key]
            assert isinstance(saved, TensorStorageMetadata) and len(saved.size) == 1, key
            self.values[key] = {
                (lo, hi): torch.empty(hi - lo, dtype=saved.properties.dtype) for lo, hi in wanted
            }
            chunks = [
                ChunkStorageMetadata(offsets=torch.Size([lo]), sizes=torch.Size([hi - lo]))
                for lo, hi in wanted
            ]
            items += create_read_items_for_chunk_list(key, saved, chunks)
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        index = read_item.dest_index
        assert index.index is not None and index.offset is not None
        lo, hi = self.ranges[index.fqn][index.index]
        assert index.offset[0] == lo, (index, lo)
        dest = self.values[index.fqn][(lo, hi)]
        return dest.narrow(0, read_item.dest_offsets[0], read_item.lengths[0])


class RangeReader(TensorOnlyReader):
    """DCP's file reader, reading of each stored tensor only the bytes of the elements
    a read item asks for (see the module's docstring); the rest as DCP does."""

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.metadata = metadata

    def _saved_chunk(self, index: MetadataIndex) -> ChunkStorageMetadata:
        saved = self.metadata.state_dict_metadata[index.fqn]
        assert isinstance(saved, TensorStorageMetadata)
        if index.index is not None and index.index < len(saved.chunks):
            chunk = saved.chunks[index.index]
            if chunk.offsets == index.offset:
                return chunk
        return next(c for c in saved.chunks if c.offsets == index.offset)

    def _data_start(self, stream, index: MetadataIndex) -> int | None:
        """Where the raw elements of stored item ``index`` start in its file; None unless it
        is one uncompressed storage holding exactly the saved chunk, in this byte order."""
        info = self.storage_data[index]
        if info.transform_descriptors:
            return None
        chunk = self._saved_chunk(index)
        saved = self.metadata.state_dict_metadata[index.fqn]
        assert isinstance(saved, TensorStorageMetadata)
        if len(chunk.sizes) != 1:
            return None
        archive = torch._C.PyTorchFileReader(self._slice_file(stream, info))
        records = archive.get_all_records()
        storages = [r for r in records if r.startswith("data/")]
        itemsize = torch.empty(0, dtype=saved.properties.dtype).element_size()
        if (
            storages != ["data/0"]
            or _stored_size(_Window(stream, info.offset, info.length), "data/0")
            != chunk.sizes[0] * itemsize
            or "byteorder" not in records
            or bytes(archive.get_record("byteorder")).decode() != sys.byteorder
        ):
            return None
        # not in torch's stubs; torch.load(mmap=True) finds storages with it
        return info.offset + archive.get_record_offset("data/0")  # type: ignore[attr-defined]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, dict[MetadataIndex, list[ReadItem]]] = {}
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:
                continue
            path = self.storage_data[item.storage_index].relative_path
            by_file.setdefault(path, {}).setdefault(item.storage_index, []).append(item)
        others = [item for item in plan.items if item.type != LoadItemType.TENSOR]
        for path, stored in by_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, path), "rb") as stream:
                for index, items in stored.items():
                    start = self._data_start(stream, index)
                    if start is None:
                        others += items
                        continue
                    for item in items:
                        self._read_range(stream, start, item, planner)
        if others:
            return super().read_data(LoadPlan(others), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_range(self, stream, start: int, item: ReadItem, planner: LoadPlanner) -> None:
        saved = self.metadata.state_dict_metadata[item.storage_index.fqn]
        assert isinstance(saved, TensorStorageMetadata)
        dtype = saved.properties.dtype
        itemsize = torch.empty(0, dtype=dtype).element_size()
        buffer = bytearray(item.lengths[0] * itemsize)
        stream.seek(start + item.storage_offsets[0] * itemsize)
        if stream.readinto(buffer) != len(buffer):
            raise OSError(f"{self.path}: {item.storage_index.fqn} is truncated")
        target = planner.resolve_tensor(item).detach()
        target.copy_(torch.frombuffer(buffer, dtype=dtype))
        planner.commit_tensor(item, target)


def load_ranges(
    path: Path, ranges: Mapping[str, Sequence[Range]], process_group=None
) -> dict[str, dict[Range, torch.Tensor]]:
    """``{key: {(lo, hi): elements lo..hi-1 of saved 1-D tensor key}}``, reading only those
    (collective over ``process_group`` as ``dcp.load``; empty ranges are left out)."""
    planner = RangePlanner(ranges)
    dcp.load(
        {}, storage_reader=RangeReader(str(path)), planner=planner, process_group=process_group
    )
    return planner.values
