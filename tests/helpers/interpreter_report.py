"""``python -m tests.helpers.interpreter_report [EXIT] [--hang] [--hub-cache]``: prints what a
program can see of the interpreter that runs it (its arguments, path, folder, environment,
signal handling, open descriptors, whether it is imported under its own name, with
``--hub-cache`` the cache huggingface_hub read at its import), then exits the way
an interpreter does: non-daemon threads joined, exit handlers run, ``sys.exit(EXIT)``. The
fork server's children must print what fresh interpreters print (tests/unit/test_fork_server.py).
"""

import atexit
import json
import os
import signal
import sys
import threading
import time

from tests.helpers.signal_dispositions import AGENT_SIGNALS, disposition


def finish_later() -> None:
    time.sleep(0.2)
    print("thread finished")


if __name__ == "__main__":
    seen = {
        "name": __name__,
        "argv": [os.path.relpath(sys.argv[0]), *sys.argv[1:]],
        "path0": sys.path[0],
        "cwd": os.getcwd(),
        "imported as itself": "tests.helpers.interpreter_report" in sys.modules,
        "variable": os.environ.get("DISTZO_REPORT_VARIABLE"),
        "signals": {sig.name: disposition(signal.getsignal(sig)) for sig in AGENT_SIGNALS},
        "descriptors": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
    }
    if "--hub-cache" in sys.argv:
        from huggingface_hub import constants

        seen["hub cache"] = constants.HF_HUB_CACHE
    print(json.dumps(seen), flush=True)
    print("to stderr\r\n", end="", file=sys.stderr)
    atexit.register(print, "exit handler ran")
    threading.Thread(target=finish_later).start()
    if "--hang" in sys.argv:
        time.sleep(600)
    sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else None)
