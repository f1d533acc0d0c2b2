"""Resumable training state with torch.distributed.checkpoint (the export is
``distzo.export.hf_model``).

A checkpoint holds tensors only (never pickles), and is read so (``dcp_safe``: a
checkpoint's metadata is unpickled from an allowlist): ``meta/*`` scalars (step, run seed,
noise chunk, the pending update, the optimizer), the resident bucket, every block in its
at-rest format (the transfer dtype) and a stored optimizer's moments beside them
(``<moment>/resident``, ``<moment>/block/i``, in the state dtype), so that a resumed run,
on any number of ranks and with either transfer mode, continues the exact trajectory.
Every block is contributed by one rank (round robin), as a private CPU copy: the save
holds one extra copy of the model across the whole job, never one per rank (nor, under
the sliced transfer, one per node: the blocks are spread over the nodes). Under the
sliced transfer a block is first gathered through the device, since a rank holds only
its slices; on resume a rank reads only the ranges of each block it holds
(``dcp_ranges``).

Saving is asynchronous (the copies are made at once, a thread writes them) into
``step-N.tmp/``, renamed to ``step-N/`` once every rank's data and the metadata are on
disk: a crash mid-save leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import AsyncStager

from distzo.config.engine_checks import OPTIMIZERS
from distzo.config.engine_options import ZOConfig, lowrank_record
from distzo.config.field_types import whole_number
from distzo.dist.collectives import host_barrier, initialized, world_rank
from distzo.engine import PendingUpdate, ZOEngine
from distzo.job.dcp_ranges import load_ranges
from distzo.job.dcp_safe import TensorOnlyReader, load_tensors
from distzo.offload import StreamedBlocks
from distzo.runtime.argument_values import check_flag, type_and_repr
from distzo.zo import NOISE_KINDS, NOISE_VERSION, identity_kind

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")
# DCP's note at every save and load in a process without torch.distributed (a one-rank
# run, which is meant): silenced, and no other warning.
_SINGLE_PROCESS_NOTE = r"torch\.distributed is disabled, unavailable or uninitialized"


@contextlib.contextmanager
def _without_single_process_note() -> Iterator[None]:
    """Calls into DCP with its single-process note ignored (also a decorator)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_NOTE, category=UserWarning)
        yield


# Every asynchronous save's future, while anything holds it (its writer thread does until
# it ends): what ``saves_being_written`` asks.
_ASYNC_SAVES: weakref.WeakSet[Future] = weakref.WeakSet()


def saves_being_written() -> frozenset[Future]:
    """The asynchronous saves a writer thread of this process is still writing (empty,
    false, when none): ones left behind by a second Ctrl-C, which no ``Checkpointer`` will
    complete."""
    return frozenset(future for future in _ASYNC_SAVES if not future.done())


def _complete(directory: Path) -> list[tuple[int, Path]]:
    """``(steps, path)`` of every completed checkpoint (``*.tmp`` ones never count)."""
    if not directory.is_dir():
        return []
    return [
        (int(m.group(1)), p)
        for p in directory.iterdir()
        if (m := _STEP_DIR.match(p.name)) and p.is_dir()
    ]


def latest_checkpoint(directory: str | Path, most_steps: int | None = None) -> Path | None:
    """The completed checkpoint with the highest step (of at most ``most_steps`` steps)."""
    complete = _complete(Path(directory))
    steps = [(n, p) for n, p in complete if most_steps is None or n <= most_steps]
    return max(steps)[1] if steps else None


def _steps_of(path: Path) -> int:
    """The steps a checkpoint ``step-N`` (or its ``step-N.tmp``) holds: N."""
    return int(path.name.removeprefix("step-").removesuffix(".tmp"))


