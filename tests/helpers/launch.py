"""Launching the real entry point under torchrun, bound to localhost, bounded in time."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.helpers import faults, fork_server

TRAIN = "distzo.train"
FAULTY_TRAIN = "tests.helpers.faulty_train"  # the same entry point, with injected failures
# The flags the tests of cut and resumed runs share: a constant lr (the schedule then does not
# depend on where a run was cut), seed 5, batches of 8, no console log; each adds --max-steps.
RESUMABLE_RUN = "--batch-size 8 --log-every 0 --seed 5 --lr-schedule constant".split()


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PORT_POOL = 8192  # ports below the ephemeral range, shared out among the xdist workers
_next_port: dict[str, int] = {}


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _worker_slice() -> range:
    """This xdist worker's own ports, below the kernel's ephemeral range."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), index + 1)
    top = _ephemeral_low()
    bottom = max(1024, top - PORT_POOL)
    width = (top - bottom) // count
    return range(bottom + index * width, bottom + (index + 1) * width)


def free_port() -> int:
    """A port no one holds, for torchrun's store or a rendezvous, chosen where nothing else will
    take it before the launch binds it: a port the kernel hands out (bind to 0) is in its
    ephemeral range, from which every client socket and gloo listener of a concurrent test
    also draws, and CI lost a launch to EADDRINUSE that way. Ports below that range are given
    only to who asks for them by number, and each xdist worker asks only in its own slice."""
    ports = _worker_slice()
    start = _next_port.get("at", ports.start + os.getpid() % max(len(ports), 1))
    for step in range(len(ports)):
        port = ports.start + (start - ports.start + step) % len(ports)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _next_port["at"] = port + 1
        return port
    raise RuntimeError(f"no free port in {ports.start}-{ports.stop - 1} for a test launch")


def torchrun_command(
    nproc: int,
    args: list[str],
    port: int,
    nnodes: int = 1,
    node_rank: int = 0,
    max_restarts: int = 0,
    module: str = TRAIN,
    preload: bool = False,
) -> list[str]:
    """torchrun's command line for ``-m MODULE ARGS``; with ``preload`` the ranks are forked
    from a launcher that imported MODULE (``tests.helpers.preloaded_torchrun``)."""
    if preload:
        launcher = ["-m", "tests.helpers.preloaded_torchrun", module]
        script = ["--start-method=fork", "--run-path", _module_file(module)]
    else:
        launcher = ["-m", "torch.distributed.run"]
        script = ["-m", module]
    return [
        sys.executable,
        *launcher,
        f"--nnodes={nnodes}",
        f"--node_rank={node_rank}",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        f"--max-restarts={max_restarts}",
        *script,
        *args,
    ]


def _module_file(module: str) -> str:
    import importlib.util

    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    return spec.origin


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def torchrun(
    nproc: int,
    args: list[str],
    timeout: float = 180,
    env: dict[str, str] | None = None,
    max_restarts: int = 0,
    preload: bool = True,
):
    """torchrun over the training job; an ``env`` that names a fault (``tests.helpers.faults``)
    runs the faulty entry point, which injects it. The ranks are forked from a launcher that
    has imported the entry point (``preload``, see ``tests.helpers.preloaded_torchrun``),
    itself a child of the fork server (``run_python``), unless told otherwise: fresh
    interpreters cost each rank seconds of imports."""
    module = FAULTY_TRAIN if faults.injects(env) else TRAIN
    command = torchrun_command(
        nproc, args, free_port(), max_restarts=max_restarts, module=module, preload=preload
    )
    if preload:
        return run_python(command, child_env(env), timeout)
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=child_env(env)
    )


def run_python(
    command: list[str], env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, ...)`` for a ``python -m``
    command: a child of the fork server (``tests.helpers.fork_server``) where it can stand for
    a fresh interpreter, a fresh one otherwise."""
    served = fork_server.run(command, env, timeout, standard=child_env())
    if served is not None:
        return served
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def python_module(program: str, args: list[str], timeout: float = 120):
    """``python -m PROGRAM ARGS`` as a fresh interpreter runs it, its output captured."""
    return run_python([sys.executable, "-m", program, *args], child_env(), timeout)


def python_train(args: list[str], timeout: float = 120):
    return python_module("distzo.train", args, timeout)


def python_replay(args: list[str], timeout: float = 300):
    """``python -m distzo.replay ARGS``: a seed log rebuilt into a model."""
    return python_module("distzo.replay", args, timeout)


def train_in_process(
    args: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python -m distzo.train ARGS`` run by this process (see ``main_in_process``)."""
    return main_in_process("distzo.train", args, env)


def main_in_process(
    program: str, args: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python -m PROGRAM ARGS`` run by this process, for checks that end before any
    training (bad input): the same ``main``, its exit code and its stderr, logging included
    (routed to the captured stderr as a fresh process would), without a new interpreter's
    imports (seconds per launch). Anything that trains, or launches ranks, uses a subprocess."""
    import contextlib
    import importlib
    import io
    import logging

    main = importlib.import_module(program).main
    stderr, stdout = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    saved_env = dict(os.environ)
    root.handlers = []
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
            try:
                code = main(args)
            except SystemExit as exit_:  # argparse's usage errors
                code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        root.handlers, _ = saved
        root.setLevel(saved[1])
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess([program, *args], code, stdout.getvalue(), stderr.getvalue())


class Run:
    """What a launch with --output-dir left behind."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.metrics = [
            json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
        ]
        self.params: dict[str, torch.Tensor] = load_file(str(out / "export" / "model.safetensors"))
        self.ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}

    @property
    def grads(self) -> list[float]:
        return [m["projected_grad"] for m in self.metrics]


def checkpoint_writers(checkpoint: Path) -> dict[str, int]:
    """Which rank's DCP file (``__RANK_0.distcp``) holds each tensor of a checkpoint."""
    import torch.distributed.checkpoint as dcp

    storage = dcp.FileSystemReader(str(checkpoint)).read_metadata().storage_data
    return {index.fqn: int(info.relative_path.split("_")[2]) for index, info in storage.items()}


def max_relative_difference(a: Run, b: Run) -> tuple[float, float]:
    """(worst relative g difference over steps, worst relative parameter-norm difference)."""
    g = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a.grads, b.grads, strict=True))
    p = max(((a.params[k] - b.params[k]).norm() / b.params[k].norm()).item() for k in b.params)
    return g, p
