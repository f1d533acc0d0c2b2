"""The peer side of ``benchmarks/peers.py``'s contract: arguments in, JSON lines out.

A peer is one system under test in a process of its own, so that its memory is its own
and it can run under another interpreter. It is launched as ``PYTHON RUNNER ARGS...``
with the arguments of ``protocol_parser`` (``--system --shape --layers --hidden --batch
--seq --dtype --device --seed --threads``), builds its model (``peer_models``: the
shape's config as ZO2's speed test builds it), and writes one JSON line to stdout::

    {"ready": true, "system": str, "parameters": int, "build_s": float}

Then, for each line ``{"steps": k}`` on stdin, it runs k training steps on its one fixed
batch and writes exactly one line::

    {"step_s": [k floats], "loss": float, "peak_rss_bytes": int,
     "peak_device_bytes": int | null, "device_used_bytes": int | null,
     "process_device_bytes": int | null}

``step_s``: each step's wall time with a device sync before and after it; ``loss``: the
last step's; ``peak_rss_bytes``: the process's VmHWM; ``peak_device_bytes``: the CUDA
allocator's peak since the request began; ``device_used_bytes``: total - free of the
device at the request's end (what nvidia-smi shows, the whole device);
``process_device_bytes``: what NVML lists for the peer's process at the request's end
(nvidia-smi's per-process figure: its context and allocator reserve; null without NVML).
A peer whose system can say where its step's time goes also answers ``{"phases": true}``
with one line ``{"phases": {name: float}}`` (``distzo.bench.phases``: per block upload,
compute, noise, offload, the stream model's period); the harness asks distzo's peers
only. A failure is ``{"error": "one line"}`` and exit 1; EOF on stdin is exit 0. Logs go
to stderr only: ``ProtocolOut`` takes stdout for the protocol and points file descriptor
1 at stderr, so a library's stray ``print`` cannot break the stream.

This module serves distzo's peer and the tests' stand-in; the ZO2 peer speaks the same
lines with code of its own, since it runs under an interpreter without distzo.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import IO, Any, Protocol

import torch

from distzo.bench.process_device import process_device_bytes
from distzo.bench.timing import synchronize
from distzo.runtime.host_memory import peak_rss_bytes

DTYPES = ("fp32", "fp16", "bf16")
END = -1  # the step count that stands for EOF when rank 0 shares it with the other ranks
PHASES = -2  # ... and for a phases request

logger = logging.getLogger("peer")


def protocol_parser(description: str) -> argparse.ArgumentParser:
    """The arguments every peer takes (a peer may add its own)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--system", required=True, help="the system's name in the report")
    p.add_argument("--shape", required=True, help="an OPT or Qwen3 shape: opt-1.3b, qwen3-8b")
    p.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    p.add_argument(
        "--hidden",
        type=int,
        default=None,
        help="override the width (distzo.bench.peer_models): OPT ffn 4 x hidden and "
        "hidden / 64 heads; Qwen3 ffn 3 x hidden and hidden / 128 heads of 128",
    )
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--dtype", choices=DTYPES, required=True, help="compute dtype")
    p.add_argument("--device", choices=("cpu", "cuda"), required=True)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    return p


class PeerSystem(Protocol):
    """What a peer measures: its trained parameter count and one training step (and,
    where it can say where a step's time goes, a ``phases()`` method: ``serve`` answers
    a phases request with it)."""

    parameters: int

    def step(self) -> float:
        """One training step on the fixed batch; the loss, read on the host."""
        ...


class ProtocolOut:
    """Stdout for protocol lines only: the original stream, with fd 1 sent to stderr."""

    def __init__(self) -> None:
        sys.stdout.flush()
        self.stream: IO[str] = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    def send(self, message: dict[str, Any]) -> None:
        self.stream.write(json.dumps(message) + "\n")
        self.stream.flush()


def read_request(stream: IO[str]) -> int:
    """The next request's step count; ``PHASES`` for a phases request, ``END`` at EOF. A
    malformed line raises."""
    for line in stream:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            if request == {"phases": True}:
                return PHASES
            steps = request["steps"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(
                f'request {line.strip()[:80]!r} is not {{"steps": k}} or {{"phases": true}}'
            ) from None
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"request asks for {steps!r} steps; k must be an integer >= 1")
        return steps
    return END


def run_request(system: PeerSystem, steps: int, device: torch.device) -> dict[str, Any]:
    """``steps`` timed steps and the memory readings of the reply."""
    cuda = device.type == "cuda"
    if cuda:
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    samples, loss = [], float("nan")
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        loss = system.step()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    used = None
    if cuda:
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
    return {
        "step_s": samples,
        "loss": loss,
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_device_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "device_used_bytes": used,
        "process_device_bytes": process_device_bytes() if cuda else None,
    }


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def serve(
    build: Callable[[argparse.Namespace], tuple[PeerSystem, torch.device]],
    args: argparse.Namespace,
    speaks: bool = True,
    share: Callable[[int], int] = lambda steps: steps,
) -> int:
    """Build the system, answer requests until EOF; the exit code.

    ``speaks``: this process reads stdin and writes the protocol (rank 0 of a launch);
    ``share`` hands rank 0's step count to every rank (identity in one process), so that
    every rank steps together and all stop at EOF."""
    out = ProtocolOut()
    try:
        if args.device == "cpu":
            torch.set_num_threads(args.threads)
        started = time.perf_counter()
        system, device = build(args)
        if speaks:
            out.send(
                {
                    "ready": True,
                    "system": args.system,
                    "parameters": int(system.parameters),
                    "build_s": time.perf_counter() - started,
                }
            )
        while True:
            steps = share(read_request(sys.stdin) if speaks else END)
            if steps == END:
                return 0
            if steps == PHASES:
                phases = getattr(system, "phases", None)
                if phases is None:
                    raise ValueError("this peer does not report phases")
                reply = {"phases": phases()}
            else:
                reply = run_request(system, steps, device)
            if speaks:
                out.send(reply)
    except Exception as exc:  # noqa: BLE001 - the harness reads one line, the log the rest
        traceback.print_exc(file=sys.stderr)
        if speaks:
            out.send({"error": f"{args.system}: {one_line(exc)}"})
        return 1
