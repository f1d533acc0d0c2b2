"""The noise ops, old path against new: elements per second and bytes moved, and the
step they dominate.

    python benchmarks/noise.py                      # 16 M elements per op, opt-125m 4-layer step
    python benchmarks/noise.py --quick              # 64 k elements, tiny step (CI)
    python benchmarks/noise.py --threads 1          # the CPU paths on one thread
    python benchmarks/noise.py --lowrank            # and LOZO's low-rank noise beside them
    python benchmarks/noise.py --ops rounding,rounding-fp16   # those ops alone, no step

Paths: ``old`` is the noise of earlier versions (``--noise legacy``: a reseeded
``torch.Generator`` fills a workspace chunk by chunk, a separate op consumes it); ``new``
is the portable Gaussian noise on its fastest backend (the C kernel on CPU, one fused
Triton kernel per op on CUDA); ``torch`` is the portable noise's torch implementation
(the same bits, for reference); ``lowrank`` (with ``--lowrank``) is LOZO's noise
(``--noise lowrank``, rank ``--lozo-rank``) over the bucket laid out as matrices
``--lowrank-cols`` wide: on CUDA its perturb and update kernels (``triton_lowrank``, U V^T
formed in registers), and ``lowrank-chunked`` beside it, the same ops on the generic path
(a piece of z from torch ops on the factors' portable draws, then the add; elsewhere
both are that path).
Ops on one float32 bucket of ``--elements``:

* ``perturb``: out = theta + eps * z (reads theta, writes out: 8 bytes per element)
* ``update``: theta -= lr * (g * z + wd * theta) (reads and writes theta: 8)
* ``update-tiled``: that one-term update through the tiled kernel that takes any number
  of terms from a table (``triton_noise.update_table``; CUDA, path ``new``; elsewhere it
  is ``update``): side by side with ``update``'s own kernel for one term
* ``window``: a recomputed momentum's update, 32 steps' terms (reads and writes theta: 8)
* ``momentum``, ``adam``: the stored moments' update (theta and 1 or 2 moments: 16, 24)
* ``momentum-tiled``: that one-query momentum through the tiled kernel
  (``triton_noise.momentum_table``; CUDA, path ``new``; elsewhere it is ``momentum``),
  beside the lane-by-lane kernel the engine launches
* ``rebuild-perturb``: a pass's bf16 scratch from a bf16 block at rest and the step's
  update, the master never stored (``--low-bit-master recompute``: reads 2, writes 2: 4;
  one fused kernel on CUDA, else the upcast, the update and the perturbation in turn)
* ``rebuild-perturb-tiled``: that pass through the tiled kernel and its table of terms
  (``triton_noise.rebuild_perturb_table``; CUDA, path ``new``; elsewhere it is
  ``rebuild-perturb``), beside the one-term kernel the engine launches
* ``rebuild-round``: that block's write-back, the update applied to its values at rest
  and rounded stochastically back in place (reads 2, writes 2: 4; one fused kernel on
  CUDA, else the upcast, the update and the rounding in turn)
* ``rebuild-round-tiled``: that write-back through the tiled kernel
  (``triton_noise.rebuild_round_table``), as ``rebuild-perturb-tiled``
* ``perturb-fp16``, ``update-fp16``: those ops on a bucket held in fp16 (a model held
  in its compute dtype, as ZO2 holds it: reads 2, writes 2: 4; one fused kernel each on
  CUDA); ``perturb-fp16-chunked``, ``update-fp16-chunked``: the same through the draws'
  float32 staging and torch's ops, chunk by chunk (CUDA's path before those kernels;
  elsewhere the same as the fused names)
* ``rounding``: theta rounded stochastically to bfloat16 (reads 4, writes 2: 6);
  ``rounding-fp16`` (6) and ``rounding-fp8`` (5) likewise

``gb_per_s`` is the bytes an op must move divided by its time; on CUDA ``of_copy`` is
that against a plain device copy of the same bytes in the same run (the bandwidth the
device really gives). Then the step of the ``opt-125m`` widths with ``--layers`` layers
(a 50,272-word vocabulary: 40 M resident parameters whose z every step regenerates),
old noise and new, interleaved. Report: benchmark "throughput".
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn

from distzo import ZOConfig, ZOEngine
from distzo.bench import BenchReport, Measurement, time_repeated
from distzo.bench.arguments import at_least, counts
from distzo.bench.timing import Timer, synchronize
from distzo.models.shapes import shape_config
from distzo.models.tiny import tiny_opt_config
from distzo.models.weights import RandomWeights, skeleton
from distzo.offload.bucket import BucketLayout
from distzo.offload.low_bit import round_keyed_
from distzo.runtime.devices import device_name
from distzo.zo import NoiseSource, triton_noise
from distzo.zo.lowrank import LowRankNoise
from distzo.zo.moments import MomentRule, MomentUpdater

BYTES = {
    "perturb": 8,
    "update": 8,
    "update-tiled": 8,
    "window": 8,
    "momentum": 16,
    "momentum-tiled": 16,
    "adam": 24,
    "rebuild-perturb": 4,
    "rebuild-perturb-tiled": 4,
    "rebuild-round": 4,
    "rebuild-round-tiled": 4,
    "perturb-fp16": 4,
    "perturb-fp16-chunked": 4,
    "update-fp16": 4,
    "update-fp16-chunked": 4,
    "rounding": 6,
    "rounding-fp16": 6,
    "rounding-fp8": 5,
}
# the ops on a bucket held in fp16 (``held_in_fp16``), named in full: ``rounding-fp16``
# rounds a float32 bucket into fp16 and is not one of them
HELD_IN_FP16 = ("perturb-fp16", "perturb-fp16-chunked", "update-fp16", "update-fp16-chunked")
WIRE = {
    "rounding": torch.bfloat16,
    "rounding-fp16": torch.float16,
    "rounding-fp8": torch.float8_e4m3fn,
}
PATHS = {"old": "legacy", "new": "gaussian", "torch": "gaussian", "lowrank": "lowrank"}
LOWRANK_PATHS = ("lowrank", "lowrank-chunked")  # its kernels; its generic path
LOWRANK_OPS = ("perturb", "update", "window")  # the ops the low-rank path is measured on
LOWRANK = {"rank": 2, "cols": 768}  # set from --lozo-rank and --lowrank-cols


def matrices(n: int, cols: int) -> BucketLayout:
    """A bucket of ``n`` elements as matrices ``cols`` wide (the last one shorter)."""
    rows, rest = divmod(n, cols)
    shapes = [(rows, cols)] + ([(1, rest)] if rest else [])
    params = [
        ((f"w{i}",), nn.Parameter(torch.empty(s, device="meta"))) for i, s in enumerate(shapes)
    ]
    return BucketLayout.build(params)[0]


def source(
    path: str,
    device: torch.device,
    chunk: int,
    distribution: str = "normal",
    n: int = 0,
    dtype: torch.dtype = torch.float32,
) -> NoiseSource:
    if path in LOWRANK_PATHS:
        layout = matrices(n, LOWRANK["cols"])
        lowrank = LowRankNoise(0, chunk, device, dtype, [layout, layout], LOWRANK["rank"], 50)
        if path == "lowrank-chunked":
            lowrank.fuses_master = lambda theta, out=None: False  # type: ignore[method-assign]
        return lowrank
    src = NoiseSource(0, chunk, device, dtype, distribution, kind=PATHS[path])
    if path == "torch":  # the portable bits from the torch implementation
        src._c = src._triton = False
    return src


def op_runner(op: str, path: str, device: torch.device, n: int, chunk: int):
    if op in HELD_IN_FP16:
        return held_in_fp16(op, path, device, n, chunk)
    theta = torch.randn(n, device=device)
    if op == "perturb":
        src, out = source(path, device, chunk, n=n), torch.empty_like(theta)
        return lambda: src.perturb_into(out, theta, 1e-3, 3, 1)
    if op == "update":
        src = source(path, device, chunk, n=n)
        return lambda: src.apply_update(theta, n, 1e-7, (0.5,), 1e-4, 3, 1)
    if op.endswith("-tiled"):  # the one-term op through the tiled kernel (CUDA's new path)
        src = source(path, device, chunk, n=n)
        if path != "new" or not src.fuses(theta):
            return op_runner(op.removesuffix("-tiled"), path, device, n, chunk)
        keys, alphas = src.term_keys([(2, 0, -1e-7)], 1)
        if op == "update-tiled":
            return lambda: triton_noise.update_table(
                theta, n, 1.0 - 1e-11, keys, alphas, src.kind, src.kind_table
            )
        if op == "momentum-tiled":
            m, draws = torch.zeros_like(theta), (src.kind, src.kind_table)
            return lambda: triton_noise.momentum_table(
                theta, m, n, 1.0 - 1e-11, keys, alphas, 0.9, 1e-7, *draws
            )
        rest = theta.bfloat16()
        if op == "rebuild-round-tiled":
            round_key = source(path, device, chunk, "uniform").key(3, 1 << 40)
            return lambda: triton_noise.rebuild_round_table(
                rest, 0, n, 1.0, keys, alphas, round_key, src.kind, src.kind_table
            )
        out, key = torch.empty_like(rest), src.key(3, 1)
        return lambda: triton_noise.rebuild_perturb_table(
            out, rest, n, 1.0, keys, alphas, key, 1e-3, src.kind, src.kind_table
        )
    if op == "window":  # a recomputed momentum: 32 steps' terms
        src, terms = source(path, device, chunk, n=n), [(99 - s, 0, 1e-9) for s in range(32)]
        return lambda: src.apply_terms(theta, n, 1.0, terms, 1)
    if op == "rebuild-perturb":  # a bf16 block at rest, its master rebuilt for one pass
        src, rest, terms = source(path, device, chunk, n=n), theta.bfloat16(), [(2, 0, -1e-7)]
        out, master = torch.empty_like(rest), torch.empty_like(theta)

        def rebuild_perturb() -> None:
            if not src.rebuild_perturb_into(out, rest, n, 1.0, terms, 1, 1e-3, 3):
                master.copy_(rest)
                src.apply_terms(master, n, 1.0, terms, 1)
                src.perturb_into(out, master, 1e-3, 3, 1)

        return rebuild_perturb
    if op == "rebuild-round":  # its write-back, in place
        src, rest, terms = source(path, device, chunk, n=n), theta.bfloat16(), [(2, 0, -1e-7)]
        rounding, master = source(path, device, chunk, "uniform"), torch.empty_like(theta)

        def rebuild_round() -> None:
            if not src.rebuild_round_into(rest, 0, n, 1.0, terms, 1, rounding, 3, 1 << 40):
                master.copy_(rest)
                src.apply_terms(master, n, 1.0, terms, 1)
                round_keyed_(rest, master, rounding, 0, n, 3, 1 << 40)

        return rebuild_round
    if op in ("momentum", "adam"):  # stored moments, updated beside theta
        src, rule = source(path, device, chunk), MomentRule(op, 0.9)
        moments = [torch.zeros_like(theta) for _ in range(rule.num_moments)]
        updater = MomentUpdater(rule, src)
        return lambda: updater.apply(src, theta, moments, n, 1e-7, 1e-4, 3, (0.5,), 1)
    if op not in WIRE:
        raise ValueError(f"noise.py has no runner for op {op!r}")
    src, wire = (
        source(path, device, chunk, "uniform"),
        torch.empty(n, device=device, dtype=WIRE[op]),
    )
    return lambda: round_keyed_(wire, theta, src, 0, n, 3, 1 << 40)


def held_in_fp16(op: str, path: str, device: torch.device, n: int, chunk: int):
    """``perturb`` or ``update`` of a bucket held in fp16; ``-chunked``: with the fused
    kernels turned off (the draws' staging, then torch's ops)."""
    theta = (torch.randn(n, device=device) * 0.05).half()
    src = source(path, device, chunk, n=n, dtype=torch.float16)
    if op.endswith("-chunked"):
        src.fuses_master = lambda theta, out=None: False  # type: ignore[method-assign]
    if op.startswith("perturb"):
        out = torch.empty_like(theta)
        return lambda: src.perturb_into(out, theta, 1e-3, 3, 1)
    return lambda: src.apply_update(theta, n, 1e-7, (0.5,), 1e-4, 3, 1)


def measure_ops(args: argparse.Namespace, device: torch.device, report: BenchReport) -> None:
    paths = ["old", "new", "torch"] if not args.skip_torch else ["old", "new"]
    copy_gbs = None
    if device.type == "cuda":
        a, b = torch.empty(args.elements, device=device), torch.empty(args.elements, device=device)
        t = time_repeated(lambda: b.copy_(a), device, args.repeats)
        copy_gbs = 8 * args.elements / t.median / 1e9
        report.derived["device_copy_gb_per_s"] = copy_gbs
        print(f"device copy {copy_gbs:8.1f} GB/s (read + write)")
    for op in args.ops:
        medians = {}
        variants = [(path, None) for path in paths]
        variants += [("new", warps) for warps in args.warps]
        variants += [(p, None) for p in LOWRANK_PATHS] if args.lowrank and op in LOWRANK_OPS else []
        for path, warps in variants:
            run = op_runner(op, path, device, args.elements, args.chunk)
            engine_options = dict(triton_noise.LAUNCH_OPTIONS)
            if warps is not None:  # every kernel launched with this many warps
                triton_noise.LAUNCH_OPTIONS.update(
                    {name: {"num_warps": warps} for name in triton_noise.KERNEL_NAMES}
                )
            try:
                timer = time_repeated(run, device, args.repeats)
            finally:
                triton_noise.LAUNCH_OPTIONS.clear()
                triton_noise.LAUNCH_OPTIONS.update(engine_options)
            label = path if warps is None else f"new_w{warps}"
            per_s = args.elements / timer.median
            metrics = {
                "elements_per_s": per_s,
                "bytes_per_element": BYTES[op],
                "gb_per_s": per_s * BYTES[op] / 1e9,
            }
            if copy_gbs:
                metrics["of_copy"] = metrics["gb_per_s"] / copy_gbs
            params = {
                "op": op,
                "path": label,
                "num_warps": warps or "engine",
                "elements": args.elements,
                "chunk": args.chunk,
                "threads": torch.get_num_threads(),
            }
            report.measurements.append(
                Measurement.from_timer(f"{op}_{label}", params, timer, metrics)
            )
            medians[label] = timer.median
            extra = f"  {metrics['of_copy']:.2f} of copy" if copy_gbs else ""
            print(
                f"{op:13s} {label:15s} {per_s / 1e6:9.1f} M elements/s  {metrics['gb_per_s']:7.2f} "
                f"GB/s{extra}"
            )
        report.derived[f"{op}_new_over_old_speed"] = medians["old"] / medians["new"]
        for warps in args.warps:
            report.derived[f"{op}_new_w{warps}_over_new_speed"] = (
                medians["new"] / medians[f"new_w{warps}"]
            )
        if "lowrank" in medians:
            report.derived[f"{op}_lowrank_over_new_time"] = medians["lowrank"] / medians["new"]
            report.derived[f"{op}_lowrank_over_chunked_speed"] = (
                medians["lowrank-chunked"] / medians["lowrank"]
            )


def step_model(args: argparse.Namespace):
    if args.quick:
        return tiny_opt_config(
            vocab_size=2048,
            hidden_size=64,
            ffn_dim=128,
            num_attention_heads=4,
            num_hidden_layers=2,
            word_embed_proj_dim=64,
            max_position_embeddings=64,
        )
    return shape_config("opt-125m", args.layers)


def measure_steps(args: argparse.Namespace, device: torch.device, report: BenchReport) -> None:
    """Steps of the old and the new noise interleaved, so drift hits both alike."""
    config = step_model(args)
    engines = {
        path: ZOEngine(
            skeleton(config, torch.float32),
            ZOConfig(
                lr=1e-7,
                eps=1e-3,
                seed=0,
                device=str(device),
                mode=args.mode,
                noise=PATHS[path],
                lr_schedule="constant",
                **({"lozo_rank": args.lozo_rank} if path == "lowrank" else {}),
            ),
            weights=RandomWeights(0),
        )
        for path in ("old", "new") + (("lowrank",) if args.lowrank else ())
    }
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(3, config.vocab_size, (args.batch, args.seq), generator=g)}
    samples: dict[str, list[float]] = {path: [] for path in engines}
    for engine in engines.values():
        engine.step(batch)  # warm-up
    for _ in range(args.steps):
        for path, engine in engines.items():
            synchronize(device)
            start = time.perf_counter()
            engine.step(batch)
            synchronize(device)
            samples[path].append(time.perf_counter() - start)
    params = {
        "shape": "tiny" if args.quick else "opt-125m",
        "layers": config.num_hidden_layers,
        "batch": args.batch,
        "seq": args.seq,
        "mode": args.mode,
        "threads": torch.get_num_threads(),
    }
    for path, s in samples.items():
        timer = Timer(s)
        report.measurements.append(
            Measurement.from_timer(
                f"step_{path}",
                params | {"path": path, "noise_backend": engines[path].noise.backend},
                timer,
                {"tokens_per_s": args.batch * args.seq / timer.median},
            )
        )
        print(
            f"step {path:4s} ({engines[path].noise.backend:6s}) {timer.median * 1e3:9.1f} ms  "
            f"spread {timer.spread:.2f}"
        )
    report.derived["step_new_over_old_speed"] = (
        Timer(samples["old"]).median / Timer(samples["new"]).median
    )
    if "lowrank" in samples:
        report.derived["step_lowrank_over_new_time"] = (
            Timer(samples["lowrank"]).median / Timer(samples["new"]).median
        )


def build_parser() -> argparse.ArgumentParser:
    """The command line alone: gpu_session.sh's flags are checked against it without a GPU."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="small sizes, 2 repeats: seconds (CI)")
    p.add_argument(
        "--elements",
        type=at_least(1),
        default=None,
        help="bucket size per op (default 16 M; quick 64 k)",
    )
    p.add_argument(
        "--chunk",
        type=at_least(1),
        default=1 << 22,
        help="noise_chunk (the engine default; legacy draws chunks this long)",
    )
    p.add_argument(
        "--repeats",
        type=at_least(1),
        default=None,
        help="timed repeats per op (default 5; quick 2)",
    )
    p.add_argument(
        "--skip-torch", action="store_true", help="leave out the torch implementation (slow on CPU)"
    )
    p.add_argument("--layers", type=at_least(1), default=4)
    p.add_argument("--batch", type=at_least(1), default=8)
    p.add_argument("--seq", type=at_least(2), default=None, help="default 128; quick 16")
    p.add_argument(
        "--steps", type=at_least(1), default=None, help="timed steps per path (default 5; quick 2)"
    )
    p.add_argument("--mode", default="resident", choices=["resident", "offload"])
    p.add_argument(
        "--threads", type=at_least(1), default=None, help="CPU threads (default: torch's)"
    )
    p.add_argument(
        "--lowrank", action="store_true", help="also time LOZO's low-rank noise (path lowrank)"
    )
    p.add_argument("--lozo-rank", type=at_least(1), default=2, help="the low-rank noise's rank")
    p.add_argument(
        "--lowrank-cols", type=at_least(1), default=768, help="the width of the ops' matrices"
    )
    p.add_argument(
        "--warps",
        type=counts(1),
        default="",
        help="comma-separated num_warps to time every fused kernel with too, beside the "
        "engine's launch options (triton_noise.LAUNCH_OPTIONS): path new_w<N> (CUDA; the same "
        "bits, another launch shape)",
    )
    p.add_argument(
        "--ops",
        default="",
        help="comma-separated ops to time (default: every op, then the step; name `step` "
        f"for the step): {', '.join(BYTES)}",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/noise.json"))
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with the quick run's and the ops' defaults resolved; a bad op or a
    ``--warps`` without CUDA is refused here, before any work."""
    p = build_parser()
    args = p.parse_args(argv)
    args.ops = [op for op in args.ops.split(",") if op] or [*BYTES, "step"]
    unknown = [op for op in args.ops if op not in BYTES and op != "step"]
    if unknown:
        p.error(f"--ops: no op {', '.join(unknown)}; pick from {', '.join(BYTES)} or step")
    args.with_step = "step" in args.ops
    args.ops = [op for op in args.ops if op != "step"]
    args.elements = args.elements or (1 << 16 if args.quick else 1 << 24)
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.steps = args.steps or (2 if args.quick else 5)
    args.seq = args.seq or (16 if args.quick else 128)
    if args.quick:
        args.batch = min(args.batch, 2)
    args.device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else "cpu"
        if args.device == "auto"
        else args.device
    )
    if args.warps and args.device.type != "cuda":
        p.error("--warps times the Triton kernels' launches on a GPU: run it with CUDA")
    return args


def main() -> None:
    args = parse_args()
    device = args.device
    if args.threads:
        torch.set_num_threads(args.threads)
    LOWRANK.update(rank=args.lozo_rank, cols=args.lowrank_cols)
    report = BenchReport("throughput", device_name(device), 1)
    measure_ops(args, device, report)
    if args.with_step:
        measure_steps(args, device, report)
    report.write(
        args.out,
        ["op", "path", "elements", "elements_per_s", "gb_per_s", "of_copy", "tokens_per_s"],
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
