"""How far a run is and when it will end: a tqdm bar on rank 0 when stderr is a terminal,
and on the ``--log-every`` step line, everywhere, the steps done of all, the steps per
second of this session and the time left. A log that is a file never holds a bar: tqdm
redraws with carriage returns, which a file keeps one after the other. An evaluation (a
minute for a small model's few hundred rows) has its own bar, by the same rules.

Also: transformers' own bars ("Writing model shards" in ``save_pretrained``) silenced
while distzo saves, the user's setting restored afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

logger = logging.getLogger("distzo.train")


class Progress:
    """Steps ``start``..``total`` of a run: the bar (``show``: rank 0 on a terminal) and
    the rate and ETA the step line carries."""

    def __init__(self, start: int, total: int, show: bool) -> None:
        self.start = start
        self.total = total
        self.started = time.perf_counter()
        self._scope = contextlib.ExitStack()
        self.bar: Any = None
        if show and sys.stderr.isatty():
            # Log lines are written above the bar rather than through it.
            self._scope.enter_context(logging_redirect_tqdm())
            # counted in steps, as the step lines are (tqdm's own unit is "it")
            self.bar = tqdm(
                desc="train", initial=start, total=total, unit=" steps", dynamic_ncols=True
            )

    def update(self, done: int, **postfix: str) -> None:
        """``done`` steps are done; ``postfix``: the figures the bar shows beside it."""
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(done - self.bar.n)

    def steps_per_s(self, done: int) -> float:
        """This session's mean rate (a resumed run's earlier steps are not timed here)."""
        return (done - self.start) / max(time.perf_counter() - self.started, 1e-9)

    def describe(self, done: int) -> str:
        """``12.30 steps/s, ETA 02:39``: the rate so far, the time the steps left take at it."""
        rate = self.steps_per_s(done)
        left = (self.total - done) / rate if rate > 0 else 0.0
        return f"{format_rate(rate)}, ETA {tqdm.format_interval(left)}"

    def log_step(self, step: int, result: Any, every: int) -> None:
        """The ``--log-every`` line of step ``step`` (0-based, as metrics.jsonl numbers it):
        its loss, g and lr, and how far the run is, counted in steps done as the evaluation
        and ``done:`` lines count (``step 2000/2000`` is the last, not ``1999/2000``); every
        ``every`` steps done, the first step (the run is under way) and the last."""
        done = step + 1
        if every and (done % every == 0 or step == 0 or done == self.total):
            logger.info(
                "step %d/%d loss %.4f g %+.4g lr %.3g (%s)",
                done,
                self.total,
                result.loss,
                result.projected_grad,
                result.lr,
                self.describe(done),
            )

    def close(self) -> None:
        """Remove the bar and give logging its handlers back; once is enough, twice harmless."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self._scope.close()


@contextlib.contextmanager
def evaluation_bar(calls: int, show: bool) -> Iterator[Callable[[], None]]:
    """A bar over an evaluation's ``calls`` forward calls, shown as the training bar is
    (``show``: rank 0, on a terminal); yields what counts one call done. Cleared at the end:
    the evaluation's figures are its log line's."""
    if not (show and sys.stderr.isatty()):
        yield lambda: None
        return
    with (
        logging_redirect_tqdm(),
        tqdm(desc="eval", total=calls, unit=" batches", leave=False, dynamic_ncols=True) as bar,
    ):
        yield bar.update


def format_rate(steps_per_s: float) -> str:
    """A rate as tqdm's bar writes one: two decimals, fixed point at any speed (``%.3g``
    wrote a tiny run's ``1.23e+03 steps/s``), and seconds per step below one a second,
    where steps per second would read ``0.01``."""
    if 0 < steps_per_s < 1:
        return f"{1 / steps_per_s:.2f} s/step"
    return f"{steps_per_s:.2f} steps/s"


@contextlib.contextmanager
def no_library_bars() -> Iterator[None]:
    """transformers' (and huggingface_hub's) progress bars off for the block, then back
    as the user had them."""
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as hf_logging

    if not hf_logging.is_progress_bar_enabled():
        yield
        return
    hub_was_disabled = hub_utils.are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()  # re-enables the hub's too
        if hub_was_disabled:
            hub_utils.disable_progress_bars()
