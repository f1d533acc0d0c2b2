"""The engine's state as it is stored, read back and loaded.

The trained parameters, the frozen base of an adapter run and each optimizer moment are
alike: a resident bucket and one bucket per block, with their layouts
(``StoredBuckets``). ``BucketReader`` reads any of them back through the device, where a
sliced rank sees a whole block and a low-bit master becomes the master dtype; the
state dict adds what a run needs to continue bit for bit: the step, the run seed, the
noise it was drawn with, the pending update and the momentum history.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from distzo.config.engine_checks import SEED_LIMIT
from distzo.config.engine_options import ZOConfig, lowrank_record, optimizer_record
from distzo.config.field_types import whole_number
from distzo.dist import ParallelContext
from distzo.engine.updates import PendingUpdate
from distzo.offload import BlockStore, BucketLayout, Streams
from distzo.offload.bucket import Entry
from distzo.zo import drawable, identity_kind, noise_identity

if TYPE_CHECKING:
    from distzo.engine.engine import ZOEngine

# One bucket read back: each parameter's entry and its CPU copy.
BucketValues = list[tuple[Entry, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class StoredBuckets:
    """A resident bucket and the blocks' buckets in ``store``, laid out by the layouts."""

    resident_layout: BucketLayout
    block_layouts: list[BucketLayout]
    resident: torch.Tensor
    store: BlockStore

    def entries(self) -> Iterator[Entry]:
        """Every parameter's entry in bucket order, resident first."""
        yield from self.resident_layout.entries
        for layout in self.block_layouts:
            yield from layout.entries

    @property
    def canonical_names(self) -> list[str]:
        """One name per distinct parameter (a tied weight appears once), in bucket order."""
        return [e.names[0] for e in self.entries()]

    @property
    def num_parameters(self) -> int:
        """The parameters the buckets hold (alignment gaps apart)."""
        layouts = [self.resident_layout, *self.block_layouts]
        return sum(layout.num_parameters for layout in layouts)

    def beside(self, resident: torch.Tensor, store: BlockStore) -> StoredBuckets:
        """Buckets of the same layouts in other storage: an optimizer moment of these."""
        return dataclasses.replace(self, resident=resident, store=store)

    def check_shapes(self, values: Mapping[str, torch.Tensor], what: str) -> None:
        """Refuse ``values`` (``what`` names them) where a tensor's shape is not its
        parameter's: a state of another model of the same names. Checked before ``load``
        writes anything, which would fail part-way, some buckets already overwritten."""
        for e in self.entries():
            value = values.get(e.names[0])
            if value is None:
                raise ValueError(f"{what} {e.names[0]} is missing from the state")
            shape = tuple(value.shape)
            if shape != e.shape:
                raise ValueError(
                    f"{what} {e.names[0]} has shape {shape}, the engine's model "
                    f"{e.shape}; the state is of another model: load it into one built "
                    "from the same config"
                )

    def load(self, values: Mapping[str, torch.Tensor]) -> None:
        """Values by canonical name into the resident bucket and every block."""
        for e in self.resident_layout.entries:
            self.resident[e.offset : e.offset + e.numel].copy_(values[e.names[0]].reshape(-1))
        for i, layout in enumerate(self.block_layouts):
            flat = torch.zeros(layout.numel, dtype=self.resident.dtype)
            for e in layout.entries:
                flat[e.offset : e.offset + e.numel] = values[e.names[0]].reshape(-1)
            self.store.load_block(i, flat)


