"""A stand-in peer for benchmarks/peers.py: the protocol with a tiny step of known cost.

    python -m tests.helpers.stand_in_peer --step-ms 5 --log FILE [--die-at N] \\
        [--garbage-at N] [--build-s S] --system NAME ...the protocol's arguments

A step sleeps ``--step-ms`` and multiplies two small matrices. Every event (start with the
pid and the shape arguments it was given, each request on arrival, each reply with the
step times sent, exit) is appended to ``--log`` as a JSON line, so a test can check what
the harness passed on, the order it asked in, and recompute its statistics.
``--die-at N``: exit 3 on the N-th request, after a last stderr line; ``--garbage-at N``:
answer the N-th request with a line that is not the protocol's; ``--build-s S``: take S
seconds to build (a large model's peer).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch

from distzo.bench.peer_protocol import END, ProtocolOut, protocol_parser, read_request, run_request


class FakeStep:
    parameters = 64 * 64

    def __init__(self, step_ms: float) -> None:
        self.delay = step_ms / 1e3
        self.weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))

    def step(self) -> float:
        time.sleep(self.delay)
        return float((self.weight @ self.weight).abs().mean())


def main() -> int:
    p = protocol_parser(__doc__.splitlines()[0])
    p.add_argument("--step-ms", type=float, required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--die-at", type=int, default=None)
    p.add_argument("--garbage-at", type=int, default=None)
    p.add_argument("--build-s", type=float, default=0.0)
    args = p.parse_args()
    out = ProtocolOut()
    torch.set_num_threads(args.threads)

    def log(event: str, **fields: Any) -> None:
        with open(args.log, "a") as fh:
            fh.write(json.dumps({"event": event, "system": args.system, **fields}) + "\n")

    log("start", pid=os.getpid(), shape=args.shape, layers=args.layers, hidden=args.hidden)
    system = FakeStep(args.step_ms)
    time.sleep(args.build_s)
    out.send(
        {
            "ready": True,
            "system": args.system,
            "parameters": system.parameters,
            "build_s": args.build_s,
        }
    )
    request = 0
    while True:
        steps = read_request(sys.stdin)
        if steps == END:
            log("exit")
            return 0
        request += 1
        log("request", n=request, steps=steps, t=time.time())
        if request == args.die_at:
            print(f"stand-in {args.system}: dying at request {request}", file=sys.stderr)
            sys.stderr.flush()
            os._exit(3)
        if request == args.garbage_at:
            out.stream.write("this line is not the protocol's\n")
            out.stream.flush()
            continue
        reply = run_request(system, steps, torch.device("cpu"))
        log("reply", n=request, step_s=reply["step_s"])
        out.send(reply)


if __name__ == "__main__":
    sys.exit(main())
