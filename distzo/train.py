"""``python -m distzo.train`` / ``torchrun --nproc_per_node=N -m distzo.train``.

With no arguments it trains a tiny random-init OPT on a counting task generated in
code (no download), evaluates before and after, and prints the metrics improving.
Under torchrun the ranks form a dp x pert mesh (DistZO2). Every option is validated
on every rank before any process group or model is built; options come from the
defaults, a TOML file (``--config``) and the flags, in that order of precedence.

A run directory (``--output-dir``, default ``./runs/<timestamp>``) receives:
``config.toml`` (the resolved options), ``metrics.jsonl`` (one record per step),
``eval.jsonl``, ``seedlog.jsonl`` (what ``python -m distzo.replay`` needs),
``checkpoints/step-N/`` (resumable with ``--resume``), ``base/`` (the initial
weights of a random-init model), ``export/`` (the final model, Hugging Face format)
and ``rankN.json`` (each rank's transfer mode and memory).

This module is the entry point only: the job itself is ``distzo.job.trainer.Trainer``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from distzo.config.cli import fail, write_failure
from distzo.config.job import resolve
from distzo.dist import LaunchEnv
from distzo.dist import process_group as pg
from distzo.dist.failure_report import (
    ERROR_FILE,
    ERRORS,
    PEER_REPORT_GRACE_S,
    await_torchrun,
    is_peer_failure,
    recorded,
    report_peer_failure,
)
from distzo.job.preemption import EXIT_INTERRUPTED, Preempted, StopSignals
from distzo.runtime.units import counted

if TYPE_CHECKING:  # the trainer imports transformers: loaded once the options parse
    from distzo.config.job import JobConfig
    from distzo.job.run_lock import RunLock
    from distzo.job.trainer import Trainer, TrainerCallback

logger = logging.getLogger("distzo.train")


def configure_logging(env: LaunchEnv) -> None:
    """Rank 0 speaks; the other ranks report only warnings and errors, tagged with their rank."""
    level = logging.INFO if env.rank == 0 else logging.WARNING
    logging.basicConfig(
        level=level, format=f"%(asctime)s [rank{env.rank}] %(levelname)s %(name)s: %(message)s"
    )


def main(argv: list[str] | None = None, callbacks: Iterable[TrainerCallback] = ()) -> int:
    """Run the job the command line describes; the process's exit code: 0, 2 for bad input
    (one line on stderr), ``EXIT_DIVERGED`` (1) at a non-finite loss, ``EXIT_PREEMPTED``
    after a preemption notice, ``EXIT_INTERRUPTED`` after Ctrl-C (a second one included,
    reported in one line rather than a traceback, and ending the process at once even while a
    checkpoint is being written). Under torchrun every non-zero exit leaves its reason in
    torchrun's error file (``distzo.dist.failure_report``)."""
    earlier = _saves_being_written()  # an earlier main()'s in this process (Python's)
    code = recorded(_main)(argv, callbacks)
    code = 0 if code is None else code
    # abandoned by a second Ctrl-C to this run: its step-N.tmp never counts
    if _saves_being_written() - earlier:
        _exit_at_once(code)
    return code


def _saves_being_written() -> frozenset[Any]:
    """``checkpoint.saves_being_written``, without importing the checkpoints (and with them
    the engine and transformers) to answer for a run that never reached them: ``--help``, a
    mistyped flag, a rejected option."""
    checkpoint = sys.modules.get("distzo.job.checkpoint")
    return checkpoint.saves_being_written() if checkpoint is not None else frozenset()