def checkpoint_damage(path: Path) -> str | None:
    """What makes checkpoint ``path`` unloadable, named by its file (no ``.metadata``: the
    save never finished; a ``.distcp`` shorter than the entries its metadata places in it:
    truncated); None for a complete one. Sizes only: nothing is read but the metadata."""
    metadata = path / ".metadata"
    if not metadata.is_file():
        return f"{metadata} is missing (the save did not finish)"
    try:
        storage = TensorOnlyReader(str(path)).read_metadata().storage_data
    except Exception as err:  # pickle, EOF or DCP errors: a damaged file, whichever
        return f"{metadata} is unreadable ({(str(err) or type(err).__name__).splitlines()[0]})"
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    for name, end in sorted(needed.items()):
        file = path / name
        size = file.stat().st_size if file.is_file() else None
        if size is None:
            return f"{file} is missing"
        if size < end:
            return f"{file} is truncated ({size} of {end} bytes)"
    return None


def check_complete(path: Path) -> None:
    """Refuse a damaged checkpoint in one line naming the file, and offer the previous
    complete one (or the seed log alone): a resume must not die inside DCP's reader."""
    damage = checkpoint_damage(path)
    if damage is None:
        return
    earlier = sorted(
        (
            (int(m.group(1)), p)
            for p in path.parent.iterdir()
            if (m := _STEP_DIR.match(p.name)) and p.is_dir() and p != path
        ),
        reverse=True,
    )
    step = int(m.group(1)) if (m := _STEP_DIR.match(path.name)) else None
    previous = next(
        (p for n, p in earlier if (step is None or n < step) and checkpoint_damage(p) is None), None
    )
    offer = (
        f"the previous complete checkpoint is {previous}: move {path} aside to resume from it"
        if previous is not None
        else f"no earlier checkpoint is complete: move {path} aside to resume from the seed log"
    )
    raise ValueError(f"checkpoint {path} is damaged: {damage}; {offer}")


def _pending_vector(pending: PendingUpdate | None) -> torch.Tensor:
    """``[has, step, g_0, lr, g_1, ..., g_{q-1}]``: the one-query layout, extended by the
    other queries' g, so that single-query checkpoints keep their format."""
    if pending is None:
        return torch.zeros(4, dtype=torch.float64)
    first, *rest = pending.projected_grads
    return torch.tensor([1.0, pending.step, first, pending.lr, *rest], dtype=torch.float64)


def _pending_update(vector: torch.Tensor) -> PendingUpdate | None:
    has, step, first, lr, *rest = vector.tolist()
    return PendingUpdate(int(step), (first, *rest), lr) if has else None


def _recent_vector(recent: tuple[tuple[int, tuple[float, ...]], ...]) -> torch.Tensor:
    """A momentum's recent steps, ``[count, queries, (step, g_0 .. g_{q-1}) x count]``."""
    queries = len(recent[0][1]) if recent else 0
    flat = [v for step, grads in recent for v in (step, *grads)]
    return torch.tensor([len(recent), queries, *flat], dtype=torch.float64)


def _recent_steps(vector: torch.Tensor) -> tuple[tuple[int, tuple[float, ...]], ...]:
    count, queries, *flat = vector.tolist()
    width = 1 + int(queries)
    return tuple(
        (int(flat[i * width]), tuple(flat[i * width + 1 : (i + 1) * width]))
        for i in range(int(count))
    )


def _noise_vector(kind: str) -> torch.Tensor:
    """The noise a checkpoint was drawn with: [kind index, version] (legacy: version 0)."""
    return torch.tensor(
        [NOISE_KINDS.index(kind), 0 if kind == "legacy" else NOISE_VERSION], dtype=torch.int64
    )


def _noise_identity(vector: torch.Tensor) -> str:
    index, version = (int(v) for v in vector.tolist())
    kind = NOISE_KINDS[index] if 0 <= index < len(NOISE_KINDS) else f"kind {index}"
    return kind if version == 0 else f"{kind}-v{version}"


def _lowrank_vector(config: ZOConfig) -> torch.Tensor:
    """[rank, interval] of low-rank noise (``lowrank_record``), [0, 0] for the other kinds."""
    record = lowrank_record(config) or {"rank": 0, "interval": 0}
    return torch.tensor([record["rank"], record["interval"]], dtype=torch.int64)