class BucketReader:
    """Reads stored buckets back to the host.

    Blocks are read back through the device (an upload): that is where a sliced rank
    sees the whole block and where a low-bit master becomes the master dtype. The
    uploads run on the upload stream, joined both ways with the caller's, and every
    read-back ends with a host sync: every gather this rank took part in is complete
    before it returns, on every rank (NCCL's waits block streams, not the host).
    """

    def __init__(self, streams: Streams, parallel: ParallelContext) -> None:
        self.streams = streams
        self.parallel = parallel

    def buckets(self, stored: StoredBuckets, materialize: bool = True) -> Iterator[BucketValues]:
        """Every bucket as stored (pending update not applied), resident first, as a list
        of ``(entry, CPU copy)`` (empty where ``materialize`` is False)."""
        buckets = [(stored.resident_layout, -1)]
        buckets += [(layout, i) for i, layout in enumerate(stored.block_layouts)]
        try:
            for layout, index in buckets:
                values: BucketValues = []
                with self.streams.compute_scope(), self.streams.on("upload"):
                    if index < 0:
                        bucket = stored.resident
                    else:
                        stored.store.upload(index)
                        stored.store.unpack(index)
                        bucket = stored.store.device_bucket(index)
                    if materialize:  # to pageable host memory: the host waits for this stream
                        values = [
                            (
                                e,
                                bucket[e.offset : e.offset + e.numel]
                                .view(e.shape)
                                .to("cpu", dtype=layout.dtype, copy=True),
                            )
                            for e in layout.entries
                        ]
                yield values  # outside the stream context: the consumer runs on its own stream
        finally:
            self.parallel.comm.host_sync()

    def values(
        self, stored: StoredBuckets, materialize: bool = True
    ) -> Iterator[tuple[int, Entry, torch.Tensor]]:
        """Every parameter as stored, bucket by bucket, as ``(bucket index, entry, value)``:
        -1 for the resident modules, i for block i."""
        for index, values in enumerate(self.buckets(stored, materialize), start=-1):
            for entry, value in values:
                yield index, entry, value

    def collect(self, stored: StoredBuckets) -> dict[str, torch.Tensor]:
        """Every parameter by every alias, as CPU copies (a tied weight's aliases share one
        tensor)."""
        return {name: value for _, entry, value in self.values(stored) for name in entry.names}

    def merged(
        self, trained: StoredBuckets, frozen: StoredBuckets | None, materialize: bool = True
    ) -> Iterator[dict[str, torch.Tensor]]:
        """One dict per bucket by every alias, trained and frozen halves together (a merge
        of an adapter into its base needs both halves of a block at once)."""
        halves = self.buckets(trained, materialize)
        frozen_halves = self.buckets(frozen, materialize) if frozen is not None else iter(())
        # zip_longest drains both, so every rank takes part in every gather of either
        for pair in itertools.zip_longest(halves, frozen_halves, fillvalue=()):
            values = {name: value for half in pair for entry, value in half for name in entry.names}
            if materialize:
                yield values

    def at_rest(
        self,
        store: BlockStore,
        num_blocks: int,
        wanted: Callable[[int], bool],
        private: bool,
        sliced: bool,
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """``(i, block i exactly as stored, in its at-rest dtype)`` for every wanted block:
        a host copy when ``private`` or when ``sliced`` (gathered through the device, a
        collective, so every rank runs every block, wanted or not), else the live view.

        A host copy is read by the host (a memcpy here, or DCP's writer thread), which no
        stream orders after the offloads still landing from the last step: the host waits
        for them first. A gathered block is ordered on the device (``compute_scope``)."""
        if not sliced:
            self.streams.synchronize()
        try:
            for i in range(num_blocks):
                if not (sliced or wanted(i)):
                    continue
                value = None
                with self.streams.compute_scope(), self.streams.on("upload"):
                    at_rest = store.block_at_rest(i)
                    if wanted(i):
                        value = at_rest.to("cpu", copy=True) if private or sliced else at_rest
                if value is not None:
                    yield i, value
        finally:
            self.parallel.comm.host_sync()


def check_noise(
    config: ZOConfig, identity: str, chunk: int, source: str, lowrank: dict | None = None
) -> None:
    """A state continues its run only with the same z: the same noise kind and version
    (``noise_identity``; a state from before noise kinds is ``legacy``), for the legacy
    kind the same chunk size, and for the low-rank kind the same rank and interval
    (``lowrank``, the state's ``lowrank_record``), which its z depends on."""
    ours = noise_identity(config.noise)
    if identity != ours:
        kind = identity_kind(identity)
        fix = f"set noise {kind}" if drawable(identity) else "use the distzo version that wrote it"
        raise ValueError(
            f"{source} was trained with {identity} noise, the engine draws {ours}; {fix}"
        )
    if config.noise == "legacy" and chunk != config.noise_chunk:
        raise ValueError(
            f"{source} was trained with noise_chunk {chunk}, the engine has {config.noise_chunk}; "
            "set noise_chunk to match (legacy noise depends on it)"
        )
    ours_lowrank = lowrank_record(config)
    if ours_lowrank is not None and lowrank != ours_lowrank:
        drawn = f"rank {lowrank['rank']}, interval {lowrank['interval']}" if lowrank else "?"
        raise ValueError(
            f"{source} was trained with lowrank noise of {drawn}, the engine draws rank "
            f"{config.lozo_rank}, interval {config.lozo_interval}; set lozo_rank and "
            "lozo_interval to the run's"
        )


def state_dict(engine: ZOEngine) -> dict[str, Any]:
    """The full training state of ``engine``, pending update included (no flush: saving
    stays cheap)."""
    params = engine.reader.collect(engine.trained)
    pending = engine.pending
    return {
        "step": engine.step_index,
        "run_seed": engine.run_seed,
        "noise_chunk": engine.config.noise_chunk,
        "noise": noise_identity(engine.config.noise),
        "lowrank": lowrank_record(engine.config),
        "pending": dataclasses.asdict(pending) if pending is not None else None,
        "recent_steps": [[step, list(grads)] for step, grads in engine.recent_steps],
        "params": {name: params[name] for name in engine.canonical_names},
        "optimizer_state": _moment_values(engine),
        "optimizer": optimizer_record(engine.config),
        "lowrank_momentum": _lowrank_momentum(engine),
    }


def _lowrank_momentum(engine: ZOEngine) -> list[torch.Tensor] | None:
    """LOZO-M's state of each bucket by noise id (CPU copies), or None without it."""
    lozo_m = engine.update_rule.lowrank_momentum
    if lozo_m is None:
        return None
    with engine.streams.compute_scope():  # the updates write it on the compute stream
        return [state.to("cpu", copy=True) for state in lozo_m.states]


def _moment_values(engine: ZOEngine) -> dict[str, dict[str, torch.Tensor]]:
    """Each stored moment by torch's name for it, by canonical parameter name (CPU copies)."""
    out = {}
    for k, state_name in enumerate(engine.moments.names):
        values = {
            entry.names[0]: value
            for bucket in engine.reader.buckets(engine.moment_buckets(k))
            for entry, value in bucket
        }
        out[state_name] = {name: values[name] for name in engine.canonical_names}
    return out


# The options each optimizer's update depends on (ZO-SGD: none of them).
OPTIMIZER_FIELDS = {
    "momentum": ("beta1", "momentum_window", "state", "state_dtype"),
    "adam": ("beta1", "beta2", "adam_eps", "state_dtype"),
}


def _check_optimizer(config: ZOConfig, saved: Mapping[str, Any] | None) -> None:
    """A state continues under the optimizer that wrote it: another one, or other betas,
    would apply its pending update and history with rules they were not made by (a state
    from before the record: its moments are checked alone)."""
    if saved is None:
        return
    ours = optimizer_record(config)
    for name in ("name", *OPTIMIZER_FIELDS.get(config.optimizer, ())):
        value = ours[name]
        if saved.get(name, value) != value:
            raise ValueError(
                f"the state was trained with {'optimizer' if name == 'name' else name} "
                f"{saved[name]!r}, the engine has {value!r}; load it with the optimizer options "
                "it was trained with"
            )


# What every ``state_dict`` has held (the others came later, and have defaults).
STATE_KEYS = ("step", "run_seed", "noise_chunk", "pending", "params")


def _check_counters(state: Mapping[str, Any]) -> tuple[int, int, PendingUpdate | None]:
    """Refuse a state that is no ``state_dict`` (a bare ``KeyError`` was all a missing key
    got) or whose step or run seed no run reaches (a step of -3 was taken, and the next
    step was -2), before any bucket is written; returns its step, run seed and pending
    update, built here so that a malformed one is refused before the parameters are
    loaded too."""
    if not isinstance(state, Mapping):
        raise ValueError(f"a state is what state_dict() returned, got a {type(state).__name__}")
    missing = [key for key in STATE_KEYS if key not in state]
    if missing:
        raise ValueError(
            f"the state lacks {', '.join(missing)}: load what ZOEngine.state_dict() returned"
        )
    counters = []
    for key in ("step", "run_seed"):
        whole = whole_number(state[key])
        if whole is None or not 0 <= whole < SEED_LIMIT:
            raise ValueError(
                f"the state's {key} must be a whole number in [0, 2^63), got {state[key]!r}"
            )
        counters.append(whole)
    step, run_seed = counters
    if state["pending"] is None:
        return step, run_seed, None
    try:
        return step, run_seed, PendingUpdate(**state["pending"])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the state's pending update is malformed: {exc}") from None


def load_state_dict(engine: ZOEngine, state: Mapping[str, Any]) -> None:
    """Restore a ``state_dict`` into ``engine``; the continued trajectory equals the
    uninterrupted one."""
    step, run_seed, pending = _check_counters(state)
    check_noise(
        engine.config,
        state.get("noise", "legacy"),
        int(state["noise_chunk"]),
        "the state",
        state.get("lowrank"),
    )
    params = state["params"]
    expected = set(engine.canonical_names)
    if set(params) != expected:
        missing, extra = sorted(expected - set(params)), sorted(set(params) - expected)
        raise ValueError(
            f"state does not match the model: missing {missing[:3]}, unexpected {extra[:3]}"
        )
    _check_optimizer(engine.config, state.get("optimizer"))
    moments = state.get("optimizer_state") or {}
    names = engine.moments.names
    if set(moments) != set(names):
        raise ValueError(
            f"the state holds optimizer state {sorted(moments) or 'none'}, the engine keeps "
            f"{list(names) or 'none'}; load it with the optimizer it was trained with"
        )
    engine.trained.check_shapes(params, "the state's parameter")
    for k, name in enumerate(names):
        engine.moment_buckets(k).check_shapes(moments[name], f"the state's {name} of")
    lozo_m, factors = engine.update_rule.lowrank_momentum, state.get("lowrank_momentum")
    if (lozo_m is None) != (factors is None):
        raise ValueError(
            f"the state {'holds' if factors is not None else 'lacks'} LOZO-M's factors, the "
            f"engine {'keeps none' if lozo_m is None else 'needs them'}; load it with the "
            "optimizer it was trained with"
        )
    engine.streams.synchronize()
    with torch.no_grad():
        if lozo_m is not None and factors is not None:
            lozo_m.load(factors)
        engine.trained.load(params)
        for k, name in enumerate(names):
            engine.moment_buckets(k).load(moments[name])
    engine.restore(step, run_seed, pending, state.get("recent_steps", ()))
