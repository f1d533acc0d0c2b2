"""Which kernels one step runs, on which stream, for how long, and how much of each
stream's busy time runs beside another stream's kernels.

The phases (``distzo.bench.phases``) time each stream's work per block; where an offloaded
compute stream takes longer than a resident one with the same forwards, they cannot say
which kernels grew, or whether they grew while the upload and offload streams' kernels
(the master's upcast, its rounding) shared the SMs with them. One step under
``torch.profiler``, apart from the timed ones, says both: per stream and kernel name the
count and the device time, per stream the busy time and the part of it beside another
stream. The step's Chrome trace is kept beside the summary for a closer look
(chrome://tracing, Perfetto).

On CUDA each of the engine's streams first runs one small marker kernel, one after
another, so the profile's first kernels name the streams (the profiler knows them by the
driver's numbers only). On CPU the streams are stand-ins that run in order on the calling
thread; the step's outermost operators stand for its kernels.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from distzo.bench.timing import synchronize
from distzo.offload.streams import PHASES

KERNELS = "kernels.md"  # the side-by-side table a directory of profiles gets
SUFFIX = ".kernels.json"
TRACE_SUFFIX = ".trace.json"


@dataclass(frozen=True)
class Span:
    """One kernel (on CPU, one outermost operator): where it ran and when (microseconds)."""

    stream: str
    name: str
    start_us: float
    end_us: float


def profile_step(
    engine: Any, batch: Mapping[str, torch.Tensor], trace: Path | None = None
) -> dict[str, Any]:
    """One ``engine.step(batch)`` under the profiler: ``summarize``'s record of it, with
    the device's name and the step's wall time (the profiler's overhead included); the
    Chrome trace written to ``trace`` (through a temporary file) where given."""
    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize(engine.device)
    with profile(activities=activities) as prof:
        if cuda:
            _mark_streams(engine.streams)
        start = time.perf_counter()
        engine.step(batch)
        synchronize(engine.device)
        step_ms = (time.perf_counter() - start) * 1e3
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        tmp = trace.with_name(trace.name + ".tmp")
        prof.export_chrome_trace(str(tmp))
        tmp.replace(trace)
    spans = _device_spans(prof.events()) if cuda else _cpu_spans(prof.events())
    return {"device": engine.device.type, "step_ms": step_ms} | summarize(spans)


def _mark_streams(streams: Any) -> None:
    """One fill kernel on each phase's stream, in ``PHASES`` order, the host waiting for
    each: the profile's first ``len(PHASES)`` kernels, in that order, one per stream."""
    for phase in PHASES:
        with streams.on(phase):
            torch.zeros(1, device=streams.device)
        streams.synchronize()


def _device_spans(events: Iterable[Any]) -> list[Span]:
    """The device's kernels and copies; their streams named by the markers."""
    kernels = sorted(
        (e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation),
        key=lambda e: e.time_range.start,
    )
    markers, rest = kernels[: len(PHASES)], kernels[len(PHASES) :]
    names = {e.device_resource_id: phase for e, phase in zip(markers, PHASES)}
    return [
        Span(
            names.get(e.device_resource_id, f"stream {e.device_resource_id}"),
            e.name,
            e.time_range.start,
            e.time_range.end,
        )
        for e in rest
    ]


def _cpu_spans(events: Iterable[Any]) -> list[Span]:
    """The step's outermost operators (``aten::linear``, not the ``aten::addmm`` inside
    it), each thread a stream: their times do not overlap within a thread."""
    outer = [
        e for e in events if e.device_type == DeviceType.CPU and _is_op(e) and not _inside_an_op(e)
    ]
    threads = sorted({e.thread for e in outer})
    label = {t: "cpu" if len(threads) == 1 else f"cpu thread {i}" for i, t in enumerate(threads)}
    return [Span(label[e.thread], e.name, e.time_range.start, e.time_range.end) for e in outer]


def _is_op(event: Any) -> bool:
    return bool(event.name.startswith("aten::"))


def _inside_an_op(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if _is_op(parent):
            return True
        parent = parent.cpu_parent
    return False


def summarize(spans: Iterable[Span]) -> dict[str, Any]:
    """Per stream its busy time (the union of its spans) and the part of it during which
    another stream was busy too; per stream and name the count and the total time, the
    longest first (milliseconds)."""
    spans = list(spans)
    by_stream: dict[str, list[tuple[float, float]]] = {}
    kernels: dict[tuple[str, str], list[float]] = {}
    for s in spans:
        by_stream.setdefault(s.stream, []).append((s.start_us, s.end_us))
        total = kernels.setdefault((s.stream, s.name), [0, 0.0])
        total[0] += 1
        total[1] += s.end_us - s.start_us
    busy = {name: _union(intervals) for name, intervals in by_stream.items()}
    streams = {}
    for name, own in busy.items():
        others = _union([i for other, b in busy.items() if other != name for i in b])
        streams[name] = {
            "busy_ms": _length(own) / 1e3,
            "beside_ms": _length(_intersection(own, others)) / 1e3,
        }
    ranked = sorted(kernels.items(), key=lambda item: -item[1][1])
    rows = [
        {"stream": stream, "name": name, "count": int(count), "ms": us / 1e3}
        for (stream, name), (count, us) in ranked
    ]
    return {"streams": streams, "kernels": rows}


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intersection(
    a: list[tuple[float, float]], b: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    """The overlap of two merged interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def write_profile(directory: Path, system: str, record: Mapping[str, Any]) -> Path:
    """``directory/<system>.kernels.json``, through a temporary file."""
    directory.mkdir(parents=True, exist_ok=True)
    return _replace_text(directory / f"{system}{SUFFIX}", json.dumps(record, indent=1) + "\n")


def _replace_text(path: Path, text: str) -> Path:
    """``path`` holds ``text``, written to a temporary file and renamed: never half written."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def read_profiles(directory: Path) -> dict[str, dict[str, Any]]:
    """Every system's profile in ``directory``, by system name, in name order."""
    paths = sorted(directory.glob(f"*{SUFFIX}"))
    return {p.name.removesuffix(SUFFIX): json.loads(p.read_text()) for p in paths}


def short_name(name: str, width: int = 70) -> str:
    """A kernel's name without its template arguments and parameters, cut to ``width``."""
    name = name.removeprefix("void ").split("<")[0].split("(")[0].strip()
    return name if len(name) <= width else name[: width - 3] + "..."


def compare_markdown(profiles: Mapping[str, Mapping[str, Any]], top: int = 25) -> str:
    """The systems' profiles side by side: each stream's busy time and the part beside
    another stream; then the ``top`` kernels (by name without template arguments, per
    stream) by their longest time in any system, each system's ms and count."""
    systems = list(profiles)
    lines = [
        "| system | stream | busy ms | beside another stream ms | step ms (profiled) |",
        "|---|---|---|---|---|",
    ]
    for system, record in profiles.items():
        for stream, s in sorted(record["streams"].items()):
            lines.append(
                f"| {system} | {stream} | {s['busy_ms']:.3f} | {s['beside_ms']:.3f} "
                f"| {record['step_ms']:.1f} |"
            )
    table: dict[tuple[str, str], dict[str, list[float]]] = {}
    for system, record in profiles.items():
        for row in record["kernels"]:
            cell = table.setdefault((row["stream"], short_name(row["name"])), {})
            total = cell.setdefault(system, [0.0, 0])
            total[0] += row["ms"]
            total[1] += row["count"]
    ranked = sorted(table.items(), key=lambda item: -max(v[0] for v in item[1].values()))
    lines += [
        "",
        "| stream | kernel | " + " | ".join(f"{s} ms (count)" for s in systems) + " |",
        "|---|---|" + "---|" * len(systems),
    ]
    for (stream, name), cells in ranked[:top]:
        values = [f"{cells[s][0]:.3f} ({cells[s][1]:g})" if s in cells else "-" for s in systems]
        lines.append(f"| {stream} | `{name}` | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


def write_comparison(directory: Path) -> Path | None:
    """``directory/kernels.md`` from the profiles there (None where there are none)."""
    profiles = read_profiles(directory)
    if not profiles:
        return None
    return _replace_text(directory / KERNELS, compare_markdown(profiles))