def _lowrank_of(vector: torch.Tensor) -> dict | None:
    rank, interval = (int(v) for v in vector.tolist())
    return {"rank": rank, "interval": interval} if rank else None


# The checkpoint's keys of LOZO-M's factors: ``lozo_momentum/<noise id>``.
LOWRANK_MOMENTUM = "lozo_momentum"

# The options the optimizer vector holds after [optimizer index, moments stored], in order
# (a checkpoint from before momentum_window was recorded holds the first three).
_OPTIMIZER_OPTIONS = ("beta1", "beta2", "adam_eps", "momentum_window")


def _optimizer_vector(engine: ZOEngine) -> torch.Tensor:
    """[optimizer index, moments stored, beta1, beta2, adam eps, momentum window]: what a
    resumed run checks."""
    cfg = engine.config
    options = [float(getattr(cfg, name)) for name in _OPTIMIZER_OPTIONS]
    return torch.tensor(
        [OPTIMIZERS.index(cfg.optimizer), _state_code(cfg), *options], dtype=torch.float64
    )


# The "moments stored" entry of LOZO-M, whose state is the factors, no moment buckets.
LOWRANK_STATE = -1


def _state_code(config: ZOConfig) -> int:
    """The optimizer vector's state entry: the moment buckets stored, or ``LOWRANK_STATE``."""
    return LOWRANK_STATE if config.lowrank_state else config.num_moments


def _optimizer_of(vector: torch.Tensor) -> tuple[str, int, dict[str, float]]:
    """The optimizer, its moment count and the options the vector records."""
    index, moments, *options = vector.tolist()
    return OPTIMIZERS[int(index)], int(moments), dict(zip(_OPTIMIZER_OPTIONS, options))


def _update_options(config: ZOConfig) -> tuple[str, ...]:
    """The recorded options the optimizer's update depends on (ZO-SGD: none; the window only
    where the momentum is regenerated from it)."""
    if config.optimizer == "adam":
        return ("beta1", "beta2", "adam_eps")
    if config.optimizer == "momentum":
        stateful = config.stored_state or config.lowrank_state
        return ("beta1",) if stateful else ("beta1", "momentum_window")
    return ()


def _check_update_options(path: Path, config: ZOConfig, saved: Mapping[str, float]) -> None:
    """The moments and the momentum history of a checkpoint go on under the betas, Adam's
    eps and the window that made them: another value would apply them by another rule."""
    for name in _update_options(config):
        ours = float(getattr(config, name))
        if name in saved and saved[name] != ours:
            flag, show = name.replace("_", "-"), int if name == "momentum_window" else float
            raise ValueError(
                f"{path} was trained with --{flag} {show(saved[name])}, this run has --{flag} "
                f"{show(ours)}; resume with the optimizer options it was trained with"
            )


def _meta(engine: ZOEngine) -> dict[str, torch.Tensor]:
    return {
        "meta/step": torch.tensor([engine.step_index], dtype=torch.int64),
        "meta/run_seed": torch.tensor([engine.run_seed], dtype=torch.int64),
        "meta/noise_chunk": torch.tensor([engine.config.noise_chunk], dtype=torch.int64),
        "meta/noise": _noise_vector(engine.config.noise),
        "meta/lowrank": _lowrank_vector(engine.config),
        "meta/pending": _pending_vector(engine.pending),
        "meta/recent_steps": _recent_vector(engine.recent_steps),
        "meta/optimizer": _optimizer_vector(engine),
    }


@_without_single_process_note()
def checkpoint_noise(path: Path) -> str:
    """The noise kind a checkpoint was drawn with (a checkpoint from before noise kinds: legacy),
    read on the host without a process group, so a resumed run can pick it before building."""
    check_complete(path)
    saved = TensorOnlyReader(str(path)).read_metadata().state_dict_metadata
    if "meta/noise" not in saved:
        return "legacy"
    meta = {"meta/noise": torch.zeros(2, dtype=torch.int64)}
    load_tensors(meta, path, no_dist=True)
    return identity_kind(_noise_identity(meta["meta/noise"]))


