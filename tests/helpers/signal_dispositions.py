"""A rank that prints how it starts out handling the signals torchrun's agent handles, one
line: the same for a rank forked by ``tests.helpers.preloaded_torchrun`` as for a fresh one."""

import os
import signal
import sys

# what torchrun's agent handles itself unless TORCHELASTIC_SIGNALS_TO_HANDLE says otherwise
AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def disposition(handler: object) -> str:
    if handler is signal.default_int_handler:
        return "default_int_handler"
    if isinstance(handler, int):
        return signal.Handlers(handler).name
    return getattr(handler, "__qualname__", repr(handler))


if __name__ == "__main__":
    said = " ".join(f"{sig.name}={disposition(signal.getsignal(sig))}" for sig in AGENT_SIGNALS)
    # one write per line: print writes the line and its end apart, and two ranks share stdout
    sys.stdout.write(f"rank {os.environ['RANK']}: {said}\n")
    sys.stdout.flush()