def _exit_at_once(code: int) -> NoReturn:
    """End the process with ``code`` without waiting for a checkpoint's writer thread, which
    the interpreter joins at exit (minutes for a large model) though no one completes its
    save: a second Ctrl-C promised to stop at once. Logs and streams are flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _main(argv: list[str] | None, callbacks: Iterable[TrainerCallback]) -> int:
    try:
        env = LaunchEnv.from_environ()
    except ValueError as err:  # each process says it: none knows its place to defer to rank 0
        return fail(str(err))
    configure_logging(env)
    try:
        return _run(argv, env, callbacks)
    except KeyboardInterrupt:  # Ctrl-C before training, or a second one while stopping
        return _stopped(
            env,
            "interrupted at once by SIGINT: nothing saved since the last checkpoint; "
            "--resume goes on from it and the seed log",
            EXIT_INTERRUPTED,
        )


def _stopped(env: LaunchEnv, message: str, code: int, level: int = logging.ERROR) -> int:
    """A failure every rank reaches alike (bad input, a divergence, a stop): said once per
    node, by its first rank, and by each rank in torchrun's error file (so that its summary
    shows the line rather than "To enable traceback see ..."); without torchrun every rank
    says it."""
    ERRORS.record_message(message)
    if _speaks(env):
        logger.log(level, "%s", message)
    return code


def _speaks(env: LaunchEnv) -> bool:
    """Whether this rank writes a failure every rank shares: each node's first rank under
    torchrun (the others' error files carry it to the summary), every rank otherwise. Not
    rank 0 alone: another node's log would lack the line, and its ranks, waiting for their
    torchrun to end them once rank 0 exits (``await_torchrun``), would wait in vain (that
    node's torchrun never learns of rank 0's exit)."""
    return env.local_rank == 0 or not os.environ.get(ERROR_FILE)


def _run(argv: list[str] | None, env: LaunchEnv, callbacks: Iterable[TrainerCallback]) -> int:
    """``main`` but for an interrupt at once."""
    try:
        config = resolve(argv)  # --help and bad flags end here, before the heavy imports
        from distzo.job.divergence import EXIT_DIVERGED, Diverged
        from distzo.job.trainer import Trainer

        trainer = Trainer(config, env, callbacks)
    except ValueError as err:
        return _failed(env, str(err))  # every rank, the same line, before any model
    signals = StopSignals()
    # rank 0's --export-best replays in the run directory once the run has ended: locked
    # all along, so that no other job (a requeue) starts there in between
    trainer.held.lock_past_end = config.run.export_best and env.rank == 0
    try:
        with signals:
            trainer.train(signals)
    except ValueError as err:
        _close_failed(trainer)
        return _failed(env, str(err))
    except OSError as err:  # a full disk, a directory made unwritable: a failure, one line
        _close_failed(trainer)  # a save in flight elsewhere completed, as after any failure
        return _failed(env, write_failure(err, getattr(trainer, "run_dir", "the run directory")), 1)
    except Diverged as err:
        pg.shutdown()  # every rank saw the same non-finite value: no collective is pending
        return _stopped(env, str(err), EXIT_DIVERGED)
    except Preempted as stopped:
        what = "interrupted" if stopped.exit_code == EXIT_INTERRUPTED else "preempted"
        if stopped.before_training:  # a peer may wait in the build's collectives still
            _close_failed(trainer)  # a fresh run's directory discarded, a resumed one's kept
            done = "no step was trained in this session; the same command starts it again"
        else:
            pg.shutdown()  # every rank stopped after the same step: no collective is pending
            done = (
                f"{counted(stopped.step, 'step')} done, --resume (or a restart) goes on from there"
            )
        return _stopped(
            env,
            f"{what}: {stopped}; {done}",
            stopped.exit_code,
            logging.WARNING,  # asked for: not an error, though the exit code says it stopped
        )
    except Exception as err:
        if env.world_size == 1 or not is_peer_failure(err):
            _close_failed(trainer)  # a save in flight completed: the run keeps its checkpoint
            raise  # this rank's own failure: its traceback, in torchrun's error file too
        # A peer died (its own error is the root cause) or was stopped by torchrun's SIGTERM.
        grace = 0.0 if signals.requested else PEER_REPORT_GRACE_S
        return report_peer_failure(err, env.rank, trainer.step, grace)
    # Any other failure propagates: the process exits non-zero and torchrun stops the other
    # ranks (a peer blocked in a collective fails by itself within --dist-timeout). The
    # process group is torn down only after success: tearing it down under a collective
    # that a dead peer will never join can hang.
    pg.shutdown()
    if not (config.run.export_best and env.rank == 0):
        return 0
    run_dir, lock = trainer.run_dir, trainer.held.hand_over_lock()
    # The trained model let go first: the replay builds another, resident on the same
    # device, which a model over half the device (or the host) would not fit beside it.
    del trainer
    return _export_best(run_dir, config, lock)


def _export_best(run_dir: Path, job: JobConfig, lock: RunLock | None) -> int:
    """``--export-best``'s replay, once the run has ended, with the run's export options,
    under the run's ``lock`` (None: taken again); a failure is one line."""
    from distzo.job.run_dir import BEST_EXPORT
    from distzo.job.run_end import export_options
    from distzo.replay import export_best

    try:
        export_best(run_dir, export_options(job), lock)
    except ValueError as err:  # a log the replay refuses (a copied start): one line
        return fail(str(err).splitlines()[0])
    except OSError as err:
        return fail(write_failure(err, run_dir / BEST_EXPORT), 1)
    return 0


def _close_failed(trainer: Trainer) -> None:
    """Close a failing run (``Trainer.close``: a save in flight completed, the logs closed);
    closing may fail again (the same full disk), which is said but never hides the first
    failure, the one the run reports."""
    try:
        trainer.close()
    except Exception as err:  # noqa: BLE001 - the failure under way is the one to report
        logger.warning("closing the failed run: %s", err)


def _failed(env: LaunchEnv, message: str, code: int = 2) -> int:
    """``fail``'s ``error: message`` line (bad input: 2; a failure: 1), recorded for torchrun
    and written once under it (rank 0), by every rank otherwise."""
    ERRORS.record_message(f"error: {message}")
    if _speaks(env):
        return fail(message, code)
    await_torchrun()  # the node's first rank says the line; its exit ends this one
    return code


if __name__ == "__main__":
    sys.exit(main())
