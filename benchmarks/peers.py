"""distzo against ZO2 on the same machine: every system in a process of its own (a peer),
the same model, batch and dtype, steps interleaved between them.

    python benchmarks/peers.py --shape opt-1.3b --batch 1 --seq 2048 --dtype fp16 \\
        --zo2 .peers/zo2 --zo2-python python3 --zo2-pythonpath /tmp/site451
    python benchmarks/peers.py --shape opt-125m --layers 4 --hidden 256 --batch 4 --seq 128 \\
        --device cpu --threads 1 --zo2 ../zo2 --zo2-python ../zo2-venv/bin/python
    python benchmarks/peers.py --shape opt-13b ... --one-at-a-time   # two copies do not fit
    python benchmarks/peers.py --shape qwen3-8b --batch 1 --seq 2048 --dtype fp16 --zo2 ...

Systems: ``zo2-mezo`` (ZO2's ``zo2=False``: its MeZO-SGD step, the model on the device),
``zo2-offload`` (``zo2=True``: its CPU offload on three CUDA streams; CUDA only), both
from the ZO2 checkout given by ``--zo2`` and run by ``benchmarks/peer_zo2.py`` under
``--zo2-python`` (ZO2 needs transformers 4.51); ``distzo-resident``, ``distzo-offload``
(float32 masters), ``distzo-offload-recompute`` (the same steps with a low-bit link, the
block's float32 master rebuilt a chunk at a time instead of held in a block-sized buffer),
``distzo-offload-double`` (the same steps, the master's upcast and rounding on the
upload and offload streams, in two buffers; asked for by ``--systems`` only),
``distzo-offload-half`` (with a 16-bit ``--dtype``: the masters in it, as ZO2 holds its
model) and, where there are 2 CUDA devices, ``distzo-sliced`` (2 ranks under torchrun), run
by ``benchmarks/peer_distzo.py``; and any ``--peer NAME=CMD`` speaking the protocol.

The protocol (the harness's contract with a peer; ``distzo/bench/peer_protocol.py``
holds it in full): the peer is launched as ``CMD --system NAME --shape SHAPE [--layers L]
[--hidden H] --batch B --seq T --dtype {fp32,fp16,bf16} --device {cpu,cuda} --seed S
--threads K``, builds its model (random init, the OPT or Qwen3 shape as ZO2's speed
tests build it, ``distzo/bench/peer_models.py``: ``tie_word_embeddings=False`` and
``max_position_embeddings = T``; ``--hidden`` sets OPT's ffn to 4 H and its heads to
H / 64, Qwen3's ffn to 3 H and its heads to H / 128 of head_dim 128, kv heads
gcd(H / 128, the shape's)) and writes one JSON line ``{"ready": true, "system",
"parameters", "build_s"}``. For each stdin line ``{"steps": k}`` it runs k steps on one
fixed B x T batch of token ids (labels = the ids: the causal-LM loss) and writes one line
``{"step_s": [k wall times, device synced before and after each], "loss",
"peak_rss_bytes" (VmHWM), "peak_device_bytes" (the CUDA allocator's peak since the
request began, else null), "device_used_bytes" (total - free at the request's end, else
null)}``. An error is ``{"error": "one line"}`` and exit 1; EOF on stdin: exit 0. Logs go
to stderr, which the harness echoes with the peer's name.

Method: every peer is built, takes ``--warmup`` untimed steps, then ``--rounds`` rounds in
which each peer in turn takes ``--steps-per-round`` steps (``--one-at-a-time``: one peer
after another, started, measured and stopped). The statistic is ZO2's
(``record_zo2_speed.sh``): the mean of the per-step tokens/s (B x T / step time) over
the last half of the timed steps (30 by default); the median is reported beside it.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from distzo.bench import BenchReport, Measurement, Timer
from distzo.bench.kernel_profile import SUFFIX as PROFILE_SUFFIX
from distzo.bench.kernel_profile import write_comparison
from distzo.bench.peer_models import PEER_SHAPES, check_hidden, peer_dims
from distzo.bench.peer_process import PeerError, PeerProcess, kill_all
from distzo.bench.peer_progress import PeerProgress, await_ready
from distzo.bench.phases import BOUND_WORDS, bound_by, describe_phases
from distzo.config.engine_checks import PERTURB_SCOPES
from distzo.runtime.devices import device_name

HERE = Path(__file__).resolve().parent
ZO2_SYSTEMS = ("zo2-mezo", "zo2-offload")
# masters in --dtype, as ZO2 holds its model: only a 16-bit --dtype makes it another system
HALF = "distzo-offload-half"
# distzo-offload without the block-sized float32 master (a low-bit link only)
RECOMPUTE = "distzo-offload-recompute"
# distzo-offload with the master's upcast and rounding off the compute stream (a low-bit link only)
DOUBLE = "distzo-offload-double"
# the systems whose low-bit link has a float32 master to place otherwise
LOW_BIT_ONLY = (RECOMPUTE, DOUBLE)
DISTZO_SYSTEMS = ("distzo-resident", "distzo-offload", RECOMPUTE, DOUBLE, HALF, "distzo-sliced")
BUILTIN = ZO2_SYSTEMS + DISTZO_SYSTEMS
# (numerator, denominator) of every ratio reported when both systems ran
PAIRS = (
    ("distzo-offload", "zo2-mezo"),
    ("distzo-offload", "zo2-offload"),
    ("distzo-resident", "zo2-mezo"),
    ("distzo-offload", "distzo-resident"),
    ("zo2-offload", "zo2-mezo"),
    ("distzo-sliced", "distzo-offload"),
    (RECOMPUTE, "zo2-offload"),
    (RECOMPUTE, "distzo-offload"),
    (DOUBLE, "zo2-offload"),
    (DOUBLE, "distzo-offload"),
    (DOUBLE, "distzo-resident"),
    (HALF, "zo2-offload"),
    (HALF, "distzo-offload"),
)
# The targets of distzo's offloaded step, by device: on CPU 2x ZO2's MeZO step; on a GPU
# 1.2x ZO2's offload and 0.97x resident (ZO2's paper's overlap, where compute >= transfer),
# at or below ZO2 offload's peak device memory. Each is reported met or missed; a missed
# speed target names the phase that bounds the offloaded step.
TARGETS = {
    "cpu": {("distzo-offload", "zo2-mezo"): 2.0},
    "cuda": {
        ("distzo-offload", "zo2-offload"): 1.2,
        (RECOMPUTE, "zo2-offload"): 1.2,
        (DOUBLE, "zo2-offload"): 1.2,
        ("distzo-offload", "distzo-resident"): 0.97,
        (DOUBLE, "distzo-resident"): 0.97,
    },
}
# peak device memory, at most; distzo-offload-half is the comparison at ZO2's precision
MEMORY_TARGETS = {
    "cuda": {
        ("distzo-offload", "zo2-offload"): 1.0,
        (RECOMPUTE, "zo2-offload"): 1.0,
        (DOUBLE, "zo2-offload"): 1.0,
        (HALF, "zo2-offload"): 1.0,
    }
}
NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
COLUMNS = [
    "tokens_per_s",
    "tokens_per_s_median",
    "s_per_step",
    "peak_device_gb",
    "device_used_gb",
    "process_device_gb",
    "peak_host_rss_gb",
    "parameters",
    "loss",
]

METHOD = """\
Method. Each system runs in a process of its own (a peer) on the same random-init model of
the shape (the config ZO2's speed test builds, OPT or Qwen3: its widths, the head untied,
positions = the sequence length), the same fixed batch of token ids (labels = the ids) and
the same compute dtype. After every peer is built it takes the warm-up steps untimed;
then, in each round, every peer in turn takes its steps, so that drift of the machine's
speed hits all of them alike (unless the notes say the peers ran one at a time). tokens/s
is ZO2's statistic (test/mezo_sgd/hf_opt/record_zo2_speed.sh, hf_qwen3's the same: the
mean of the per-step B x T / step time over the last half of the timed steps); tokens/s
median is B x T over the median step of that half. Peak device memory is the CUDA
allocator's peak of the peer's process; device used is total - free of the whole device at
the end of each request (what nvidia-smi shows, ZO2's README's figure), the most over the
run; process device memory is what NVML lists for the peer's own process at the end of
each request (nvidia-smi's per-process figure: its CUDA context and allocator reserve),
the most over the run, comparable with ZO2's README in an interleaved run too; peak host
RSS is the peer's VmHWM (rank 0's for a launch of several ranks), the build included: ZO2
builds its MeZO model in host memory before moving it to the device, distzo fills its
buckets one at a time.