def _saved_size(saved: Mapping[str, Any], key: str) -> torch.Size:
    """The shape a checkpoint holds under ``key`` (every entry is a tensor: never pickles)."""
    entry = saved[key]
    assert isinstance(entry, TensorStorageMetadata), key
    return entry.size


def own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` over a storage of exactly its bytes, sharing its memory (the storage's
    slice keeps the whole alive). DCP's writer clones a tensor whose storage is larger
    (a block's view of its padded host copy) and holds every clone until the rank's file
    is written: a synchronous save would copy every block it writes, which the memory
    plan counts as read in place."""
    storage = tensor.untyped_storage()
    exact = storage.nbytes() == tensor.nbytes
    if exact or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return tensor  # a device tensor is copied to the host anyway (planned)
    start = tensor.storage_offset() * tensor.element_size()
    own = storage[start : start + tensor.nbytes]
    return torch.empty(0, dtype=tensor.dtype).set_(own, 0, tensor.shape, tensor.stride())


class PrivateCopies(AsyncStager):
    """Staging for a state that is already made of copies no one else writes to."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        """Nothing to wait for: staging copies nothing."""

    def close(self) -> None:
        """Nothing held."""


class HostStateWriter(dcp.FileSystemWriter):
    """DCP's file writer for a state that is on the host already, on the rank's device.

    DCP writes an asynchronous save from a thread of its own, whose CUDA device is 0
    whatever the rank's; with CUDA available its default loader copies ahead from the
    device on that thread's current stream, opening a context on GPU 0 on every rank of
    the node. Nothing here is on a device (``per_thread_copy_ahead=0``: the plain loader,
    as DCP's own stager sets it), and the thread is put on the rank's device before DCP
    does anything in it (``reset`` is its first call there), so nothing else can either.
    """

    def __init__(self, path: Path, device: torch.device) -> None:
        super().__init__(str(path), per_thread_copy_ahead=0)
        self.device = torch.device(device)

    def _on_rank_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def reset(self, checkpoint_id=None) -> None:
        self._on_rank_device()
        super().reset(checkpoint_id)

    def write_data(self, plan, planner):
        """DCP's write; a full disk raised as the ``OSError`` it is (torch.save's zip writer
        reports a failed write as a ``RuntimeError``, "unexpected pos", the ``OSError`` only
        its context, which the exception's way to rank 0 would drop)."""
        self._on_rank_device()
        try:
            return super().write_data(plan, planner)
        except RuntimeError as err:
            cause = _os_error_behind(err)
            if cause is None:
                raise
            raise OSError(cause.errno, cause.strerror, cause.filename) from err


def _os_error_behind(err: BaseException | None) -> OSError | None:
    """The ``OSError`` that ``err`` is or was raised while handling (its cause or context)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


@contextlib.contextmanager
def _write_failure(tmp: Path) -> Iterator[None]:
    """A save that failed to write (a full disk): its ``step-N.tmp`` removed (it never
    counts, and its bytes are what the disk lacks) and DCP's ``CheckpointException``, which
    is no ``Exception``, turned back into the ``OSError`` a rank hit, naming the folder."""
    try:
        yield
    except (OSError, CheckpointException) as err:
        if world_rank()[0] == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        failures = err.failures.values() if isinstance(err, CheckpointException) else ()
        cause = next((c for e, _ in failures if (c := _os_error_behind(e)) is not None), None)
        if cause is None:
            raise
        raise OSError(cause.errno, cause.strerror, cause.filename or str(tmp)) from err


def prune_checkpoints(directory: Path, keep: int, confirmed: int | None = None) -> list[Path]:
    """Delete complete checkpoints beyond the ``keep`` newest, oldest first (``keep`` 0:
    keep all). Only complete ``step-N`` directories count: a save in flight is a
    ``.tmp`` one, and the latest complete checkpoint is always among those kept.
    ``confirmed``: only checkpoints of that many steps or fewer count (and go); a newer
    one, whose last update no finite loss has measured yet, is kept besides."""
    if keep <= 0 or not directory.is_dir():
        return []
    steps = sorted((n, p) for n, p in _complete(directory) if confirmed is None or n <= confirmed)
    doomed = [p for _, p in steps[: max(len(steps) - keep, 0)]]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def _stale_saves(directory: Path) -> list[Path]:
    """Delete the ``step-N.tmp`` folders of saves a dead process left behind (killed mid
    save); called once a save completes, when no other save is in flight (one is at a
    time), so that a resumed run whose saves fall on other steps does not keep them, each
    as large as a checkpoint, for ever."""
    stale = sorted(directory.glob("step-*.tmp"))
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


class Checkpointer:
    def __init__(self, directory: str | Path, engine: ZOEngine, keep: int = 0) -> None:
        count = whole_number(keep)
        if count is None or count < 0:
            # a float or a string failed at the first prune, after a save's work; -1 kept all
            raise TypeError(
                f"keep must be a whole number >= 0, got {type_and_repr(keep)}: the complete "
                "checkpoints kept on disk, the newest first (0 keeps all)"
            )
        self.directory = Path(directory)
        self.engine = engine
        self.keep = count  # complete checkpoints kept on disk (0: all)
        # The most steps of a checkpoint whose last update a finite loss has measured
        # (``confirm``): only those count towards ``keep``, so that a divergence right after
        # a save, which drops that save, still finds the one before it on disk.
        self.confirmed = -1
        self._prune_due = True  # a checkpoint on disk may be newer than ``confirmed``
        # Called by rank 0 before a complete checkpoint is renamed into place: the trainer
        # syncs the seed log there, so that no checkpoint on disk holds a step the log on
        # disk lacks (after a power loss, a resume refuses a checkpoint ahead of its log).
        self.before_publish: Callable[[], None] | None = None
        self._pending_save: tuple[Future, Path, Path] | None = None
        # the steps of the checkpoint ``load`` restored: the engine holds its state until it
        # steps on (or catches up from the seed log)
        self.loaded_step: int | None = None
        # An asynchronous save's thread warns after ``dcp.async_save`` returns: in a single
        # process the note stays ignored until the save is waited for.
        self._quiet = contextlib.ExitStack()
        # DCP's asynchronous writer runs collectives from a thread: give it its own gloo
        # group, so it never interleaves with the training's collectives (or needs NCCL).
        self._group = engine.parallel.comm.new_host_group()

    def _state(self, private: bool = True) -> dict[str, torch.Tensor]:
        """This rank's contribution. ``private``: CPU copies, so training may go on while
        a thread writes them; otherwise the live host memory itself wherever the data
        already rests there (a synchronous save, which training waits for, needs no copy).

        Each block is written by exactly one rank, so the copies add up to one model
        across the job instead of one per rank: block i comes from rank i % world, or
        under the sliced transfer (where a rank holds only slices) from node i % nodes,
        member (i // nodes) % n of its shard group, after a gather through the device
        into a slot that the next block reuses (so always copied). Rank 0 adds the
        resident bucket; the meta scalars are replicated (DCP keeps one copy).
        """
        engine = self.engine
        rank, world = world_rank()
        sliced = engine.state_sliced

        def contribution(tensor: torch.Tensor, copy: bool) -> torch.Tensor:
            return tensor.to("cpu", copy=True) if copy else tensor.to("cpu")

        state = _meta(engine)
        if rank == 0:
            with (
                engine.streams.compute_scope()
            ):  # the resident bucket was last written on the compute stream
                state["resident"] = contribution(engine.resident_master, private)
                for name, moment in zip(engine.moments.names, engine.moments.resident):
                    state[f"{name}/resident"] = contribution(moment, private)
                lozo_m = engine.update_rule.lowrank_momentum
                for block_id, factors in enumerate(lozo_m.states if lozo_m else ()):
                    # whole on every rank: rank 0 writes them
                    state[f"{LOWRANK_MOMENTUM}/{block_id}"] = contribution(factors, private)
        shard = engine.parallel.shard_group

        def mine(i: int) -> bool:
            if not sliced:
                return i % world == rank
            # Every node holds the whole model: block i from node i % nodes, spreading the
            # copies over the nodes, and there from member (i // nodes) % n.
            assert shard is not None  # a sliced transfer moves blocks within the node's group
            nodes = world // shard.size
            return (
                i % nodes == engine.parallel.env.node_rank
                and (i // nodes) % shard.size == shard.rank
            )

        for i, block in engine.blocks_at_rest(mine, private):
            state[f"block/{i}"] = own_storage(block)
        for k, name in enumerate(engine.moments.names):
            for i, block in engine.blocks_at_rest(mine, private, moment=k):
                state[f"{name}/block/{i}"] = own_storage(block)
        return state

    def save(self, asynchronous: bool = False) -> None:
        """Checkpoint the engine's current state as ``step-<step>``; at most one save in flight.
        ``asynchronous``: written by a thread while training goes on, and complete (renamed
        into place) once ``poll`` finds it done or ``wait`` is called."""
        check_flag(
            asynchronous,
            "asynchronous",
            "True writes it from a thread while training goes on, False before returning",
        )
        self.wait()
        step = self.engine.step_index
        final = self.directory / f"step-{step}"
        tmp = self.directory / f"step-{step}.tmp"
        rank, _ = world_rank()
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        host_barrier(self._group)
        state = self._state(private=asynchronous)
        if asynchronous:
            # The state is already private copies: DCP's default stager would copy it again.
            if not initialized():
                self._quiet.enter_context(_without_single_process_note())
            with _write_failure(tmp):
                future = dcp.async_save(
                    state,
                    checkpoint_id=str(tmp),
                    storage_writer=HostStateWriter(tmp, self.engine.device),
                    process_group=self._group,
                    async_stager=PrivateCopies(),
                )
            # A stager that returns the state itself (no future) gets the upload's future.
            assert isinstance(future, Future)
            _ASYNC_SAVES.add(future)
            self._pending_save = (future, tmp, final)
        else:
            with _write_failure(tmp), _without_single_process_note():
                dcp.save(
                    state,
                    checkpoint_id=str(tmp),
                    storage_writer=HostStateWriter(tmp, self.engine.device),
                    process_group=self._group,
                )
            self._finalize(tmp, final)

    def poll(self) -> None:
        """Finish a completed background save (cheap; call once per step)."""
        if self._pending_save is not None and self._pending_save[0].done():
            self.wait()

    def wait(self) -> None:
        """Complete the save in flight, if any (its errors raised here). Unbounded: a rank's
        writer only writes, and its collectives run on a group with the job's timeout, so
        a peer that died ends the wait; a bound of its own would give up (and delete) a
        save a slow disk was completing, and the process would wait for the thread at exit
        all the same."""
        if self._pending_save is None:
            self._quiet.close()  # an asynchronous save that failed to start
            return
        future, tmp, final = self._pending_save
        self._pending_save = None
        with _write_failure(tmp), self._quiet:
            future.result()
        self._finalize(tmp, final)

    @property
    def in_flight(self) -> bool:
        """Whether an asynchronous save is still to be completed."""
        return self._pending_save is not None

    def discard_after(self, steps: int) -> list[Path]:
        """Drop every checkpoint of more than ``steps`` steps (a diverged run's, which holds
        the update that led to the non-finite loss): a save of one in flight is completed
        but never renamed into place (nor does it prune an older one), complete ones are
        deleted by rank 0; a save in flight of ``steps`` or fewer is completed. Every rank
        returns once the directory holds only what is kept; rank 0 returns the checkpoints
        dropped (by their final names), the others nothing."""
        rank0, dropped = world_rank()[0] == 0, []
        if self._pending_save is not None and _steps_of(self._pending_save[2]) > steps:
            future, tmp, final = self._pending_save
            self._pending_save = None
            with _write_failure(tmp):
                future.result()  # every rank's share written: no writer is left behind
            if rank0:
                shutil.rmtree(tmp, ignore_errors=True)
                dropped.append(final)
        self.wait()
        if rank0:
            complete = sorted(p for n, p in _complete(self.directory) if n > steps)
            for path in complete:
                shutil.rmtree(path, ignore_errors=True)
            dropped = sorted([*dropped, *complete], key=_steps_of)
        host_barrier(self._group)
        return dropped

    def _finalize(self, tmp: Path, final: Path) -> None:
        # Each rank's future resolves only after the metadata is written, which needs every
        # rank's data: once rank 0 sees its own, the checkpoint is complete.
        if world_rank()[0] == 0:
            if self.before_publish is not None:
                self.before_publish()
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            logger.info("checkpoint %s written", final)
            for stale in _stale_saves(self.directory):
                logger.info("checkpoint %s deleted: a save that never completed", stale)
        self._prune_due = True
        self._prune()

    def confirm(self, steps: int) -> None:
        """Step ``steps``'s loss (or the evaluation after ``steps`` steps) was finite: the
        checkpoint of ``steps`` steps holds no update that broke the weights, and older ones
        beyond ``keep`` may go. Peak disk use is unchanged: the older one also stood beside
        the newer one's ``.tmp`` while it was written."""
        if steps > self.confirmed:
            self.confirmed = steps
            if self._prune_due:  # else nothing new to count: no listing at every step
                self._prune()

    def _prune(self) -> None:
        if not self.keep or world_rank()[0] != 0:
            self._prune_due = False
            return
        for path in prune_checkpoints(self.directory, self.keep, self.confirmed):
            logger.info("checkpoint %s deleted (--keep-checkpoints %d)", path, self.keep)
        self._prune_due = any(n > self.confirmed for n, _ in _complete(self.directory))

    def _load_blocks(self, path: Path, prefix: str, store) -> None:
        """``<prefix>/i`` of every block into ``store``, one block in memory at a time. A
        store in host memory reads only the ranges this rank holds (a sliced rank: 1/n of
        each block, so the job reads the model once per node, not once per rank)."""
        for i, layout in enumerate(self.engine.block_layouts):
            key = f"{prefix}/{i}"
            if isinstance(store, StreamedBlocks):
                values = load_ranges(path, {key: store.share_ranges(i)}, self._group)[key]
                store.load_block_ranges(i, lambda lo, hi, got=values: got[(lo, hi)])
                continue
            buffer = {key: torch.empty(layout.numel, dtype=store.rest_dtype)}
            load_tensors(buffer, path, process_group=self._group)
            store.load_block(i, buffer[key])

    def _load_lowrank_momentum(self, path: Path) -> None:
        """LOZO-M's factors of every bucket, read whole on every rank."""
        lozo_m = self.engine.update_rule.lowrank_momentum
        if lozo_m is None:
            return
        factors = {
            f"{LOWRANK_MOMENTUM}/{block_id}": torch.empty_like(state, device="cpu")
            for block_id, state in enumerate(lozo_m.states)
        }
        load_tensors(factors, path, process_group=self._group)
        lozo_m.load(list(factors.values()))

    def _check_optimizer(self, path: Path, saved) -> None:
        """A run resumes with the optimizer state it was saved with: the same optimizer, its
        moments stored or not alike, the same betas, Adam eps and momentum window (a
        checkpoint from before optimizers: ZO-SGD)."""
        if "meta/optimizer" in saved:
            vector = {
                "meta/optimizer": torch.zeros(
                    _saved_size(saved, "meta/optimizer"), dtype=torch.float64
                )
            }
            load_tensors(vector, path, process_group=self._group)
            optimizer, moments, options = _optimizer_of(vector["meta/optimizer"])
        else:  # written before stored optimizer state: no moments, whichever optimizer
            optimizer, moments, options = (
                self.engine.config.optimizer if not self.engine.config.num_moments else "sgd",
                0,
                {},
            )
        cfg = self.engine.config
        if (optimizer, moments) != (cfg.optimizer, _state_code(cfg)):

            def says(name: str, count: int) -> str:
                state = "lowrank" if count == LOWRANK_STATE else "stored"
                return f"--optimizer {name}" + (
                    f" --optimizer-state {state}" if name == "momentum" and count else ""
                )

            raise ValueError(
                f"{path} was trained with {says(optimizer, moments)}, this run has "
                f"{says(cfg.optimizer, _state_code(cfg))}; resume with the optimizer it was "
                "trained with"
            )
        _check_update_options(path, cfg, options)

    @_without_single_process_note()
    def load(self, path: Path) -> int:
        """Restore the engine from ``path``; returns the step to continue from."""
        engine = self.engine
        check_complete(path)
        engine.streams.synchronize()
        meta = {k: torch.zeros_like(v) for k, v in _meta(engine).items()}
        # The pending update has as many g as the saving run had queries, whatever this one has.
        saved = TensorOnlyReader(str(path)).read_metadata().state_dict_metadata
        meta["meta/pending"] = torch.zeros(_saved_size(saved, "meta/pending"), dtype=torch.float64)
        if "meta/recent_steps" in saved:  # a momentum's history (absent before optimizers)
            meta["meta/recent_steps"] = torch.zeros(
                _saved_size(saved, "meta/recent_steps"), dtype=torch.float64
            )
        else:
            del meta["meta/recent_steps"]
        buckets = [("resident", engine.resident_layout)] + [
            (f"block/{i}", layout) for i, layout in enumerate(engine.block_layouts)
        ]
        for key, layout in buckets:
            if key not in saved or tuple(_saved_size(saved, key)) != (layout.numel,):
                raise ValueError(
                    f"{path} holds other trained parameters than this run ({key}); resume with the "
                    "options it was trained with (the model, --peft, --lora-r, --lora-targets)"
                )
        self._check_optimizer(path, saved)
        del meta["meta/optimizer"]
        if "meta/noise" not in saved:  # written before noise kinds: legacy noise
            del meta["meta/noise"]
        if "meta/lowrank" not in saved:  # written before the low-rank kind
            del meta["meta/lowrank"]
        meta["resident"] = torch.empty_like(engine.resident_master, device="cpu")
        load_tensors(meta, path, process_group=self._group)
        identity = _noise_identity(meta["meta/noise"]) if "meta/noise" in meta else "legacy"
        lowrank = _lowrank_of(meta["meta/lowrank"]) if "meta/lowrank" in meta else None
        engine.check_noise(identity, int(meta["meta/noise_chunk"]), str(path), lowrank)
        self._load_blocks(path, "block", engine.store)
        for k, name in enumerate(engine.moments.names):
            resident = {
                f"{name}/resident": torch.empty_like(engine.moments.resident[k], device="cpu")
            }
            load_tensors(resident, path, process_group=self._group)
            engine.moments.resident[k].copy_(resident[f"{name}/resident"])
            self._load_blocks(path, f"{name}/block", engine.moments.blocks[k])
        self._load_lowrank_momentum(path)
        with torch.no_grad():
            engine.resident_master.copy_(meta["resident"])
        recent = _recent_steps(meta["meta/recent_steps"]) if "meta/recent_steps" in meta else ()
        engine.restore(
            step=int(meta["meta/step"]),
            run_seed=int(meta["meta/run_seed"]),
            pending=engine.with_momentum(_pending_update(meta["meta/pending"]), recent),
            recent_steps=recent,
        )
        logger.info("resumed from %s at step %d", path, engine.step_index)
        self.loaded_step = engine.step_index
        return engine.step_index
