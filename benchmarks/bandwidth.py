"""Upload/offload bandwidth of the engine's own transfer code, beside the link's ceiling.

    python benchmarks/bandwidth.py [--quick] [--shapes opt-1.3b,opt-13b] [--bytes 64MB,1GB]
    torchrun --nproc_per_node=N benchmarks/bandwidth.py      # adds sliced and the all-gather

For each block size (a model's layer, 12*d^2 parameters, or raw bytes) and transfer
dtype it times, through ``StreamedBlocks`` (the code the engine runs): upload and
offload, naive and (with N > 1 ranks) sliced. In the same run it times the ceiling:
a bare pinned ``copy_`` of the same bytes host->device, device->host and both at once,
pageable copies for contrast, time(M/n)*n/time(M) for slices, and the all-gather alone.
Writes JSON (schema: distzo/bench/records.py), a Markdown table and, with matplotlib
installed (extra ``bench``), a PNG plot.
"""

from __future__ import annotations

import argparse
import functools
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from distzo.bench import BenchReport, Measurement, time_repeated
from distzo.bench.arguments import at_least, byte_size
from distzo.dist import Collectives, LaunchEnv
from distzo.dist import process_group as pg
from distzo.models.shapes import OPT_SHAPES
from distzo.offload import BucketLayout, Shard, StreamedBlocks
from distzo.offload.low_bit import TRANSFER_DTYPES
from distzo.runtime.devices import device_name
from distzo.zo import NoiseSource

logger = logging.getLogger("bandwidth")

# Hidden sizes d of the models whose layer (12*d^2 parameters) is a default block size.
LAYER_WIDTHS = {"tiny": 128, **{name: shape[0] for name, shape in OPT_SHAPES.items()}}


def parse_bytes(text: str) -> int:
    """A ``--bytes`` size (``64MB``, ``1GiB``), refused in one line where it is none or
    holds no fp32 element."""
    try:
        size = byte_size(text)
    except ValueError as exc:
        raise SystemExit(f"error: --bytes: {exc}") from None
    if size < 4:
        raise SystemExit(f"error: --bytes: {text!r} holds no fp32 element (4 bytes)")
    return size


