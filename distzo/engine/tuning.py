"""What a step trains: every parameter (full tuning), or an adapter on a frozen base.

The two differ in what crosses the host link and what is only read. Under full tuning
the trained blocks stream and go back updated (rounded when they rest in a low-bit
format, with their moments when those travel). Under an adapter (LoRA, LoRA-FA, prefix
tuning) the frozen base streams read-only and never goes back, the adapter's buckets are
small and stay on the device, each block's base is copied into a scratch of its own once
per visit and read by every pass, and the passes of a group can share one batched
forward. The engine and its pass ask the strategy at those points instead of testing a
flag.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any, NoReturn

import torch
from torch import nn

from distzo.config.engine_options import ZOConfig
from distzo.engine.build import StoreMaker, fill_store
from distzo.engine.layouts import ModelLayouts, device_bucket
from distzo.engine.scratch import bound_scratch
from distzo.engine.state import StoredBuckets
from distzo.models.batched_linear import PassBatchedLinear, make_pass_batched
from distzo.models.prefix import BlockPrefix
from distzo.models.weights import WeightSource
from distzo.offload import BlockStore, BucketLayout, ResidentBlocks, Streams, bind
from distzo.offload.bucket import Entry
from distzo.offload.moment_stores import CarriedStore
from distzo.runtime.option_names import option_name as _n

# A store the scheduler moves: a block store, or one that carries the blocks' moments too.
Streamed = BlockStore | CarriedStore


class Tuning(ABC):
    """The strategy of a run: what its blocks' buckets hold, and what streams."""

    frozen_base: bool  # whether a frozen base sits beside the trained buckets
    # whether the trained blocks themselves cross the link (and go back updated)
    streams_trained: bool

    def __init__(self, prefixes: list[BlockPrefix]) -> None:
        self.prefixes = prefixes  # prefix tuning: every block carries its own prefix
        self.base_layouts: list[BucketLayout] = []
        self.resident_base_layout: BucketLayout | None = None
        self.base_store: BlockStore | None = None
        self.resident_base: torch.Tensor | None = None
        self.resident_base_compute: torch.Tensor | None = None
        self.base_scratch: torch.Tensor | None = None
        self.pass_scratch: torch.Tensor | None = None  # batched passes' adapters side by side
        self._trained: BlockStore | None = None  # the trained blocks' store, once made

    @abstractmethod
    def make_store(
        self, streamed: StoreMaker, layouts: list[BucketLayout], device: torch.device
    ) -> BlockStore:
        """The store of the trained blocks (``layouts``); ``streamed`` makes a store of
        blocks that cross the link."""

    @abstractmethod
    def load_base(self, weights: WeightSource | None, device: torch.device) -> None:
        """Fill what is read but never trained (a sliced rank reads only its share)."""

    @abstractmethod
    def bind_base(self, model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        """Bind the model's untrained parameters to what the passes read, in ``dtype``."""

    @abstractmethod
    def streamed(self, trained: Streamed) -> Streamed:
        """The store whose blocks cross the link, given the trained blocks' store (with
        their moments, when those travel)."""

    @abstractmethod
    def visit(self, i: int, bucket: torch.Tensor) -> torch.Tensor:
        """Block ``i`` has reached the device as ``bucket`` (the streamed store's): make it
        readable by the passes, and return the bucket of its trained parameters."""

    @property
    @abstractmethod
    def host_bytes(self) -> int:
        """The host copy of the blocks that stream."""

    @property
    @abstractmethod
    def device_bytes(self) -> int:
        """Block masters or slots on the device, and whatever the strategy adds."""

    @abstractmethod
    def batch_factors(
        self, model: nn.Module, layouts: list[BucketLayout], resident_layout: BucketLayout
    ) -> None:
        """Make the trained tensors of every block (``layouts``) take one value per pass of
        a batched forward (P-RGE), or refuse them in one line: called before any bucket is
        allocated or filled, so a refusal reads nothing of the checkpoint."""

    @abstractmethod
    def setup_batched(
        self, layouts: list[BucketLayout], largest: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        """Allocate the scratch of batched forwards of up to ``largest`` passes."""

    @abstractmethod
    def stacked(self, i: int, passes: int) -> AbstractContextManager[torch.Tensor]:
        """While it is held, block ``i`` runs ``passes`` passes in one forward, each pass's
        rows with its own trained tensors: yields the scratch rows to perturb them into."""

    @property
    def trained_store(self) -> BlockStore:
        """The trained blocks' store (``make_store`` made it)."""
        if self._trained is None:
            raise RuntimeError("the trained blocks have no store before make_store")
        return self._trained

    def rounds(self, config: ZOConfig) -> bool:
        """Whether stochastic rounding is needed: only what goes back to the host in a
        low-bit format rounds, so never a frozen base."""
        return config.rounds_on_host and self.streams_trained

    @property
    def num_frozen(self) -> int:
        """The parameters of a frozen base (0 without one)."""
        if self.resident_base_layout is None:
            return 0
        return self.resident_base_layout.num_parameters + sum(
            layout.num_parameters for layout in self.base_layouts
        )

    @property
    def frozen_buckets(self) -> StoredBuckets | None:
        """The frozen base's buckets as stored (None without one)."""
        layout, resident, store = self.resident_base_layout, self.resident_base, self.base_store
        if layout is None or resident is None or store is None:
            return None
        return StoredBuckets(layout, self.base_layouts, resident, store)

    def init_prefixes(
        self,
        forward: Callable[[Mapping[str, torch.Tensor]], Any],
        streams: Streams,
        store: BlockStore,
        layouts: list[BucketLayout],
    ) -> None:
        """MeZO's prefix init (``prefix_init_by_real_act``), when asked: each layer's prefix
        becomes the keys and values that layer computes for the prefixes' ``init_tokens``
        (random tokens drawn from the run seed) in one unperturbed pass of the model
        without a prefix."""
        if not self.prefixes or self.prefixes[0].init_tokens is None:
            return
        token_ids = self.prefixes[0].init_tokens
        for prefix in self.prefixes:
            prefix.capture = True
        forward({"input_ids": token_ids})
        # On the compute stream, which wrote the captured keys and values (they were never
        # handed to the caller's stream) and which updates the adapter's buckets.
        with torch.no_grad(), streams.compute_scope():
            for i, prefix in enumerate(self.prefixes):
                captured = prefix.take_captured()
                prefix.init_tokens = None
                (entry,) = (e for e in layouts[i].entries if ".prefix_tuning." in e.names[0])
                bucket = store.device_bucket(i)
                bucket[entry.offset : entry.offset + entry.numel].copy_(captured.reshape(-1))


class FullTuning(Tuning):
    """Every parameter is trained: the blocks stream, and go back once updated."""

    frozen_base = False
    streams_trained = True

    def make_store(
        self, streamed: StoreMaker, layouts: list[BucketLayout], device: torch.device
    ) -> BlockStore:
        self._trained = streamed(layouts, False)
        return self._trained

    def load_base(self, weights: WeightSource | None, device: torch.device) -> None:
        return  # there is no base

    def bind_base(self, model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        return

    def streamed(self, trained: Streamed) -> Streamed:
        return trained

    def visit(self, i: int, bucket: torch.Tensor) -> torch.Tensor:
        return bucket

    @property
    def host_bytes(self) -> int:
        return self.trained_store.host_bytes

    @property
    def device_bytes(self) -> int:
        return self.trained_store.device_bytes

    def batch_factors(
        self, model: nn.Module, layouts: list[BucketLayout], resident_layout: BucketLayout
    ) -> None:
        _refuse_batched()

    def setup_batched(
        self, layouts: list[BucketLayout], largest: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        _refuse_batched()

    @contextmanager
    def stacked(self, i: int, passes: int) -> Iterator[torch.Tensor]:
        _refuse_batched()
        yield torch.empty(0)  # never reached


class FrozenBase(Tuning):
    """An adapter on a frozen base: the base has buckets of its own that are only read,
    and it is what streams; the adapter's buckets stay on the device."""

    frozen_base = True
    streams_trained = False

    def __init__(
        self,
        frozen: ModelLayouts,
        layouts: list[BucketLayout],
        resident_layout: BucketLayout,
        prefixes: list[BlockPrefix],
    ) -> None:
        super().__init__(prefixes)
        base_built, (self.resident_base_layout, _) = frozen
        self.base_layouts = [layout for layout, _ in base_built]
        if not any(layout.numel for layout in [resident_layout, *layouts]):
            raise ValueError("the adapter has no trainable parameters; check its target modules")
        # The base's parameters in layout order, until load_base has packed their values.
        self._frozen: ModelLayouts | None = frozen
        self._factors: list[list[tuple[BlockPrefix | PassBatchedLinear, Entry]]] = []

    def make_store(
        self, streamed: StoreMaker, layouts: list[BucketLayout], device: torch.device
    ) -> BlockStore:
        # The base crosses the link each step, uploaded and never written back; the
        # adapter's own buckets are small and stay on the device.
        self.base_store = streamed(self.base_layouts, True)
        self._trained = ResidentBlocks(layouts, device)
        return self._trained

    def load_base(self, weights: WeightSource | None, device: torch.device) -> None:
        if self._frozen is None or self.base_store is None or self.resident_base_layout is None:
            raise RuntimeError("load_base runs once, after make_store")
        (built, (layout, ordered)), self._frozen = self._frozen, None
        fill_store(self.base_store, built, weights)
        self.resident_base = device_bucket(layout, ordered, weights, device)

    def bind_base(self, model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        if self.resident_base is None or self.resident_base_layout is None:
            raise RuntimeError("bind_base runs after load_base")
        # The frozen base of each block is copied into its own scratch once per visit, in
        # the compute dtype, and every pass reads it; the resident base never changes.
        self.base_scratch = bound_scratch(model, self.base_layouts, device, dtype)
        # the same tensor when the dtypes agree; otherwise the passes read the compute copy
        # and the master, read only by an export, waits on the host (not a second copy of
        # the embeddings and head on the device)
        self.resident_base_compute = self.resident_base.to(dtype)
        if self.resident_base_compute is not self.resident_base:
            self.resident_base = self.resident_base.to("cpu")
        bind(model, self.resident_base_layout, self.resident_base_compute)

    def streamed(self, trained: Streamed) -> Streamed:
        return self._base

    def visit(self, i: int, bucket: torch.Tensor) -> torch.Tensor:
        # the streamed bucket is the base: one copy serves every pass
        numel = self.base_layouts[i].numel
        self._scratch[:numel].copy_(bucket[:numel])
        return self.trained_store.device_bucket(i)  # the block's adapter

    @property
    def host_bytes(self) -> int:
        """The base's host copy, and the resident base's master where it waits there."""
        resident = self.resident_base
        on_host = resident is not None and resident is not self.resident_base_compute
        return self._base.host_bytes + (resident.nbytes if on_host and resident is not None else 0)

    @property
    def device_bytes(self) -> int:
        # the base's masters or slots, the adapter's buckets, the base scratch and the
        # batched passes' adapters side by side
        scratch = self._scratch
        batched = self.pass_scratch.nbytes if self.pass_scratch is not None else 0
        return (
            self._base.device_bytes
            + self.trained_store.device_bytes
            + scratch.numel() * scratch.element_size()
            + batched
        )

    def batch_factors(
        self, model: nn.Module, layouts: list[BucketLayout], resident_layout: BucketLayout
    ) -> None:
        """P-RGE's batched passes: the passes of a group share one forward, the batch
        duplicated per pass, and every trained LoRA factor computes its slice of the batch
        with that pass's perturbed weights (``PassBatchedLinear``), held side by side in
        ``pass_scratch``; the frozen base is read once for the whole group."""
        if resident_layout.entries:
            _refuse_outside_blocks(resident_layout.entries[0].names[0])
        for layout in layouts:
            factors: list[tuple[BlockPrefix | PassBatchedLinear, Entry]] = []
            for e in layout.entries:
                owner, _, attr = e.names[0].rpartition(".")
                module = model.get_submodule(owner)  # a prefix reads ``stacked`` itself
                batched = (
                    module
                    if isinstance(module, BlockPrefix)
                    else make_pass_batched(module, attr, e.names[0])
                )
                factors.append((batched, e))
            self._factors.append(factors)

    def setup_batched(
        self, layouts: list[BucketLayout], largest: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        width = max(layout.numel for layout in layouts)
        self.pass_scratch = torch.zeros(largest, width, device=device, dtype=dtype)

    @contextmanager
    def stacked(self, i: int, passes: int) -> Iterator[torch.Tensor]:
        rows = self._pass_rows
        factors = self._factors[i]
        for module, e in factors:
            module.stacked = rows[:passes, e.offset : e.offset + e.numel].unflatten(1, e.shape)
        try:
            yield rows[:passes]
        finally:  # a forward that failed half-way leaves no factor reading the passes' rows
            for module, _ in factors:
                module.stacked = None

    @property
    def _base(self) -> BlockStore:
        if self.base_store is None:
            raise RuntimeError("the frozen base has no store before make_store")
        return self.base_store

    @property
    def _scratch(self) -> torch.Tensor:
        if self.base_scratch is None:
            raise RuntimeError("the frozen base has no scratch before bind_base")
        return self.base_scratch

    @property
    def _pass_rows(self) -> torch.Tensor:
        if self.pass_scratch is None:
            raise RuntimeError("batched passes run only after setup_batched")
        return self.pass_scratch


def make_tuning(
    frozen: ModelLayouts | None,
    layouts: list[BucketLayout],
    resident_layout: BucketLayout,
    prefixes: list[BlockPrefix],
) -> Tuning:
    """The strategy of a model whose trained buckets have ``layouts`` (blocks) and
    ``resident_layout``: a frozen base when ``split_layouts`` found one."""
    if frozen is None:
        return FullTuning(prefixes)
    return FrozenBase(frozen, layouts, resident_layout, prefixes)


def _refuse_outside_blocks(name: str) -> NoReturn:
    """A batched forward gives each pass its own weights inside the blocks only."""
    both = f"{_n('dual_forward')} and {_n('batch_queries')}"
    raise ValueError(
        f"{both} batch the adapter inside the blocks, but {name} is trained outside them; "
        f"leave its module out of {_n('lora_targets', python='target_modules')}, or "
        f"drop {both}"
    )


def _refuse_batched() -> NoReturn:
    raise ValueError(
        f"{_n('dual_forward')} and {_n('batch_queries')} need an adapter that trains only "
        f"inside the blocks ({_n('peft', python='peft:')} lora, lora-fa or prefix); drop "
        "them for full tuning"
    )