Where this differs from ZO2's own harness (test_speed.py): (1) every step is timed with
perf_counter between two device syncs; ZO2's check_throughput reads time.time() around
model(...) without a sync. Its offload step (zo2=True, optimizer/mezo_sgd/zo2.py) syncs
the device before and after its passes and ends in a .item() read, so its own timing is
synchronous too; its MeZO step (zo2=False, zo.py) ends its timed region at the .item() of
the projected gradient, and the kernels it queues after that read (restoring the weights,
the update) run into the next step's time: synced here, they count in the step that queued
them (the mean over many steps is the same but for one step's tail). (2) ZO2 times 30
steps from a cold start and averages the last 15; here the warm-up steps run first, then
the timed steps, and the mean is over the last half of those. (3) ZO2's script measures
one system per process run; here the systems' steps interleave. (4) In an interleaved run
the device used memory counts every peer on the device: compare it with ZO2's README only
from a run with --one-at-a-time, or compare the process device memory. (5) distzo keeps
float32 masters (on the device when resident) and, offloaded, a host copy in the compute
dtype (stochastically rounded), where ZO2 keeps the whole model in the compute dtype;
ZO2's weight decay spares the parameters whose names hold bias, layer_norm, layernorm or
ln (OPT's biases and layer norms; Qwen3's two norms of each layer, not its q_norm, k_norm
or final norm), distzo's applies to matrices: both 0.1, as ZO2's speed test.
"""


@dataclass
class System:
    """How to launch one peer: ``command``, then the protocol's arguments, then ``extra``."""

    name: str
    command: list[str]
    extra: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None
    ranks: int = 1


@dataclass
class Run:
    """What one peer reported: its ready line, its timed steps in order, every reply."""

    system: System
    ready: dict[str, Any]
    samples: list[float] = field(default_factory=list)
    replies: list[dict[str, Any]] = field(default_factory=list)
    phases: dict[str, float] | None = None  # where distzo's step goes, after the timed steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    check_args(args)
    return args


def build_parser() -> argparse.ArgumentParser:
    """The command line alone: gpu_session.sh's flags are checked against it without a GPU."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="opt-1.3b", choices=PEER_SHAPES)
    p.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    p.add_argument(
        "--hidden",
        type=int,
        default=None,
        help="override the width: OPT ffn 4 H, H / 64 heads; Qwen3 ffn 3 H, H / 128 heads",
    )
    p.add_argument("--batch", type=int, default=1, help="batch (default 1, ZO2's)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048, ZO2's)")
    p.add_argument(
        "--dtype",
        choices=("fp32", "fp16", "bf16"),
        default=None,
        help="compute dtype (default fp16 on CUDA, ZO2's; fp32 on CPU)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--seed", type=int, default=42, help="weights and batch (ZO2's test: 42)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per peer (CPU)")
    p.add_argument("--systems", default=None, help="comma-separated (default: all that can run)")
    p.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="NAME=CMD",
        help="another peer speaking the protocol (repeatable)",
    )
    p.add_argument(
        "--ratio",
        action="append",
        default=[],
        metavar="A/B",
        help="also report A's tokens/s and memory over B's (repeatable)",
    )
    p.add_argument("--zo2", default=None, help="a clone of liangyuwang/zo2 (never vendored)")
    p.add_argument("--zo2-python", default=None, help="ZO2's interpreter (transformers 4.51)")
    p.add_argument(
        "--zo2-pythonpath",
        default=None,
        help="PYTHONPATH of the ZO2 peer alone (e.g. a --target dir of transformers 4.51 "
        "wheels); the harness's own PYTHONPATH is not passed on to it",
    )
    p.add_argument(
        "--distzo-transfer-dtype",
        choices=("fp32", "fp16", "bf16"),
        default=None,
        help="distzo offload's host copy and link dtype (default: --dtype)",
    )
    p.add_argument(
        "--distzo-perturb-scope",
        choices=PERTURB_SCOPES,
        default="block",
        help="distzo's passes hold a block perturbed whole, or one module at a time (the same "
        "steps, a scratch the size of the largest module)",
    )
    p.add_argument(
        "--distzo-profile-dir",
        default=None,
        help="each distzo peer also profiles one step after its phases: its kernels per "
        "stream and its Chrome trace there, and the systems side by side in kernels.md",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per peer first")
    p.add_argument("--rounds", type=int, default=30, help="rounds of timed steps")
    p.add_argument("--steps-per-round", type=int, default=1, help="each peer's steps per round")
    p.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="start, measure and stop the peers one after another (no interleaving)",
    )
    p.add_argument("--out", default=None, help="JSON report (default benchmarks/results/...)")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Every option, before any peer starts: one line naming the problem and the fix."""
    cuda = torch.cuda.is_available()
    args.device = args.device or ("cuda" if cuda else "cpu")
    if args.device == "cuda" and not cuda:
        raise SystemExit("peers.py: --device cuda, but torch sees no CUDA device here")
    args.dtype = args.dtype or ("fp16" if args.device == "cuda" else "fp32")
    for name in ("batch", "threads", "rounds", "steps_per_round"):
        if getattr(args, name) < 1:
            raise SystemExit(f"peers.py: --{name.replace('_', '-')} must be >= 1")
    if args.seq < 2:
        raise SystemExit("peers.py: --seq must be >= 2 (the loss predicts token t+1 from t)")
    if args.warmup < 0:
        raise SystemExit("peers.py: --warmup must be >= 0")
    if args.layers is not None and args.layers < 1:
        raise SystemExit("peers.py: --layers must be >= 1")
    if args.hidden is not None:
        try:
            check_hidden(args.shape, args.hidden)
        except ValueError as exc:
            raise SystemExit(f"peers.py: {exc}") from None
    if args.zo2 is not None:
        marker = Path(args.zo2) / "zo2" / "optimizer" / "mezo_sgd" / "zo2.py"
        if not marker.is_file():
            raise SystemExit(
                f"peers.py: --zo2 {args.zo2} is not a ZO2 checkout (no {marker}); clone "
                "liangyuwang/zo2 and pass its folder"
            )
        args.zo2_python = args.zo2_python or sys.executable
        if shutil.which(args.zo2_python) is None:
            raise SystemExit(
                f"peers.py: --zo2-python {args.zo2_python} is not an executable interpreter"
            )
        if not (HERE / "peer_zo2.py").is_file():
            raise SystemExit(f"peers.py: {HERE / 'peer_zo2.py'} (the ZO2 peer) is missing")
    elif args.zo2_python or args.zo2_pythonpath:
        raise SystemExit("peers.py: --zo2-python and --zo2-pythonpath need --zo2 PATH")
    if args.distzo_profile_dir and any(Path(args.distzo_profile_dir).glob(f"*{PROFILE_SUFFIX}")):
        raise SystemExit(
            f"peers.py: --distzo-profile-dir {args.distzo_profile_dir} already holds profiles "
            "of another run: name a new directory"
        )


def protocol_args(args: argparse.Namespace, name: str) -> list[str]:
    out = ["--system", name, "--shape", args.shape]
    out += ["--layers", str(args.layers)] if args.layers else []
    out += ["--hidden", str(args.hidden)] if args.hidden else []
    out += ["--batch", str(args.batch), "--seq", str(args.seq), "--dtype", args.dtype]
    out += ["--device", args.device, "--seed", str(args.seed), "--threads", str(args.threads)]
    return out


def builtin_system(args: argparse.Namespace, name: str) -> System:
    if name in ZO2_SYSTEMS:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        if args.zo2_pythonpath:
            env["PYTHONPATH"] = args.zo2_pythonpath
        command = [args.zo2_python, str(HERE / "peer_zo2.py"), "--zo2", args.zo2]
        return System(name, command, env=env)
    extra = ["--transfer-dtype", args.distzo_transfer_dtype] if args.distzo_transfer_dtype else []
    extra += ["--perturb-scope", args.distzo_perturb_scope]
    if args.distzo_profile_dir:
        extra += ["--profile-dir", str(Path(args.distzo_profile_dir).resolve())]
    runner = str(HERE / "peer_distzo.py")
    if name == "distzo-sliced":
        launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        return System(name, [sys.executable, *launch, runner], extra, ranks=2)
    return System(name, [sys.executable, runner], extra)


def parse_peers(specs: list[str]) -> dict[str, list[str]]:
    peers: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, command = spec.partition("=")
        if not sep or not NAME.match(name) or not command.strip():
            raise SystemExit(
                f"peers.py: --peer {spec!r} is not NAME=CMD (NAME in lower-case letters, digits, "
                "'.', '_', '-')"
            )
        if name in BUILTIN or name in peers:
            raise SystemExit(f"peers.py: --peer {name}: that system is already defined")
        peers[name] = shlex.split(command)
    return peers


def distzo_wire(args: argparse.Namespace) -> str:
    """The dtype distzo's offloaded blocks rest and travel in."""
    return str(args.distzo_transfer_dtype or args.dtype)


def choose_systems(args: argparse.Namespace) -> tuple[list[System], list[str]]:
    """The systems to run, in round order, and the notes on those left out."""
    peers = parse_peers(args.peer)
    notes: list[str] = []
    cuda_devices = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.systems is None:
        names = list(ZO2_SYSTEMS if args.zo2 else ()) + ["distzo-resident", "distzo-offload"]
        if distzo_wire(args) != "fp32":
            names.append(RECOMPUTE)
        else:
            notes.append(f"{RECOMPUTE} did not run: an fp32 link has no low-bit master to rebuild")
        if args.dtype != "fp32":
            names.append(HALF)
        else:
            notes.append(f"{HALF} did not run: at fp32 its masters are distzo-offload's")
        if cuda_devices >= 2:
            names.append("distzo-sliced")
        else:
            notes.append(
                "distzo-sliced did not run: it needs 2 CUDA devices "
                f"({'found ' + str(cuda_devices) if args.device == 'cuda' else 'a CPU run'})"
            )
        names += list(peers)
    else:
        names = [n.strip() for n in args.systems.split(",") if n.strip()]
        for name in names:
            if name not in BUILTIN and name not in peers:
                known = ", ".join([*BUILTIN, *peers])
                raise SystemExit(f"peers.py: --systems: unknown system {name!r}; known: {known}")
            if name in ZO2_SYSTEMS and not args.zo2:
                raise SystemExit(
                    f"peers.py: --systems {name} needs --zo2 PATH (a clone of liangyuwang/zo2)"
                )
        if len(set(names)) != len(names):
            raise SystemExit(f"peers.py: --systems names a system twice: {args.systems}")
        if HALF in names and args.dtype == "fp32":
            raise SystemExit(
                f"peers.py: --systems {HALF} keeps the masters in --dtype, and at fp32 it is "
                "distzo-offload: use --dtype fp16 or bf16, or drop it"
            )
        low_bit_only = [n for n in names if n in LOW_BIT_ONLY]
        if low_bit_only and distzo_wire(args) == "fp32":
            raise SystemExit(
                f"peers.py: --systems {low_bit_only[0]} places the master of a block that "
                "travels in 16 bits: use --dtype fp16 or bf16 (or --distzo-transfer-dtype), or "
                "drop it"
            )
        if "distzo-sliced" in names and args.device == "cuda" and cuda_devices < 2:
            names.remove("distzo-sliced")
            notes.append(
                f"distzo-sliced did not run: it needs 2 CUDA devices (found {cuda_devices})"
            )
    if not args.zo2:
        notes.append("ZO2 was not given (--zo2): only the other systems ran")
    if "zo2-offload" in names and args.device != "cuda":
        names.remove("zo2-offload")
        notes.append("zo2-offload did not run: ZO2's offload needs CUDA (three CUDA streams)")
    if args.distzo_perturb_scope == "module" and any(n in DISTZO_SYSTEMS for n in names):
        notes.append(
            "distzo's passes perturbed each block module by module (--distzo-perturb-scope "
            "module): the same steps, a scratch the size of the largest module"
        )
    if not names:
        raise SystemExit("peers.py: no system left to run; name some with --systems or --peer")
    for ratio in args.ratio:
        a, sep, b = ratio.partition("/")
        if not sep or a not in names or b not in names or a == b:
            raise SystemExit(f"peers.py: --ratio {ratio!r} is not A/B of two systems that run")
    systems = [System(n, peers[n]) if n in peers else builtin_system(args, n) for n in names]
    return systems, notes


def launch(args: argparse.Namespace, system: System) -> PeerProcess:
    command = system.command + protocol_args(args, system.name) + system.extra
    print(f"peers.py: starting {system.name}: {shlex.join(command)}", file=sys.stderr)
    return PeerProcess(system.name, command, system.env)


def measure(peer: PeerProcess, run: Run, steps: int, timed: bool) -> None:
    reply = peer.request(steps)
    run.replies.append(reply)
    if timed:
        run.samples += reply["step_s"]


def ask_phases(peer: PeerProcess, run: Run) -> None:
    """distzo's peers say where their step's time goes (four more steps, untimed)."""
    if run.system.name in DISTZO_SYSTEMS:
        run.phases = peer.phases()


def measure_interleaved(
    args: argparse.Namespace,
    systems: list[System],
    runs: list[Run],
    progress: PeerProgress,
    live: list[PeerProcess],
) -> list[Run]:
    """Every peer built at once, then their steps in turns; ``runs`` fills as they run
    (what a run stopped at its limit had measured) and ``live`` holds the peers started,
    which the caller ends."""
    for system in systems:  # all build at once
        live.append(launch(args, system))
    ready = await_ready(live, progress)
    runs += [Run(system, ready[system.name]) for system in systems]
    progress.stepping = [s.name for s in systems]
    if args.warmup:
        for peer, run in zip(live, runs):
            measure(peer, run, args.warmup, timed=False)
    for _ in range(args.rounds):
        for peer, run in zip(live, runs):
            measure(peer, run, args.steps_per_round, timed=True)
    progress.measured = [s.name for s in systems]
    for peer, run in zip(live, runs):
        ask_phases(peer, run)
    for peer in live:
        peer.close()
    return runs


def measure_one_at_a_time(
    args: argparse.Namespace,
    systems: list[System],
    runs: list[Run],
    progress: PeerProgress,
    done: Callable[[list[Run]], object],
    live: list[PeerProcess],
) -> list[Run]:
    """One peer after another; ``done`` gets the runs so far after each (a partial report
    survives a run stopped at its time limit). ``live`` holds the peer under way, which
    the caller ends if it fails or the run is stopped."""
    for system in systems:
        peer = launch(args, system)
        live.append(peer)
        ready = await_ready([peer], progress)[system.name]
        run = Run(system, ready)
        progress.stepping.append(system.name)
        if args.warmup:
            measure(peer, run, args.warmup, timed=False)
        for _ in range(args.rounds):
            measure(peer, run, args.steps_per_round, timed=True)
        ask_phases(peer, run)
        peer.close()
        live.remove(peer)
        runs.append(run)
        progress.measured.append(system.name)
        done(runs)
    return runs


def most(replies: list[dict[str, Any]], key: str) -> int | None:
    values = [r[key] for r in replies if r[key] is not None]
    return max(values) if values else None


def statistic_steps(run: Run) -> list[float]:
    """The timed steps ZO2's statistic is over: the last half (record_zo2_speed.sh)."""
    return run.samples[len(run.samples) // 2 :]


def measurement(args: argparse.Namespace, run: Run) -> Measurement:
    """ZO2's statistic over the last half of the timed steps, and the memory maxima."""
    last = statistic_steps(run)
    tokens = args.batch * args.seq
    timer = Timer(last)
    metrics: dict[str, float] = {
        "tokens_per_s": statistics.fmean(tokens / s for s in last),
        "tokens_per_s_median": tokens / timer.median,
        "s_per_step": statistics.fmean(last),
        "peak_host_rss_gb": (most(run.replies, "peak_rss_bytes") or 0) / 1e9,
        "parameters": float(run.ready["parameters"]),
        "build_s": float(run.ready["build_s"]),
    }
    for key, metric in (
        ("peak_device_bytes", "peak_device_gb"),
        ("device_used_bytes", "device_used_gb"),
        ("process_device_bytes", "process_device_gb"),
    ):
        value = most(run.replies, key)
        if value is not None:
            metrics[metric] = value / 1e9
    metrics.update(run.phases or {})
    loss = run.replies[-1]["loss"]
    if math.isfinite(loss):
        metrics["loss"] = float(loss)
    dims = peer_dims(args.shape, args.layers, args.hidden)
    params = {
        "system": run.system.name,
        "shape": args.shape,
        "layers": dims.layers,
        "hidden": dims.hidden,
        "heads": dims.heads,
        "kv_heads": dims.kv_heads,
        "batch": args.batch,
        "seq": args.seq,
        "dtype": args.dtype,
        "device": args.device,
        "threads": args.threads,
        "ranks": run.system.ranks,
        "interleaved": not args.one_at_a_time,
        "warmup": args.warmup,
        "timed_steps": len(run.samples),
        "statistic_steps": len(last),
    }
    if run.system.name in DISTZO_SYSTEMS:
        params["perturb_scope"] = args.distzo_perturb_scope
    return Measurement.from_timer(run.system.name, params, timer, metrics)


def ratios(report: BenchReport, pairs: list[tuple[str, str]]) -> None:
    """``A_vs_B``: A's tokens/s over B's; ``A_vs_B_peak_device``/``_peak_rss``: memory."""
    by_name = {m.name: m.metrics for m in report.measurements}
    for a, b in pairs:
        if a not in by_name or b not in by_name:
            continue
        for suffix, metric in (
            ("", "tokens_per_s"),
            ("_peak_device", "peak_device_gb"),
            ("_process_device", "process_device_gb"),
            ("_peak_rss", "peak_host_rss_gb"),
        ):
            if metric in by_name[a] and by_name[b].get(metric):
                report.derived[f"{a}_vs_{b}{suffix}"] = by_name[a][metric] / by_name[b][metric]


def phase_notes(runs: list[Run], derived: dict[str, float], device: str = "cpu") -> list[str]:
    """Each distzo peer's phases per block, and each of ``device``'s targets met or missed
    (a missed speed target with the phase that bounds distzo's offloaded step)."""
    phases = {run.system.name: run.phases for run in runs if run.phases}
    notes = [describe_phases(name, p) for name, p in phases.items()]
    notes += [note for run in runs if (note := profile_disagrees(run))]
    offload = phases.get("distzo-offload")
    for (a, b), target in TARGETS.get(device, {}).items():
        ratio = derived.get(f"{a}_vs_{b}")
        if ratio is None:
            continue
        if ratio >= target:
            notes.append(f"{a} runs at {ratio:.2f}x {b}'s tokens/s: the {target:g}x target is met")
            continue
        note = f"{a} runs at {ratio:.2f}x {b}'s tokens/s, below the {target:g}x target"
        measured = phases.get(a, offload)
        if measured is not None:
            bound = bound_by(measured)
            note += (
                f": its period per block is bound by {BOUND_WORDS.get(bound, bound)} "
                "(the phases above)"
            )
            if b == "distzo-resident" and bound in ("upload", "offload"):
                note += "; the target holds where compute >= transfer, which it is not here"
            elif b in phases and bound not in ("upload", "offload", "waits"):
                note += "; " + compute_against(measured, b, phases[b])
        notes.append(note)
    by_name = {run.system.name: run for run in runs}
    for (a, b), most in MEMORY_TARGETS.get(device, {}).items():
        ratio = derived.get(f"{a}_vs_{b}_peak_device")
        if ratio is not None:
            verdict = "the target (at most 1x) is met" if ratio <= most else "above the target (1x)"
            note = f"{a}'s peak device memory is {ratio:.2f}x {b}'s: {verdict}"
            where = planned_terms(by_name[a]) if ratio > most and a in by_name else None
            notes.append(note + (f"; {where}" if where else ""))
    return notes


# How far a profiled step may stray from the timed steps' mean and still stand for them.
PROFILE_TOLERANCE = 0.15


def profile_disagrees(run: Run) -> str | None:
    """A note where the profiled step's time is not the timed steps' (a busy machine's
    outlier, or a step the instruments slowed): its phases then describe that one step."""
    if not run.phases or not run.samples:
        return None
    timed = statistics.fmean(statistic_steps(run)) * 1e3
    profiled = run.phases["step_ms"]
    if abs(profiled / timed - 1) <= PROFILE_TOLERANCE:
        return None
    return (
        f"{run.system.name}'s profiled step took {profiled:.3g} ms against its timed steps' "
        f"mean of {timed:.3g} ms: its phases describe that step, not the table's"
    )


def compute_against(measured: dict[str, float], name: str, other: dict[str, float]) -> str:
    """A compute-bound block's compute beside ``name``'s, and the parts that differ: the
    noise, the master's upcast and rounding (where the compute runs them), the rest (the
    forwards)."""

    def parts(p: dict[str, float]) -> tuple[float, float, float, float]:
        compute, noise = p["compute_ms_per_block"], p["noise_ms_per_block"]
        master = p.get("master_ms_per_block", 0.0)
        return compute, noise, master, compute - noise - master

    mine, theirs = parts(measured), parts(other)
    diff = [f"{a - b:+.3g}" for a, b in zip(mine, theirs)]
    # two master buffers: the upcast and the rounding are the upload's and the offload's
    master = (
        ""
        if measured.get("offload_rounding_ms")
        else f", the master's upcast and rounding {diff[2]}"
    )
    return (
        f"its compute per block {mine[0]:.3g} ms against {name}'s {theirs[0]:.3g} ({diff[0]} "
        f"ms: noise {diff[1]}{master}, the forwards and the rest {diff[3]})"
    )


PLAN_TERMS = {  # the peer's plan metrics (peer_distzo.PLAN_METRICS), as a note names them
    "plan_resident_gb": "resident",
    "plan_slots_gb": "slots",
    "plan_scratch_gb": "scratch",
    "plan_state_gb": "optimizer state",
    "plan_activations_gb": "activations",
}


def planned_terms(run: Run) -> str | None:
    """Where a distzo peer's device memory goes by its plan (the terms its phases reply
    carries), beside its measured peak: what a missed memory target comes down to."""
    plan = run.phases or {}
    if "plan_gb" not in plan:
        return None
    terms = ", ".join(
        f"{name} {plan[key]:.2f}" for key, name in PLAN_TERMS.items() if plan.get(key)
    )
    text = f"its plan {plan['plan_gb']:.2f} GB ({terms} GB)"
    peak = most(run.replies, "peak_device_bytes") if run.replies else None
    if peak:
        text += f", its measured peak {peak / 1e9:.2f} GB ({peak / 1e9 / plan['plan_gb']:.2f}x)"
    return text


def default_out(args: argparse.Namespace) -> Path:
    shape = args.shape + (f"-{args.layers}l" if args.layers else "")
    shape += f"-h{args.hidden}" if args.hidden else ""
    name = f"peers-{shape}-{args.batch}x{args.seq}-{args.dtype}-{args.device}.json"
    return HERE / "results" / name


class Stopped(Exception):
    """The run was stopped from outside (SIGTERM, or SIGINT: ``timeout``'s signal)."""


def terminate(signum: int, _frame: object) -> None:
    """SIGTERM as a stop, so that every peer is killed and the partial report written."""
    raise Stopped(signal.Signals(signum).name)


def device_label(args: argparse.Namespace) -> str:
    if args.device == "cuda":
        return device_name(torch.device("cuda", 0))
    return f"cpu ({platform.processor() or platform.machine()}, {args.threads} threads per peer)"


def run_peers(
    args: argparse.Namespace,
    systems: list[System],
    notes: list[str],
    done: Callable[[list[Run]], object],
) -> list[Run]:
    """Every peer's runs; a broken peer ends them all with one line (SystemExit). A stop
    from outside (SIGTERM, or SIGINT: ``timeout``'s signal) ends every peer too, after
    ``done`` has written what was measured and a note of what was built and what was not."""
    # SIGINT too: a shell starts a background command (`cmd &` in a script) with SIGINT
    # ignored, and Python then never raises KeyboardInterrupt, so `timeout --signal=INT`
    # went unheard until its SIGKILL, which leaves no report
    previous = {sig: signal.signal(sig, terminate) for sig in (signal.SIGTERM, signal.SIGINT)}
    progress = PeerProgress([s.name for s in systems])
    runs: list[Run] = []
    live: list[PeerProcess] = []
    try:
        if args.one_at_a_time:
            notes.append(
                "The peers ran one at a time (--one-at-a-time): their steps did not "
                "interleave, so a drift of the machine's speed does not hit them alike"
            )
            return measure_one_at_a_time(args, systems, runs, progress, done, live)
        return measure_interleaved(args, systems, runs, progress, live)
    except PeerError as exc:
        raise SystemExit(f"peers.py: {' '.join(str(exc).split())}") from None
    except (KeyboardInterrupt, Stopped) as exc:
        # the report first, the peers after: ending them may take seconds each that a run
        # cut by `timeout --kill-after` does not have
        why = str(exc) if isinstance(exc, Stopped) else "SIGINT"
        notes.append(progress.stop_note(why))
        measured = [run for run in runs if len(run.samples) >= 2]
        saved = f"the partial report: {done(measured)}" if measured else "nothing measured"
        raise SystemExit(f"peers.py: {notes[-1]}; {saved}") from None
    finally:
        kill_all(live)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def write_report(
    args: argparse.Namespace, systems: list[System], notes: list[str], runs: list[Run]
) -> Path:
    """The report of ``runs`` (a partial one, said so in its notes, while systems remain)."""
    measured = {run.system.name for run in runs}
    missing = [s.name for s in systems if s.name not in measured]
    if missing:
        notes = [*notes, f"Partial report: {', '.join(missing)} not measured yet"]
    report = BenchReport("peers", device_label(args), max(s.ranks for s in systems), notes=notes)
    report.measurements = [measurement(args, run) for run in runs]
    pairs = list(PAIRS) + [(a, b) for a, _, b in (r.partition("/") for r in args.ratio)]
    ratios(report, pairs)
    report.notes = [*report.notes, *phase_notes(runs, report.derived, args.device)]
    if args.distzo_profile_dir and (kernels := write_comparison(Path(args.distzo_profile_dir))):
        report.notes.append(
            f"One profiled step of each distzo peer, its kernels per stream side by side: "
            f"{kernels} (each step's Chrome trace beside it)"
        )
    out = Path(args.out) if args.out else default_out(args)
    report.write(out, COLUMNS, METHOD)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    systems, notes = choose_systems(args)
    runs = run_peers(args, systems, notes, lambda runs: write_report(args, systems, notes, runs))
    out = write_report(args, systems, notes, runs)
    for run in runs:
        m = measurement(args, run)
        print(
            f"{m.name:16} {m.metrics['tokens_per_s']:10.1f} tokens/s  "
            f"{m.metrics['s_per_step'] * 1e3:9.1f} ms/step",
            file=sys.stderr,
        )
    print(f"peers.py: wrote {out} and {out.with_suffix('.md')}", file=sys.stderr)


if __name__ == "__main__":
    main()
