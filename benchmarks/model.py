"""Analytic projection of the sliced transfer to n GPUs per node (DistZO2's model).

    python benchmarks/model.py --bandwidth benchmarks/out/bandwidth.json [--shape opt-175b]
    python benchmarks/model.py --b-h2d 25 --b-d2h 25 [--b-allgather 360]

For a block of M bytes, n local GPUs, host->device and device->host link bandwidths
B_h2d, B_d2h (measured: the bare pinned copies of a bandwidth report, or given) and
the all-gather bus bandwidth B_ag (NCCL's busbw: all-gather moves (n-1)/n of the
block per GPU at that rate):

    naive:     T_up = M / B_h2d                                (every GPU moves the whole block)
    sliced:    T_up(n) = M / (n B_h2d) + (n-1) M / (n B_ag)
    pipelined: T_up(n) = max(a, b) + min(a, b) / c,  a = M/(n B_h2d), b = (n-1)M/(n B_ag)
               (the slice in c chunks: chunk j's all-gather overlaps chunk j+1's copy;
               c defaults to the engine's --transfer-chunks, ZOConfig.transfer_chunks)
    offload:   T_off(n) = M / (n B_d2h)

The default B_ag = 360 GB/s is NCCL's all-gather bus bandwidth on 8x H100 with
NVLink 4 (nccl-tests, large messages); pass --b-allgather for your fabric.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from distzo.bench.arguments import at_least, positive_float
from distzo.config.engine_options import ZOConfig
from distzo.models.shapes import OPT_SHAPES

LAYER_WIDTHS = {name: shape[0] for name, shape in OPT_SHAPES.items()}
# the pieces the engine stripes each rank's slice into (--transfer-chunks): what "pipelined" models
ENGINE_CHUNKS = ZOConfig.transfer_chunks
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def measured_links(path: Path) -> tuple[float, float, str]:
    """The largest block's bare pinned (CUDA) or plain (CPU) copy rates of a bandwidth report."""
    data = json.loads(path.read_text())
    best: dict[tuple[str, bool], tuple[int, float]] = {}
    for m in data["measurements"]:
        for direction in ("h2d", "d2h"):
            if (
                m["name"] in (f"bare_{direction}_pinned", f"bare_{direction}_pageable")
                and m["params"].get("dtype") == "fp32"
            ):
                pinned = m["name"].endswith("pinned")
                key = (direction, pinned)
                size = m["params"]["numel"]
                if key not in best or size > best[key][0]:
                    best[key] = (size, m["metrics"]["gb_per_s"])

    def pick(direction: str) -> float:
        entry = best.get((direction, True)) or best.get((direction, False))
        if entry is None:
            raise SystemExit(
                f"error: {path} has no fp32 bare {direction} copy; "
                "run benchmarks/bandwidth.py first"
            )
        return entry[1]

    return pick("h2d"), pick("d2h"), f"{data['device']} ({path})"


def project(
    block_bytes: float, b_h2d: float, b_d2h: float, b_ag: float, chunks: int, max_n: int
) -> list[dict]:
    gb = block_bytes / 1e9
    rows = []
    for n in range(1, max_n + 1):
        a = gb / (n * b_h2d)
        b = (n - 1) * gb / (n * b_ag)
        rows.append(
            {
                "n": n,
                "naive_up_s": gb / b_h2d,
                "sliced_up_s": a + b,
                "pipelined_up_s": max(a, b) + min(a, b) / chunks,
                "offload_s": gb / (n * b_d2h),
                "naive_offload_s": gb / b_d2h,
            }
        )
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The command line alone: gpu_session.sh's flags are checked against it without a GPU."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--bandwidth", type=Path, default=None, help="a bandwidth.py JSON to take B_h2d/B_d2h from"
    )
    p.add_argument(
        "--b-h2d",
        type=positive_float,
        default=None,
        help="host->device GB/s (instead of --bandwidth)",
    )
    p.add_argument(
        "--b-d2h",
        type=positive_float,
        default=None,
        help="device->host GB/s (instead of --bandwidth)",
    )
    p.add_argument(
        "--b-allgather",
        type=positive_float,
        default=360.0,
        help="all-gather bus bandwidth, GB/s",
    )
    p.add_argument(
        "--shape",
        default="opt-175b",
        choices=sorted(LAYER_WIDTHS),
        help="block = one layer, 12 d^2 parameters",
    )
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPE_BYTES))
    p.add_argument(
        "--chunks",
        type=at_least(1),
        default=ENGINE_CHUNKS,
        help="chunks of the slice in the pipelined variant (default "
        f"{ENGINE_CHUNKS}: the engine's --transfer-chunks)",
    )
    p.add_argument("--max-n", type=at_least(1), default=8)
    p.add_argument(
        "--out", type=Path, default=None, help="also write the table (Markdown) and JSON here"
    )
    return p


def main() -> None:
    args = build_parser().parse_args()
    if args.bandwidth is not None:
        b_h2d, b_d2h, source = measured_links(args.bandwidth)
    elif args.b_h2d and args.b_d2h:
        b_h2d, b_d2h, source = args.b_h2d, args.b_d2h, "given on the command line"
    else:
        raise SystemExit("error: pass --bandwidth REPORT.json, or both --b-h2d and --b-d2h")
    block = 12 * LAYER_WIDTHS[args.shape] ** 2 * DTYPE_BYTES[args.dtype]
    rows = project(block, b_h2d, b_d2h, args.b_allgather, args.chunks, args.max_n)
    lines = [
        f"{args.shape} layer, {args.dtype}: {block / 1e9:.2f} GB; "
        f"B_h2d {b_h2d:.1f} GB/s, B_d2h {b_d2h:.1f} GB/s ({source}); "
        f"B_allgather {args.b_allgather:.0f} GB/s; {args.chunks} chunks",
        "",
        "| n | naive up (ms) | sliced up (ms) | pipelined up (ms) | speed-up sliced "
        "| speed-up pipelined | offload (ms) | naive offload (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['n']} | {r['naive_up_s'] * 1e3:.1f} | {r['sliced_up_s'] * 1e3:.1f} "
            f"| {r['pipelined_up_s'] * 1e3:.1f} | {r['naive_up_s'] / r['sliced_up_s']:.2f} "
            f"| {r['naive_up_s'] / r['pipelined_up_s']:.2f} | "
            f"{r['offload_s'] * 1e3:.1f} | {r['naive_offload_s'] * 1e3:.1f} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(table)
        args.out.with_suffix(".json").write_text(
            json.dumps(
                {
                    "block_bytes": block,
                    "b_h2d": b_h2d,
                    "b_d2h": b_d2h,
                    "b_allgather": args.b_allgather,
                    "rows": rows,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
