"""Where a step's time goes, per streamed block: upload, compute (and the noise and the
master's upcast and rounding inside it), offload, the host's time queueing the compute,
and the period the stream model predicts from them.

Instrumented steps apart from the timed ones, so that neither instrument slows what it
does not measure: the timeline's (on CUDA, events on each phase's stream: when the device
ran the work, and the host's clock around each call: how long it took to queue it), taken
``repeats`` times and the median step kept, since one step of a busy machine can be an
outlier; and one that times each of the engine's own noise calls between two device syncs
(the perturbations, ``theta + eps z`` into the scratch, and the updates, z redrawn and
applied, momentum and Adam included), and the low-bit store's ``unpack`` and ``pack`` (the
master buffer's upcast from the wire and its rounding back: part of the compute, or of
the upload and the offload where the store keeps two buffers, ``--low-bit-master
double``). A master rebuilt from its
16-bit copy (``--low-bit-master recompute``) counts its fused kernels: each pass's rebuild
and perturbation as a perturbation, the write-back's rebuild, update and rounding as an
update.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from distzo.bench.timing import synchronize
from distzo.offload.queue_model import modelled_period
from distzo.offload.timeline import PROLOGUE, Timeline

PHASES = ("upload", "compute", "offload")


def block_phases(
    engine: Any,
    batch: Mapping[str, torch.Tensor],
    repeats: int = 1,
    num_items: int | None = None,
) -> dict[str, float]:
    """One step's mean upload, compute and offload per block (ms), the least time the host
    took to queue a block's compute (its launches), the stream model's period per block
    and the measured one, eta = the longest phase / the measured period (1: the longest
    phase hides the other two), and the step's time outside the blocks: the prologue
    (embedding, the resident bucket's perturbation) and the rest (the head, the loss, the
    host's bookkeeping). Of ``repeats`` steps, the one of the median step time.
    ``num_items``: the global batch's count, for a data-parallel share (``engine.step``)."""
    if repeats < 1:
        raise ValueError(f"phases need at least one step, got repeats={repeats}")
    steps = (_timeline_step(engine, batch, num_items) for _ in range(repeats))
    measured = sorted(steps, key=_step_ms)
    return measured[(len(measured) - 1) // 2]


def _step_ms(phases: Mapping[str, float]) -> float:
    return phases["step_ms"]


def _timeline_step(
    engine: Any, batch: Mapping[str, torch.Tensor], num_items: int | None
) -> dict[str, float]:
    scheduler = engine.scheduler
    scheduler.timeline = Timeline(engine.streams)
    try:
        synchronize(engine.device)
        start = time.perf_counter()
        engine.step(batch, num_items=num_items)
        synchronize(engine.device)
        step_ms = (time.perf_counter() - start) * 1e3
        spans = scheduler.timeline.spans()
    finally:
        scheduler.timeline = None
    n = scheduler.num_blocks
    blocks = [s for s in spans if s.block != PROLOGUE]
    prologue = sum(s.ms for s in spans if s.block == PROLOGUE)
    mean = {p: sum(s.ms for s in blocks if s.phase == p) / n for p in PHASES}
    # The least, not the mean: once the device's launch queue is full, a host that runs
    # ahead waits as long as the device takes, and its time says nothing of its launches.
    host = min((s.host_ms for s in blocks if s.phase == "compute"), default=0.0)
    streamed = max(s.end_ms for s in spans) - min(s.start_ms for s in spans)
    pipelined = (streamed - prologue) / n
    slots = engine.streamed_store.num_slots
    apart = engine.scheduler.store.double_buffered
    phases = {
        "upload_ms_per_block": mean["upload"],
        "compute_ms_per_block": mean["compute"],
        "offload_ms_per_block": mean["offload"],
        "host_ms_per_block": host,
        # 1: the phases ran on the device's streams, the host only queued them (CUDA)
        "async_streams": float(engine.streams.is_async),
        "pipelined_ms_per_block": pipelined,
        # what the stream model (``stream_model``) replays besides the phases' times
        "slots": slots,
        "double_buffered": float(apart),
        "eta": max(mean.values()) / pipelined if pipelined > 0 else 0.0,
        "step_ms": step_ms,
        "prologue_ms": prologue,
        "outside_blocks_ms": max(0.0, step_ms - streamed),
        "blocks": n,
    }
    return phases | {"model_ms_per_block": stream_model(phases)}


def stream_model(phases: Mapping[str, float]) -> float:
    """The stream model's steady-state period per block: the scheduler's own queues
    replayed with these phase times (one master buffer: max(U, C, O, (U + C + O) / K),
    docs/ARCHITECTURE.md); with two, the upcast and the rounding (where timed) apart
    from the upload and the offload they are queued beside."""
    upcast = phases.get("upload_upcast_ms", 0.0)
    rounding = phases.get("offload_rounding_ms", 0.0)
    took = {
        "upload": max(0.0, phases["upload_ms_per_block"] - upcast),
        "unpack": upcast,
        "compute": phases["compute_ms_per_block"],
        "pack": rounding,
        "offload": max(0.0, phases["offload_ms_per_block"] - rounding),
    }
    return modelled_period(int(phases["slots"]), bool(phases["double_buffered"]), took)


@contextmanager
def _timed_calls(
    obj: object,
    name: str,
    device: torch.device,
    into: list[tuple[int, float]],
    block_of: Callable[[Mapping[str, Any]], int] = lambda call: call["block_id"],
):
    """Replace ``obj.name`` by a wrapper that syncs the device around each call and
    records (block id, ms); ``block_of`` reads the block id from the call's arguments (by
    default its ``block_id``). A call that returns False did nothing (a fused kernel that
    does not apply): not recorded."""
    original: Callable[..., Any] = getattr(obj, name)
    signature = inspect.signature(original)  # bound: without self

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        block_id = block_of(signature.bind(*args, **kwargs).arguments)
        synchronize(device)
        start = time.perf_counter()
        out = original(*args, **kwargs)
        synchronize(device)
        if out is not False:
            into.append((int(block_id), (time.perf_counter() - start) * 1e3))
        return out

    setattr(obj, name, wrapper)
    try:
        yield
    finally:
        delattr(obj, name)  # the class's method again


def _store_block(call: Mapping[str, Any]) -> int:
    """The block id of a store call's ``index`` (block ids count from 1: 0 is resident)."""
    return call["index"] + 1


def noise_phase(engine: Any, batch: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """One step's noise per block (ms): its perturbations and its updates, each the
    engine's own call timed alone, and how many calls of each a block takes; the resident
    bucket's noise (embedding, head) apart; and the store's unpack and pack per block (a
    low-bit wire's master buffer: the upcast and the rounding back; nothing elsewhere):
    ``master_ms_per_block`` where the compute stream runs them, else (two buffers)
    ``upload_upcast_ms`` and ``offload_rounding_ms``, parts of those phases."""
    perturbs: list[tuple[int, float]] = []
    updates: list[tuple[int, float]] = []
    unpacks: list[tuple[int, float]] = []
    packs: list[tuple[int, float]] = []
    device = engine.device
    with ExitStack() as timed:
        for obj, name, calls in (
            (engine.noise, "perturb_into", perturbs),
            (engine.noise, "rebuild_perturb_into", perturbs),
            (engine.update_rule, "apply", updates),
            (engine.noise, "rebuild_round_into", updates),
        ):
            timed.enter_context(_timed_calls(obj, name, device, calls))
        # only where the blocks' store holds a master buffer: elsewhere both are no-ops
        if getattr(engine.store, "unpacked", None) is not None:
            for name, calls in (("unpack", unpacks), ("pack", packs)):
                timed.enter_context(
                    _timed_calls(engine.scheduler.store, name, device, calls, _store_block)
                )
        engine.step(batch)
    apart = engine.scheduler.store.double_buffered
    n = len(engine.blocks)

    def per_block(calls: list[tuple[int, float]]) -> tuple[float, float]:
        ms = sum(t for b, t in calls if 1 <= b <= n) / n
        return ms, sum(1 for b, _ in calls if b == 1)

    perturb_ms, perturb_calls = per_block(perturbs)
    update_ms, update_calls = per_block(updates)
    unpack_ms, pack_ms = per_block(unpacks)[0], per_block(packs)[0]
    return {
        "perturb_ms_per_block": perturb_ms,
        "update_ms_per_block": update_ms,
        "noise_ms_per_block": perturb_ms + update_ms,
        "master_ms_per_block": 0.0 if apart else unpack_ms + pack_ms,
        "upload_upcast_ms": unpack_ms if apart else 0.0,
        "offload_rounding_ms": pack_ms if apart else 0.0,
        "perturbs_per_block": perturb_calls,
        "updates_per_block": update_calls,
        "resident_noise_ms": sum(t for b, t in perturbs + updates if not 1 <= b <= n),
    }


def step_phases(
    engine: Any, batch: Mapping[str, torch.Tensor], repeats: int = 1
) -> dict[str, float]:
    """``block_phases`` of ``repeats`` more steps on ``batch`` and ``noise_phase`` of one;
    with two master buffers, the stream model takes the upcast and the rounding apart
    from the upload and the offload they are queued beside."""
    phases = block_phases(engine, batch, repeats) | noise_phase(engine, batch)
    if phases["double_buffered"]:  # now that the upcast and the rounding are timed
        phases["model_ms_per_block"] = stream_model(phases)
    return phases


# what a report says for a bound that is not a phase's name
BOUND_WORDS = {"waits": "the streams' waits on one another (slots, master buffers)"}

# The host's launches bound a block's compute where queueing it takes nearly as long as
# the device takes to run it: the device then waits for the next kernel.
HOST_BOUND = 0.9


def bound_by(phases: Mapping[str, float]) -> str:
    """The phase that sets the stream model's period: ``upload``, ``offload``, ``compute``
    (``host`` when, on the device's streams, the host takes at least ``HOST_BOUND`` of a
    block's compute to queue it; ``noise`` when the noise is at least half of it) or
    ``waits`` (the streams' waits on one another make the period longer than any one
    phase: too few slots for the three phases, or an op queued behind a wait it does not
    need)."""
    longest = max(PHASES, key=lambda p: phases[f"{p}_ms_per_block"])
    # (a replayed model's float sums may exceed the longest phase by a rounding)
    if phases["model_ms_per_block"] > phases[f"{longest}_ms_per_block"] * (1 + 1e-9):
        return "waits"
    compute = phases["compute_ms_per_block"]
    if (
        longest == "compute"
        and phases.get("async_streams")
        and phases.get("host_ms_per_block", 0.0) >= HOST_BOUND * compute
    ):
        return "host"
    if longest == "compute" and phases["noise_ms_per_block"] >= 0.5 * compute:
        return "noise"
    return longest


def describe_phases(name: str, phases: Mapping[str, float]) -> str:
    """One line for a report: the phases per block, the period and what bounds it."""
    master = phases.get("master_ms_per_block", 0.0)
    upcast, rounding = phases.get("upload_upcast_ms", 0.0), phases.get("offload_rounding_ms", 0.0)
    inside = f"noise {phases['noise_ms_per_block']:.3g} ms of it: " + (
        f"{_count(phases['perturbs_per_block'], 'perturbation')} and "
        f"{_count(phases['updates_per_block'], 'update')}"
    )
    if master > 0:
        inside += f"; the master's upcast and rounding {master:.3g} ms"
    if phases.get("async_streams"):
        inside += f"; queued by the host in {phases.get('host_ms_per_block', 0.0):.3g} ms"
    upload = f"{phases['upload_ms_per_block']:.3g} ms"
    if upcast > 0:
        upload += f" (the master's upcast {upcast:.3g} ms of it)"
    offload = f"{phases['offload_ms_per_block']:.3g} ms"
    if rounding > 0:
        offload += f" (the master's rounding {rounding:.3g} ms of it)"
    bound = bound_by(phases)
    return (
        f"{name} per block: upload {upload}, compute "
        f"{phases['compute_ms_per_block']:.3g} ms ({inside}), offload "
        f"{offload}; the stream model's period "
        f"{phases['model_ms_per_block']:.3g} ms, measured {phases['pipelined_ms_per_block']:.3g} "
        f"ms (eta {phases['eta']:.2f}): bound by {BOUND_WORDS.get(bound, bound)}. Of the step's "
        f"{phases['step_ms']:.3g} ms, the {phases['blocks']:g} blocks take "
        f"{phases['pipelined_ms_per_block'] * phases['blocks']:.3g}, the prologue "
        f"{phases['prologue_ms']:.3g} (the resident bucket's noise "
        f"{phases['resident_noise_ms']:.3g}, over the step), the head and the rest "
        f"{phases['outside_blocks_ms']:.3g}"
    )


def _count(n: float, noun: str) -> str:
    return f"{n:g} {noun}{'' if n == 1 else 's'}"
