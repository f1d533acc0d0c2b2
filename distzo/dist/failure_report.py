"""How a rank's failure reaches the person who launched the job.

torchrun (torch.distributed.elastic) stops every rank when one fails and prints a summary
whose "Root Cause" is the failure with the earliest timestamp; a rank tells it why it
failed through the error file named by ``TORCHELASTIC_ERROR_FILE`` (the convention of
``torch.distributed.elastic.multiprocessing.errors.record``). Without one, the summary says
only "To enable traceback see ...". So:

* an unexpected exception is recorded with its traceback (``record`` on the entry point);
* an expected failure (bad input, a divergence, a full disk, a preemption) is recorded as
  its one-line message, which the summary then shows instead of a traceback;
* a rank whose collective failed because a peer died (``is_peer_failure``) records nothing
  and prints one line, not a traceback: the peer's own error is the root cause. It waits a
  moment for torchrun's SIGTERM (torchrun notices the dead peer within a tenth of a second)
  so that the peer's failure is observed first; if none comes (the peer hung rather than
  died, or no torchrun), it records its own line and exits.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import time
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

logger = logging.getLogger("distzo.train")

ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
PEER_REPORT_GRACE_S = 10.0  # a multi-node agent learns of a dead peer within seconds

# What gloo's transport says when the process at the other end is gone (gloo raises plain
# RuntimeErrors); NCCL and the store raise torch.distributed.DistError subclasses.
_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",
)

R = TypeVar("R")


class RankErrorFile(ErrorHandler):
    """torchelastic's error handler, active only where torchrun asked for an error file (a
    plain ``python -m`` run, or a test calling the entry point in process, keeps its own
    fault handler and stderr)."""

    def initialize(self) -> None:
        if os.environ.get(ERROR_FILE):
            super().initialize()

    def record_message(self, message: str) -> None:
        """Record a one-line failure in the error file's format (torchrun shows the message
        where a traceback would be); written whole, then renamed into place."""
        path = os.environ.get(ERROR_FILE)
        if not path:
            return
        data = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
        tmp = f"{path}.tmp"
        with open(tmp, "w") as out:
            json.dump(data, out)
        os.replace(tmp, path)


ERRORS = RankErrorFile()


def recorded(fn: Callable[..., R]) -> Callable[..., R | None]:
    """``fn`` under torchelastic's ``record``: an exception escaping it leaves its traceback in
    torchrun's error file, so torchrun's summary shows this rank's root cause."""
    return record(fn, ERRORS)


def is_peer_failure(err: BaseException) -> bool:
    """Whether ``err`` is what a collective raises when another rank is gone or silent."""
    if isinstance(err, dist.DistError):
        return True
    return isinstance(err, RuntimeError) and any(text in str(err) for text in _PEER_GONE)


def _first_sentence(err: BaseException) -> str:
    """The gist of a backend's error: its first sentence, without gloo's ``[file.cc:N]``."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(err).strip())
    text = text.splitlines()[0].split(". ")[0] if text else type(err).__name__
    return text[:160]


def report_peer_failure(err: BaseException, rank: int, step: int, grace_s: float) -> int:
    """One line for a rank stopped by a peer's failure; then wait up to ``grace_s`` for
    torchrun to end this process (it observes the peer's failure first, the root cause), and
    if it does not, record this rank's line and return the exit code (1)."""
    cause = _first_sentence(err)
    under_torchrun = bool(os.environ.get(ERROR_FILE))
    where = "above and in torchrun's summary" if under_torchrun else "in its own output"
    message = (
        f"rank {rank} stopped in step {step}: another rank failed or went silent ({cause}); "
        f"that rank's error, {where}, is the cause"
    )
    logger.error("%s", message)
    await_torchrun(grace_s)  # let torchrun see the peer's exit first
    ERRORS.record_message(message)
    return 1


def await_torchrun(grace_s: float = PEER_REPORT_GRACE_S) -> None:
    """Under torchrun, wait up to ``grace_s`` for torchrun to end this process once another
    rank has exited: the peer whose failure stopped this rank (the root cause torchrun
    should observe first), or rank 0 with the line of a failure every rank shares (exiting
    first, this rank would have torchrun end rank 0 before it printed the line). Without
    torchrun no one ends this process: no wait."""
    if os.environ.get(ERROR_FILE):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(grace_s)
