"""Pinned host memory: what the engine locks for a shape's host copy of the blocks,
against what PyTorch's caching host allocator (``pin_memory=True``) would lock.

    python benchmarks/pinned.py --shape opt-13b    # on a CUDA machine (about 52 GB, then 64 GB)
    python benchmarks/pinned.py --shape opt-1.3b --layers 4

The engine's host store (``StreamedBlocks``, fp32 on the wire, one rank) is built for
the shape's layouts and the process's resident memory (``VmRSS`` from /proc/self/status:
pinned pages are resident) is read before and after, then the same byte count is
allocated with ``torch.empty(..., pin_memory=True)`` and read again; the rise of
``VmLck`` and ``VmPin`` is reported beside it. Report: benchmark "memory".
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch

from distzo.bench import BenchReport, Measurement
from distzo.bench.arguments import at_least
from distzo.config.engine_options import ZOConfig
from distzo.engine import bucket_layouts
from distzo.job.memory_plan import plan_memory
from distzo.models import family_for
from distzo.models.shapes import SHAPES, shape_config
from distzo.models.weights import skeleton
from distzo.offload import StreamedBlocks
from distzo.runtime.devices import device_name
from distzo.runtime.host_memory import _proc_kib

# Pinned pages are resident: the rise of VmRSS is the memory an allocation pinned. VmLck
# and VmPin are reported too (0 for CUDA-pinned memory on the lent H100: the driver pins
# without mlock).
FIELDS = ("VmRSS", "VmLck", "VmPin")


def status(field: str) -> int:
    return _proc_kib("/proc/self/status", field) or 0


def measure(name: str, params: dict, build) -> tuple[Measurement, object]:
    gc.collect()
    before = {field: status(field) for field in FIELDS}
    start = time.perf_counter()
    held = build()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    grown = {field: (status(field) - before[field]) / 1e9 for field in FIELDS}
    print(
        f"{name:22s} resident +{grown['VmRSS']:8.3f} GB "
        f"(VmLck +{grown['VmLck']:.3f}, VmPin +{grown['VmPin']:.3f}) in {seconds:6.1f} s"
    )
    metrics = {
        "resident_gb": grown["VmRSS"],
        "vmlck_gb": grown["VmLck"],
        "vmpin_gb": grown["VmPin"],
    }
    return Measurement(name, params, 1, seconds, seconds, seconds, 0.0, metrics), held


def build_parser() -> argparse.ArgumentParser:
    """The command line alone: gpu_session.sh's flags are checked against it without a GPU."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="opt-13b", choices=SHAPES)
    p.add_argument("--layers", type=at_least(1), default=None)
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/pinned.json"))
    return p


def main() -> None:
    args = build_parser().parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("pinned.py needs a CUDA device: pinning is what it measures")
    device = torch.device("cuda")
    config = shape_config(args.shape, args.layers)
    model = skeleton(config, torch.float32)
    built, _ = bucket_layouts(model, family_for(model).blocks())
    layouts = [layout for layout, _ in built]
    plan = plan_memory(model, ZOConfig(device="cuda"), 1, False, batch=1, seq=8)
    params = {
        "shape": args.shape,
        "layers": config.num_hidden_layers,
        "planned_gb": plan.host_bytes / 1e9,
    }
    print(f"{args.shape}: planned host copy {plan.host_bytes / 1e9:.3f} GB")
    report = BenchReport("memory", device_name(device), 1)
    exact, store = measure("engine_exact_pin", params, lambda: StreamedBlocks(layouts, device, 1))
    report.measurements.append(exact)
    report.derived["engine_pinned_over_planned"] = (
        exact.metrics["resident_gb"] * 1e9 / plan.host_bytes
    )
    del store
    caching, buffer = measure(
        "caching_allocator_pin",
        params,
        lambda: torch.empty(plan.host_bytes, dtype=torch.uint8, pin_memory=True),
    )
    report.measurements.append(caching)
    report.derived["caching_pinned_over_planned"] = (
        caching.metrics["resident_gb"] * 1e9 / plan.host_bytes
    )
    del buffer
    report.write(args.out, ["shape", "planned_gb", "resident_gb", "vmlck_gb", "vmpin_gb"])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
