"""The read-backs: what the engine's stored buckets hold, read out for an export, a
checkpoint or a caller, each after a flush so that it sees the trained values.

A mixin of ``ZOEngine``: the step and its passes are the engine's concern, reading its
state out is this one's, on the same parts (``trained``, ``tuning``, ``moments``, the
``BucketReader``). Collective under the sliced transfer, where each block is gathered
through the device: every rank calls (and drains) them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from distzo.engine.state import BucketReader, StoredBuckets
from distzo.engine.tuning import Tuning
from distzo.offload import BlockStore
from distzo.offload.moment_stores import Moments


class ReadBacks:
    """``named_parameters``, ``stream_parameters``, ``stream_buckets``, ``blocks_at_rest``
    and ``moment_buckets`` of an engine, which provides the parts named here."""

    reader: BucketReader
    trained: StoredBuckets
    tuning: Tuning
    moments: Moments
    store: BlockStore
    blocks: list[torch.nn.Module]
    transfer: str
    flush: Callable[[], None]

    @property
    def state_sliced(self) -> bool:
        """Whether the trained state is split over the node's ranks (the sliced transfer of
        whole blocks); an adapter's state is small and whole on every rank."""
        return self.transfer == "sliced" and self.tuning.streams_trained

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """Flushed values by Hugging Face name (aliases of tied weights included), as CPU
        copies in the master dtype."""
        self.flush()
        return self.reader.collect(self.trained)

    def stream_parameters(
        self, materialize: bool = True, frozen: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Flushed values, one bucket at a time, as ``(canonical name, CPU tensor)`` with
        storage of their own: an export holds one block, never the model twice.
        ``frozen``: the frozen base of an adapter run instead of the trained parameters.
        A rank with ``materialize=False`` takes part in the gathers but copies nothing to
        the host and yields nothing.
        """
        self.flush()
        stored = self.tuning.frozen_buckets if frozen else self.trained
        if stored is None:
            raise ValueError("frozen=True reads the frozen base of an adapter run; there is none")
        for _, entry, value in self.reader.values(stored, materialize):
            yield entry.names[0], value

    def stream_buckets(self, materialize: bool = True) -> Iterator[dict[str, torch.Tensor]]:
        """Flushed values, resident modules first, then block by block, as one dict per
        bucket by every alias, frozen base and adapter together (a merge of an adapter
        into its base needs both halves of a block at once)."""
        self.flush()
        yield from self.reader.merged(self.trained, self.tuning.frozen_buckets, materialize)

    def blocks_at_rest(
        self, wanted: Callable[[int], bool], private: bool, moment: int | None = None
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """``(i, block i exactly as stored, in its at-rest dtype)`` for every block with
        ``wanted(i)`` (``moment``: that optimizer moment of the block): what a checkpoint
        holds (``BucketReader.at_rest``)."""
        store = self.store if moment is None else self.moments.blocks[moment]
        return self.reader.at_rest(store, len(self.blocks), wanted, private, self.state_sliced)

    def moment_buckets(self, k: int) -> StoredBuckets:
        """Optimizer moment ``k`` of every trained bucket, laid out as the bucket."""
        return self.trained.beside(self.moments.resident[k], self.moments.blocks[k])
