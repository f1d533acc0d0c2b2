"""What a run takes from the process and gives back, whichever way it ends.

A ``Trainer`` takes torch's CPU thread count (``--threads``), its run directory (the
claim and its lock), rank 0's logs (open files, the seed log's fsync thread) and, while
an asynchronous save is written, a checkpoint in flight. A finished run, a preempted or
diverged one, one that failed mid-way and a ``close()`` all give them back here, once:
a notebook or a sweep that goes on after a run keeps none of them.
"""

from __future__ import annotations

import contextlib
import logging

from distzo.job.checkpoint import Checkpointer
from distzo.job.cpu_threads import CpuThreads
from distzo.job.run_claim import RunClaim
from distzo.job.run_lock import RunLock
from distzo.job.run_logs import RunLogs

logger = logging.getLogger("distzo.train")


class RunResources:
    def __init__(self) -> None:
        self.cpu_threads = CpuThreads()  # --threads for the run, the caller's after it
        self.claim: RunClaim | None = None  # the run directory, from build() to release()
        self.checkpointer: Checkpointer | None = None  # its save in flight, if any
        self.logs: RunLogs | None = None  # rank 0's
        self.closed = False  # the logs closed: a finished or failed run, or close()
        # the command goes on in the run directory once the run has ended (its --export-best
        # replay): a finished run keeps the lock for it (``hand_over_lock``)
        self.lock_past_end = False

    def close(self) -> None:
        """Close the logs (``close_logs``), then unlock the run directory for the next job."""
        try:
            self.close_logs()
        finally:
            self.release()

    def close_logs(self) -> None:
        """Complete an asynchronous save still in flight, then close the logs (the seed log
        synced) and give the thread count back. A failure to complete the save is said, not
        raised: the failure under way, if any, is the one to report. An interrupt of the
        wait (a second Ctrl-C) abandons the save (its ``step-N.tmp`` never counts, as on the
        command line) and still closes the logs, the rest of what a resume goes on from; logs
        that fail to close (a full disk) still give the thread count back."""
        with contextlib.ExitStack() as closing:  # its callbacks run last first, each of them
            closing.callback(setattr, self, "closed", True)
            closing.callback(self.cpu_threads.give_back)
            if self.logs is not None:
                closing.callback(self.logs.close)
            self._complete_save()

    def _complete_save(self) -> None:
        if self.checkpointer is not None and self.checkpointer.in_flight:
            try:
                self.checkpointer.wait()
            except Exception as exc:  # noqa: BLE001 - the failure already under way wins
                logger.warning("the checkpoint being written could not be completed: %s", exc)

    def release(self) -> None:
        """Unlock the run directory (a no-op before it was claimed, and once released)."""
        if self.claim is not None:
            self.claim.release()

    def release_at_end(self) -> None:
        """A finished run's release: none where the command goes on in the directory
        (``lock_past_end``), so that no other job (a requeue) starts there in between."""
        if not self.lock_past_end:
            self.release()

    def hand_over_lock(self) -> RunLock | None:
        """The run directory's lock, still held, for the caller to release: these resources
        let go of it no more. None where none is held (another rank's, or let go)."""
        claim = self.claim
        if claim is None or claim.lock is None or not claim.lock.held:
            return None
        lock, claim.lock = claim.lock, None
        return lock

    def end_failed(self, unstarted: bool) -> None:
        """A failed run (a Ctrl-C, a callback that raised, ``Diverged``) gives everything
        back, as ``close()`` would. Its directory is the next job's to resume; with a save
        still being written, only once ``close()`` has completed it (the logs stay open for
        it). A fresh run stopped before training (``unstarted``) leaves nothing the same
        command would take for a run, as a failed build does. Closing may fail again (the
        same full disk): said, never hiding the failure under way."""
        self.cpu_threads.give_back()
        if self.checkpointer is not None and self.checkpointer.in_flight:
            return
        try:
            self.close_logs()
        except Exception as exc:  # noqa: BLE001 - the failure under way is the one to report
            logger.warning("closing the failed run: %s", exc)
        finally:
            if unstarted and self.claim is not None:
                self.claim.abandon()
            else:
                self.release()
