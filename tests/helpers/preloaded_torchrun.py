"""torchrun whose ranks are forked from a launcher that has already imported the entry point.

``python -m tests.helpers.preloaded_torchrun MODULE TORCHRUN_ARGS...`` imports MODULE, then
runs torchrun's own ``main`` with TORCHRUN_ARGS, to which ``tests.helpers.launch`` adds
torchrun's ``--run-path MODULE_FILE`` and ``--start-method fork``: the same elastic agent,
rendezvous and environment as ``torchrun -m MODULE``, and each rank runs
MODULE's file as ``__main__`` (``runpy.run_path``, as ``python -m`` does), but in a process
forked from this one instead of a fresh interpreter.

Why: a rank of a test launch spends about 4.7 s of CPU importing torch and transformers
before a tenth of a second of training a tiny model, and the suite is mostly such launches on
two cores. Forked ranks share the launcher's imports. A launch meant to fail runs fresh
interpreters, as users' launches do (``tests.helpers.launch.torchrun(..., preload=False)``):
torchrun's summary of a function's failure is not the one users see, and a forked rank ends
by ``os._exit`` after its ``__main__``, without the interpreter's exit handlers.

What a forked rank would otherwise inherit and a fresh one does not is put back: the agent
installs its own handlers for SIGTERM, SIGINT, SIGHUP and SIGQUIT before it starts the ranks,
and a forked rank's signals are left as exec leaves a fresh rank's: a caught signal back to
the default, an ignored one still ignored, and SIGINT then raising KeyboardInterrupt as a new
interpreter sets it. (Not the launcher's own dispositions at its start: under ``nohup`` they
ignore SIGHUP, which a fresh rank, started after the agent caught SIGHUP, does not.) The
launcher imports only: no tensor work before the fork, so no intra-op thread pool is
inherited (and the launch sets ``OMP_NUM_THREADS=1``).
"""

from __future__ import annotations

import importlib
import os
import signal
import sys

from torch.distributed import run

from tests.helpers.signal_dispositions import AGENT_SIGNALS


def signals_as_after_exec() -> None:
    """Leave the agent's signals as a fresh interpreter started by exec would find them."""
    for sig in AGENT_SIGNALS:
        if callable(signal.getsignal(sig)):  # a Python handler: exec resets it, SIG_IGN it keeps
            signal.signal(sig, signal.SIG_DFL)
    if signal.getsignal(signal.SIGINT) == signal.SIG_DFL:  # what Python does as it starts
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: list[str]) -> None:
    module, torchrun_args = argv[0], argv[1:]
    os.register_at_fork(after_in_child=signals_as_after_exec)
    importlib.import_module(module)
    run.main(torchrun_args)


if __name__ == "__main__":
    main(sys.argv[1:])
