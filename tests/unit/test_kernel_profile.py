"""distzo.bench.kernel_profile: one profiled step's kernels per stream, and how much of each
stream's time runs beside another's. The CUDA path's stream naming is checked on stand-in
profiler events (no GPU here); the CPU path on a real engine's step."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType
from transformers import OPTForCausalLM

from distzo import ZOConfig, ZOEngine
from distzo.bench import kernel_profile
from distzo.bench.kernel_profile import (
    Span,
    compare_markdown,
    profile_step,
    read_profiles,
    short_name,
    summarize,
    write_comparison,
    write_profile,
)
from distzo.models.tiny import tiny_opt_config


def test_busy_time_is_a_union_and_beside_is_the_overlap_with_the_other_streams():
    ms = 1000.0  # spans are in microseconds
    spans = [
        Span("compute", "gemm", 0, 10 * ms),
        Span("compute", "gemm", 20 * ms, 32 * ms),
        Span("upload", "upcast", 5 * ms, 25 * ms),
        # two kernels of one stream that overlap (as the profiler may report): counted once
        Span("offload", "round", 40 * ms, 50 * ms),
        Span("offload", "round", 45 * ms, 56 * ms),
    ]
    out = summarize(spans)
    assert out["streams"] == {
        "compute": {"busy_ms": 22.0, "beside_ms": 10.0},  # [5, 10] and [20, 25]
        "upload": {"busy_ms": 20.0, "beside_ms": 10.0},
        "offload": {"busy_ms": 16.0, "beside_ms": 0.0},
    }
    assert out["kernels"] == [  # the longest first
        {"stream": "compute", "name": "gemm", "count": 2, "ms": 22.0},
        {"stream": "offload", "name": "round", "count": 2, "ms": 21.0},
        {"stream": "upload", "name": "upcast", "count": 1, "ms": 20.0},
    ]


def event(stream: int, name: str, start: float, end: float, annotation: bool = False):
    """A stand-in for a profiler's device event (FunctionEvent's fields the module reads)."""
    return SimpleNamespace(
        device_type=DeviceType.CUDA,
        device_resource_id=stream,
        name=name,
        time_range=SimpleNamespace(start=start, end=end),
        is_user_annotation=annotation,
    )


def test_the_first_kernels_name_the_engines_streams_and_are_left_out():
    """The three markers (upload, compute, offload, one after another) come first; the
    streams the profiler knows by number are named by them; an unmarked stream (the
    caller's) keeps its number; a GPU user annotation is no kernel."""
    cpu_op = SimpleNamespace(device_type=DeviceType.CPU, name="aten::mm", is_user_annotation=False)
    events = [
        event(13, "gemm", 100, 110),
        event(7, "fill", 0, 1),  # upload's marker
        event(7, "Memcpy HtoD", 50, 90),
        event(9, "fill", 2, 3),  # compute's
        event(11, "fill", 4, 5),  # offload's
        event(9, "annotation", 40, 120, annotation=True),
        event(9, "gemm", 60, 80),
        event(11, "round", 70, 75),
        cpu_op,
    ]
    spans = kernel_profile._device_spans(events)
    assert spans == [
        Span("upload", "Memcpy HtoD", 50, 90),
        Span("compute", "gemm", 60, 80),
        Span("offload", "round", 70, 75),
        Span("stream 13", "gemm", 100, 110),
    ]


def test_a_cpu_step_profiles_its_outermost_operators_and_keeps_its_trace(tmp_path):
    torch.manual_seed(0)
    config = ZOConfig(mode="offload", device="cpu", lr=1e-3, eps=1e-3, seed=0)
    engine = ZOEngine(OPTForCausalLM(tiny_opt_config()), config)
    batch = {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))}
    engine.step(batch)
    trace = tmp_path / "offload.trace.json"
    record = profile_step(engine, batch, trace)
    assert record["device"] == "cpu" and record["step_ms"] > 0
    assert list(record["streams"]) == ["cpu"]  # one thread: the stand-in streams run in order
    assert record["streams"]["cpu"]["beside_ms"] == 0.0
    names = {r["name"]: r for r in record["kernels"]}
    # the blocks' linears, not the addmm inside them (counted once, not twice)
    layers = tiny_opt_config().num_hidden_layers
    assert names["aten::linear"]["count"] >= 2 * 6 * layers  # 2 passes x 6 linears a layer
    assert "aten::addmm" not in names
    assert sum(r["ms"] for r in record["kernels"]) == pytest.approx(
        record["streams"]["cpu"]["busy_ms"], rel=1e-6
    )
    assert "traceEvents" in json.loads(trace.read_text())
    assert not list(tmp_path.glob("*.tmp"))


def test_profiles_side_by_side(tmp_path):
    long = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int)"
    resident = {
        "device": "cuda",
        "step_ms": 100.0,
        "streams": {"compute": {"busy_ms": 90.0, "beside_ms": 0.0}},
        "kernels": [
            {"stream": "compute", "name": "sm90_gemm<a>", "count": 10, "ms": 50.0},
            {"stream": "compute", "name": "sm90_gemm<b>", "count": 2, "ms": 5.0},
        ],
    }
    offload = {
        "device": "cuda",
        "step_ms": 120.0,
        "streams": {
            "compute": {"busy_ms": 110.0, "beside_ms": 40.0},
            "upload": {"busy_ms": 60.0, "beside_ms": 40.0},
        },
        "kernels": [
            {"stream": "compute", "name": "sm90_gemm<a>", "count": 12, "ms": 70.0},
            {"stream": "upload", "name": long, "count": 3, "ms": 1.5},
        ],
    }
    write_profile(tmp_path, "distzo-resident", resident)
    write_profile(tmp_path, "distzo-offload", offload)
    assert read_profiles(tmp_path) == {"distzo-offload": offload, "distzo-resident": resident}
    path = write_comparison(tmp_path)
    assert path == tmp_path / "kernels.md"
    text = path.read_text()
    assert text == compare_markdown(read_profiles(tmp_path))
    lines = text.splitlines()
    assert "| distzo-offload | compute | 110.000 | 40.000 | 120.0 |" in lines
    assert "| distzo-resident | compute | 90.000 | 0.000 | 100.0 |" in lines
    # a kernel's instantiations under one name; a system without it shows "-"
    assert "| stream | kernel | distzo-offload ms (count) | distzo-resident ms (count) |" in lines
    assert "| compute | `sm90_gemm` | 70.000 (12) | 55.000 (12) |" in lines
    assert "| upload | `at::native::vectorized_elementwise_kernel` | 1.500 (3) | - |" in lines
    assert short_name(long) == "at::native::vectorized_elementwise_kernel"
    assert short_name("x" * 100, width=10) == "xxxxxxx..."
    assert write_comparison(tmp_path / "empty") is None
