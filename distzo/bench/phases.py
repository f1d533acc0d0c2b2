"""Where a step's time goes, per streamed block: upload, compute (and the noise inside
it), offload, and the period the stream model predicts from them.

Two instrumented steps, each apart from the timed ones so that neither instrument slows
what it does not measure: one records the scheduler's timeline (on CUDA, events on each
phase's stream: when the device ran the work), the other times each of the engine's own
noise calls between two device syncs (the perturbations, ``theta + eps z`` into the
scratch, and the updates, z redrawn and applied, momentum and Adam included). A master
rebuilt from its 16-bit copy (``--low-bit-master recompute``) counts its fused kernels:
each pass's rebuild and perturbation as a perturbation, the write-back's rebuild, update
and rounding as an update.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from distzo.bench.timing import synchronize
from distzo.offload.timeline import PROLOGUE, Timeline

PHASES = ("upload", "compute", "offload")


def block_phases(engine: Any, batch: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """One step's mean upload, compute and offload per block (ms), the stream model's
    period per block and the measured one, eta = the longest phase / the measured period
    (1: the longest phase hides the other two), and the step's time outside the blocks:
    the prologue (embedding, the resident bucket's perturbation) and the rest (the head,
    the loss, the host's bookkeeping)."""
    scheduler = engine.scheduler
    scheduler.timeline = Timeline(engine.streams)
    try:
        synchronize(engine.device)
        start = time.perf_counter()
        engine.step(batch)
        synchronize(engine.device)
        step_ms = (time.perf_counter() - start) * 1e3
        spans = scheduler.timeline.spans()
    finally:
        scheduler.timeline = None
    n = scheduler.num_blocks
    blocks = [s for s in spans if s.block != PROLOGUE]
    prologue = sum(s.ms for s in spans if s.block == PROLOGUE)
    mean = {p: sum(s.ms for s in blocks if s.phase == p) / n for p in PHASES}
    streamed = max(s.end_ms for s in spans) - min(s.start_ms for s in spans)
    pipelined = (streamed - prologue) / n
    slots = engine.streamed_store.num_slots
    return {
        "upload_ms_per_block": mean["upload"],
        "compute_ms_per_block": mean["compute"],
        "offload_ms_per_block": mean["offload"],
        "pipelined_ms_per_block": pipelined,
        # The stream model's steady state with K slots (docs/ARCHITECTURE.md, section 5):
        # upload(i) waits offload(i - K), so K periods hold one upload, compute and offload.
        "model_ms_per_block": max(*mean.values(), sum(mean.values()) / slots),
        "eta": max(mean.values()) / pipelined if pipelined > 0 else 0.0,
        "step_ms": step_ms,
        "prologue_ms": prologue,
        "outside_blocks_ms": max(0.0, step_ms - streamed),
        "blocks": n,
    }


@contextmanager
def _timed_calls(obj: object, name: str, device: torch.device, into: list[tuple[int, float]]):
    """Replace ``obj.name`` by a wrapper that syncs the device around each call and
    records (block id, ms); the block id is the call's ``block_id`` argument. A call that
    returns False did nothing (a fused kernel that does not apply): not recorded."""
    original: Callable[..., Any] = getattr(obj, name)
    signature = inspect.signature(original)  # bound: without self

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        block_id = signature.bind(*args, **kwargs).arguments["block_id"]
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


def noise_phase(engine: Any, batch: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """One step's noise per block (ms): its perturbations and its updates, each the
    engine's own call timed alone, and how many calls of each a block takes; the resident
    bucket's noise (embedding, head) apart."""
    perturbs: list[tuple[int, float]] = []
    updates: list[tuple[int, float]] = []
    with (
        _timed_calls(engine.noise, "perturb_into", engine.device, perturbs),
        _timed_calls(engine.noise, "rebuild_perturb_into", engine.device, perturbs),
        _timed_calls(engine.update_rule, "apply", engine.device, updates),
        _timed_calls(engine.noise, "rebuild_round_into", engine.device, updates),
    ):
        engine.step(batch)
    n = len(engine.blocks)

    def per_block(calls: list[tuple[int, float]]) -> tuple[float, float]:
        ms = sum(t for b, t in calls if 1 <= b <= n) / n
        return ms, sum(1 for b, _ in calls if b == 1)

    perturb_ms, perturb_calls = per_block(perturbs)
    update_ms, update_calls = per_block(updates)
    return {
        "perturb_ms_per_block": perturb_ms,
        "update_ms_per_block": update_ms,
        "noise_ms_per_block": perturb_ms + update_ms,
        "perturbs_per_block": perturb_calls,
        "updates_per_block": update_calls,
        "resident_noise_ms": sum(t for b, t in perturbs + updates if not 1 <= b <= n),
    }


def step_phases(engine: Any, batch: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """``block_phases`` and ``noise_phase`` of two more steps on ``batch``."""
    return block_phases(engine, batch) | noise_phase(engine, batch)


def bound_by(phases: Mapping[str, float]) -> str:
    """The phase that sets the stream model's period: ``upload``, ``offload``, ``compute``
    (``noise`` when the noise is at least half of it) or ``slots`` (the three phases in
    sequence over the K slots take longer than any one of them)."""
    longest = max(PHASES, key=lambda p: phases[f"{p}_ms_per_block"])
    if phases["model_ms_per_block"] > phases[f"{longest}_ms_per_block"]:
        return "slots"
    if (
        longest == "compute"
        and phases["noise_ms_per_block"] >= 0.5 * phases["compute_ms_per_block"]
    ):
        return "noise"
    return longest


def describe_phases(name: str, phases: Mapping[str, float]) -> str:
    """One line for a report: the phases per block, the period and what bounds it."""
    return (
        f"{name} per block: upload {phases['upload_ms_per_block']:.3g} ms, compute "
        f"{phases['compute_ms_per_block']:.3g} ms (noise {phases['noise_ms_per_block']:.3g} ms "
        f"of it: {_count(phases['perturbs_per_block'], 'perturbation')} and "
        f"{_count(phases['updates_per_block'], 'update')}), offload "
        f"{phases['offload_ms_per_block']:.3g} ms; the stream model's period "
        f"{phases['model_ms_per_block']:.3g} ms, measured {phases['pipelined_ms_per_block']:.3g} "
        f"ms (eta {phases['eta']:.2f}): bound by {bound_by(phases)}. Of the step's "
        f"{phases['step_ms']:.3g} ms, the {phases['blocks']:g} blocks take "
        f"{phases['pipelined_ms_per_block'] * phases['blocks']:.3g}, the prologue "
        f"{phases['prologue_ms']:.3g} (the resident bucket's noise "
        f"{phases['resident_noise_ms']:.3g}, over the step), the head and the rest "
        f"{phases['outside_blocks_ms']:.3g}"
    )


def _count(n: float, noun: str) -> str:
    return f"{n:g} {noun}{'' if n == 1 else 's'}"
