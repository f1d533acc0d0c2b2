"""The run directory a job claims, and gives back.

Taking it (``RunClaim.take``): the directory is chosen (``--output-dir``, or the one rank
0 makes), every node's ranks are checked to run one job in it (``same_job``), rank 0
locks it (``run_lock``: one job at a time, a fresh run's check repeated under the lock)
and ``--overwrite`` clears the old run before any rank writes there. Giving it back:
``release`` unlocks it for the next job; ``abandon``, for a fresh run that failed before
its first step, also deletes what the run wrote, so that the corrected command is not
refused as a run to resume or overwrite.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from distzo.config.job import JobConfig
from distzo.dist import LaunchEnv, ParallelContext
from distzo.dist.agreement import agreed
from distzo.job.run_dir import check_fresh, clear_run, discard_unstarted_run, shared_run_dir
from distzo.job.run_lock import RunLock
from distzo.job.same_job import check_one_job


@dataclass
class RunClaim:
    path: Path
    job: JobConfig
    rank: int
    made: bool  # the default directory rank 0 made (removed again if a failed start empties it)
    lock: RunLock | None  # rank 0's

    @classmethod
    def take(
        cls,
        job: JobConfig,
        parallel: ParallelContext,
        env: LaunchEnv,
        data: Mapping[str, str] | None = None,
    ) -> RunClaim:
        """Choose, check, lock and (``--overwrite``) clear the run directory; a refusal is
        one line on every rank. ``data``: the rows digest of each data file, by its flag
        (every node must have read the same rows)."""
        output_dir = job.run.output_dir
        path = Path(output_dir) if output_dir else shared_run_dir(parallel.comm, env.rank)
        check_one_job(job, path, parallel.comm, env, data)
        flag = "--output-dir" if output_dir else "the run directory"
        lock = RunLock(path, flag) if env.rank == 0 else None
        claim = cls(path, job, env.rank, output_dir is None, lock)
        agreed(parallel.comm, claim._lock)  # a second job refused on every rank
        if job.run.overwrite:  # the old run goes before any rank writes into its directory
            if env.rank == 0:
                clear_run(job)
            parallel.comm.barrier()
        return claim

    def _lock(self) -> None:
        """Rank 0 locks the directory before any rank writes there; a fresh run checks it
        again under the lock, since a job that ended after this one's checks may have left
        a run in it."""
        if self.lock is None:
            return
        self.lock.acquire()
        if self.job.run.resume == "no":
            try:
                check_fresh(self.job)
            except ValueError:
                self.lock.release()
                raise

    def abandon(self) -> None:
        """A run that failed before its first step: a fresh one leaves nothing a retry
        would take for a run (``discard_unstarted_run``); the lock is let go."""
        if self.rank == 0 and self.job.run.resume == "no":
            discard_unstarted_run(self.path, self.made, self.lock)
        self.release()

    def release(self) -> None:
        """Unlock the directory for the next job (once; a no-op on other ranks)."""
        if self.lock is not None:
            self.lock.release()