def block_sizes(args: argparse.Namespace, device: torch.device) -> list[tuple[str, int]]:
    """(label, fp32 elements) of each block size to measure."""
    if args.bytes:
        return [(b, parse_bytes(b) // 4) for b in args.bytes.split(",")]
    if args.shapes:
        names = args.shapes.split(",")
    elif args.quick:
        names = ["tiny"]
    else:  # the 175B layer (7.2 GB in fp32) does not fit a small CPU box several times over
        names = (
            ["opt-1.3b", "opt-13b", "opt-175b"]
            if device.type == "cuda"
            else ["opt-125m", "opt-1.3b"]
        )
    for name in names:
        if name not in LAYER_WIDTHS:
            raise SystemExit(
                f"error: unknown shape {name!r}; choose from {', '.join(LAYER_WIDTHS)}"
            )
    return [(name, 12 * LAYER_WIDTHS[name] ** 2) for name in names]


def rates(nbytes: int, numel: int, seconds: float) -> dict[str, float]:
    return {"gb_per_s": nbytes / seconds / 1e9, "gparams_per_s": numel / seconds / 1e9}


class Bench:
    def __init__(
        self, args: argparse.Namespace, env: LaunchEnv, device: torch.device, shard: Shard | None
    ) -> None:
        self.args, self.env, self.device, self.shard = args, env, device, shard
        self.report = BenchReport("bandwidth", device_name(device), env.world_size)
        self.pinned = device.type == "cuda"

    def barrier(self) -> None:
        if self.env.world_size > 1:
            dist.barrier()

    def timed(self, name: str, params: dict, fn, nbytes: int, numel: int) -> Measurement:
        self.barrier()  # every rank starts together: naive copies contend as they would in training
        timer = time_repeated(fn, self.device, self.args.repeats, warmup=1)
        m = Measurement.from_timer(name, params, timer, rates(nbytes, numel, timer.median))
        self.report.measurements.append(m)
        logger.info(
            "%-22s %-28s %8.3f ms %8.2f GB/s",
            name,
            params,
            timer.median * 1e3,
            m.metrics["gb_per_s"],
        )
        return m

    def engine_transfers(self, label: str, numel: int, dtype_name: str) -> None:
        dtype = TRANSFER_DTYPES[dtype_name]
        layout, _ = BucketLayout.build(
            [(("block",), nn.Parameter(torch.empty(numel, device="meta")))]
        )
        modes = [("naive", None)] + ([("sliced", self.shard)] if self.shard is not None else [])
        for transfer, shard in modes:
            rounding = (
                NoiseSource(0, 1 << 22, self.device, torch.float32, "uniform")
                if dtype_name != "fp32"
                else None
            )
            store = StreamedBlocks(
                [layout], self.device, 1, None if dtype_name == "fp32" else dtype, shard, rounding
            )
            params = {"size": label, "numel": numel, "dtype": dtype_name, "transfer": transfer}
            wire_bytes = numel * dtype.itemsize  # the whole block reaches / leaves the device
            up = self.timed(
                "engine_upload", params, functools.partial(store.upload, 0), wire_bytes, numel
            )
            off = self.timed(
                "engine_offload", params, functools.partial(store.offload, 0), wire_bytes, numel
            )
            key = f"{label}/{dtype_name}/{transfer}"
            self.ceiling_ratio(f"upload_vs_bare_h2d[{key}]", up, f"{label}/{dtype_name}/h2d")
            self.ceiling_ratio(f"offload_vs_bare_d2h[{key}]", off, f"{label}/{dtype_name}/d2h")
            del store  # release this block's buffers before the next mode allocates its own

    def ceiling_ratio(self, name: str, engine: Measurement, bare_key: str) -> None:
        bare = self._bare.get(bare_key)
        if bare is not None:
            self.report.derived[name] = bare.median_s / engine.median_s

    def bare_copies(self, label: str, numel: int, dtype_name: str) -> None:
        dtype = TRANSFER_DTYPES[dtype_name]
        nbytes = numel * dtype.itemsize
        device_buf = torch.empty(numel, dtype=dtype, device=self.device)
        params = {"size": label, "numel": numel, "dtype": dtype_name}
        for pinned in [True, False] if self.pinned else [False]:
            host = torch.empty(numel, dtype=dtype, pin_memory=pinned)
            kind = "pinned" if pinned else "pageable"
            h2d = self.timed(
                f"bare_h2d_{kind}",
                params,
                lambda: device_buf.copy_(host, non_blocking=True),
                nbytes,
                numel,
            )
            d2h = self.timed(
                f"bare_d2h_{kind}",
                params,
                lambda: host.copy_(device_buf, non_blocking=True),
                nbytes,
                numel,
            )
            if pinned or not self.pinned:  # the ceiling: pinned on CUDA, the only kind on CPU
                self._bare[f"{label}/{dtype_name}/h2d"] = h2d
                self._bare[f"{label}/{dtype_name}/d2h"] = d2h
        if self.pinned:
            up_host = torch.empty(numel, dtype=dtype, pin_memory=True)
            down_host = torch.empty(numel, dtype=dtype, pin_memory=True)
            other = torch.empty(numel, dtype=dtype, device=self.device)
            streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))

            def both() -> None:
                with torch.cuda.stream(streams[0]):
                    device_buf.copy_(up_host, non_blocking=True)
                with torch.cuda.stream(streams[1]):
                    down_host.copy_(other, non_blocking=True)

            self.timed("bare_h2d_and_d2h", params, both, 2 * nbytes, 2 * numel)

    def slice_linearity(self, label: str, numel: int) -> None:
        """time(M/n) * n / time(M) of bare pinned uploads: 1.0 means slicing costs nothing."""
        full = self._bare.get(f"{label}/fp32/h2d")
        if full is None:
            return
        for n in (2, 4, 8):
            part = numel // n
            device_buf = torch.empty(part, device=self.device)
            host = torch.empty(part, pin_memory=self.pinned)
            m = self.timed(
                "bare_h2d_slice",
                {"size": label, "numel": part, "dtype": "fp32", "n": n},
                lambda: device_buf.copy_(host, non_blocking=True),
                part * 4,
                part,
            )
            self.report.derived[f"slice_time_ratio[{label}/n={n}]"] = m.median_s * n / full.median_s

    def all_gather(self, label: str, numel: int) -> None:
        if self.shard is None:
            return
        n = self.shard.size
        out = torch.empty(numel // n * n, device=self.device)
        piece = out[self.shard.rank * (numel // n) : (self.shard.rank + 1) * (numel // n)]
        self.timed(
            "all_gather",
            {"size": label, "numel": out.numel(), "dtype": "fp32", "n": n},
            lambda: dist.all_gather_into_tensor(out, piece, group=self.shard.group),
            out.numel() * 4,
            out.numel(),
        )

    def run(self) -> BenchReport:
        self._bare: dict[str, Measurement] = {}
        dtypes = self.args.dtypes.split(",")
        for name in dtypes:
            if name not in TRANSFER_DTYPES:
                raise SystemExit(
                    f"error: unknown dtype {name!r}; choose from {', '.join(TRANSFER_DTYPES)}"
                )
        for label, numel in block_sizes(self.args, self.device):
            for dtype_name in dtypes:
                self.bare_copies(label, numel, dtype_name)
                self.engine_transfers(label, numel, dtype_name)
            self.slice_linearity(label, numel)
            self.all_gather(label, numel)
        return self.report


def plot(data: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib not installed (pip install -e '.[bench]'): no plot")
        return
    rows = [m for m in data["measurements"] if "gb_per_s" in m["metrics"]]
    labels = [
        f"{m['name']}\n{m['params'].get('size')}/{m['params'].get('dtype')}/"
        f"{m['params'].get('transfer', '')}"
        for m in rows
    ]
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(rows)), 4))
    ax.bar(range(len(rows)), [m["metrics"]["gb_per_s"] for m in rows])
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
    ax.set_ylabel("GB/s")
    ax.set_title(f"bandwidth on {data['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    """The command line alone: gpu_session.sh's flags are checked against it without a GPU."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="tiny block, few repeats: seconds (CI)")
    p.add_argument(
        "--shapes", default=None, help=f"layer shapes, comma-separated: {', '.join(LAYER_WIDTHS)}"
    )
    p.add_argument("--bytes", default=None, help="raw fp32 block sizes instead, e.g. 64MB,1GB,1GiB")
    p.add_argument(
        "--dtypes", default=None, help="transfer dtypes (default fp32,bf16; quick: fp32,bf16)"
    )
    p.add_argument(
        "--repeats",
        type=at_least(1),
        default=None,
        help="timed repeats per measurement (default 10; quick 3)",
    )
    p.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK if CUDA), cpu or cuda:N")
    p.add_argument(
        "--out", default="benchmarks/out/bandwidth.json", help="JSON path; .md and .png beside it"
    )
    return p


def main() -> None:
    args = build_parser().parse_args()
    if args.bytes:  # before the process group and the first copy
        for size in args.bytes.split(","):
            parse_bytes(size)
    args.repeats = args.repeats or (3 if args.quick else 10)
    args.dtypes = args.dtypes or "fp32,bf16"
    env = LaunchEnv.from_environ()
    logging.basicConfig(
        level=logging.INFO if env.rank == 0 else logging.WARNING, format="%(message)s"
    )
    cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device(
        f"cuda:{env.local_rank}"
        if args.device == "auto" and cuda
        else ("cpu" if not cuda else args.device)
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shard = None
    if env.launched:
        pg.init_process_group(env, pg.resolve_backend("auto", device), timeout_s=600)
        comm = Collectives.for_job(device)
        group, members = pg.node_groups(env, comm)
        if len(members) > 1:
            shard = Shard(group, members.index(env.rank), len(members), comm)
    report = Bench(args, env, device, shard).run()
    if env.rank == 0:
        out = Path(args.out)
        data = report.write(out, ["size", "dtype", "transfer", "n", "gb_per_s", "gparams_per_s"])
        plot(data, out.with_suffix(".png"))
        logger.info("wrote %s, %s", out, out.with_suffix(".md"))
    pg.shutdown()


if __name__ == "__main__":
    main()
