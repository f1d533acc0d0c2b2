"""Resuming a run from its directory: whether there is something to resume, which noise
it was drawn with, and the catch-up with the steps its seed log holds beyond the
checkpoint."""

from __future__ import annotations

import logging
from pathlib import Path

from distzo.config.job import RunOptions
from distzo.data.task_data import LoadedRows
from distzo.dist import LaunchEnv, ParallelContext
from distzo.dist.agreement import agreed
from distzo.dist.collectives import Collectives
from distzo.engine import ZOEngine
from distzo.job.checkpoint import (
    check_complete,
    checkpoint_damage,
    checkpoint_noise,
    latest_checkpoint,
)
from distzo.job.run_dir import check_log_leads_to_checkpoint, run_contents
from distzo.job.scoring_requeue import scoring_summary
from distzo.job.seed_log import (
    SEED_LOG,
    check_header_types,
    check_same_run,
    forget_seed_log_reads,
    in_order_end,
    is_begun_log,
    last_logged_step,
    logged_first_step,
    logged_header,
    logged_noise,
    read_seed_log_once,
    records_from,
    step_grads,
)
from distzo.zo import identity_kind

logger = logging.getLogger("distzo.train")


def resume_mode(run: RunOptions, env: LaunchEnv, scoring: bool = False) -> str:
    """``no`` or ``yes``, resolved: ``auto`` (the default under torchrun --max-restarts > 0)
    resumes when the run directory holds a checkpoint or logged steps to go on from, or,
    for a ``scoring`` command (--max-steps 0), a finished scoring run (whose recorded
    evaluation a requeue reports: ``distzo.job.scoring_requeue``), else starts afresh over
    it (it holds no step: ``run.overwrite`` is set). ``--overwrite`` starts afresh, except
    in a torchrun restart, which goes on from the first attempt."""
    if run.overwrite:
        if run.resume in ("yes", "auto"):
            raise ValueError(
                f"--overwrite starts afresh and --resume {run.resume} goes on with the run: keep "
                "one"
            )
        if run.resume is None and env.restart_count > 0:
            run.overwrite = False  # the first attempt deleted the old run: go on from its steps
        else:
            return "no"
    if run.resume is None and env.max_restarts > 0 and not run.output_dir:
        if env.rank == 0:
            logger.warning(
                "torchrun restarts this job, but without --output-dir a restart starts afresh "
                "in a new directory: give --output-dir to resume where it stopped"
            )
        return "no"
    mode = run.resume or ("auto" if env.max_restarts > 0 else "no")
    if mode != "no" and not run.output_dir:
        raise ValueError(f"--resume {mode} needs --output-dir: the run directory to resume")
    if mode == "no" or run.output_dir is None:
        return "no"
    directory, logs = Path(run.output_dir), Path(run.log_dir) if run.log_dir else None
    if latest_checkpoint(directory / "checkpoints"):
        return "yes"
    steps = logged_steps(directory / SEED_LOG)
    if scoring and not steps and scoring_summary(directory) is not None:
        return "yes"  # a requeue of a finished scoring run
    if mode == "yes":
        if steps:  # dropping --resume would overwrite them
            check_log_leads_to_checkpoint(directory, every_record=False)  # one from step 0?
            raise ValueError(
                f"--resume: no checkpoint in {run.output_dir}/checkpoints, but its seed log holds "
                f"{steps} steps: --resume auto catches up with them from the initial weights"
            )
        fresh = "--overwrite instead" if run_contents(directory, logs) else "drop --resume"
        raise ValueError(
            f"--resume: no checkpoint in {run.output_dir}/checkpoints and no logged step to go on "
            f"from; {fresh} to start afresh"
        )
    if steps:
        return "yes"
    run.overwrite = bool(run_contents(directory, logs))  # no step to go on from: start afresh
    if run.overwrite and env.rank == 0:  # said before the deletion's line, which names no flag
        logger.warning(
            "--resume auto: %s holds no checkpoint and no logged step to go on from; its old "
            "run's files go, as with --overwrite",
            run.output_dir,
        )
    return "no"


def logged_steps(path: Path) -> int:
    """How many steps a seed log holds (0: none, or no log), from its header and its last
    record alone (every rank asks, and parsing a long log took seconds per rank); whether
    they run without a gap is ``check_log_leads_to_checkpoint``'s to say."""
    last = last_logged_step(path) if path.is_file() else None
    return 0 if last is None else max(1, last + 1 - logged_first_step(path))


def check_resumed_rows(
    run_dir: Path, rows: LoadedRows | None, train_file: str | None, eval_file: str | None = None
) -> None:
    """Refuse a resume whose --train-file holds other rows than the run started with (its
    seed log's ``train_rows``): the same path, rewritten since, would give the steps from
    the resume on other batches than the run's (the batch of a step is a function of the
    rows and the step). So too an --eval-file's (``eval_rows``): the evaluations after the
    resume would score another set than those before it, in one curve, and a finished
    scoring run's record would stand for rows it never scored. A log from before a digest
    existed has nothing to compare."""
    log = run_dir / SEED_LOG
    header = logged_header(log) if rows is not None and log.is_file() else None
    if rows is None or header is None:
        return
    for flag, key, path, did in (
        ("--train-file", "train_rows", train_file, "trained on"),
        ("--eval-file", "eval_rows", eval_file, "evaluated"),
    ):
        logged, digest = header.get(key), rows.digests[flag]
        if logged is None or logged == digest:
            continue
        raise ValueError(
            f"--resume: {flag} {path} holds other rows than the run in {run_dir} {did} (rows "
            f"digest {digest} of the task's examples, its seed log's {logged}); restore the "
            "file the run started with (or the distzo: another version may build the "
            "examples otherwise), or start afresh with --overwrite or another --output-dir"
        )


def agreed_checkpoint(run_dir: Path, comm: Collectives, rank: int) -> Path | None:
    """The checkpoint a resumed run loads: rank 0's latest, taken by every rank. Each rank
    listing its own would load other steps where a shared file system shows one node a
    new checkpoint later than another (NFS): the ranks' collectives then pair up wrongly,
    a hang or a run of mixed weights. A rank whose node does not show the checkpoint
    whole refuses it, in one line on every rank, before anything is read."""
    chosen = latest_checkpoint(run_dir / "checkpoints") if rank == 0 else None
    name = comm.broadcast_object(chosen.name if chosen is not None else None)
    if name is None:
        return None
    path = run_dir / "checkpoints" / name  # this node's spelling of the run directory
    agreed(comm, lambda: check_as_chosen(path, rank))
    return path


def check_as_chosen(path: Path, rank: int) -> None:
    """Rank 0 refuses a damaged checkpoint it chose (``check_complete``, the previous one
    offered); another rank, one its node does not show whole yet: rank 0's does."""
    if rank == 0:
        check_complete(path)
        return
    damage = f"{path} does not exist" if not path.is_dir() else checkpoint_damage(path)
    if damage is not None:
        raise ValueError(
            f"--resume: rank 0 resumes from checkpoint {path.name}, complete on its node, but "
            f"on this rank's node {damage}: a shared file system that has not caught up "
            "(NFS); launch again once every node shows it whole"
        )


def drawn_noise(run_dir: Path, rank: int = 0) -> str:
    """The noise kind a resumed run was drawn with: its checkpoint's, else its seed log's.
    Rank 0 reads (and checks) the whole log, which its catch-up then goes on with, unless
    its validation did (``in_order_end``); the others take the header alone, and learn a
    refusal of the log through the launch gate."""
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    if checkpoint is not None:
        return checkpoint_noise(checkpoint)
    path = run_dir / SEED_LOG
    header_alone = rank != 0 or in_order_end(path) is not None
    header = logged_header(path) if header_alone else None
    if header is None:
        header = read_seed_log_once(path)[0]  # rank 0's read, or the one-line refusal
    else:
        check_header_types(path, header)
    return identity_kind(logged_noise(header))


def catch_up_from_log(
    engine: ZOEngine, run_dir: Path, header: dict, parallel: ParallelContext
) -> int:
    """Apply every step the seed log holds beyond the engine's (a restart after a crash
    or a preemption), in one pass over the blocks; returns the step to train from.
    Rank 0 reads the records beyond the checkpoint from the log's end where its validation
    found the log in order (``records_from``), else the whole log, and hands them to every
    rank. A low-bit transfer or state rounds on the host at each step, which a catch-up
    cannot repeat: those steps are trained again instead (the same result). A whole parse
    is then forgotten: only the records beyond the checkpoint are kept."""
    path = run_dir / SEED_LOG
    start = engine.step_index

    def read() -> list[tuple[int, tuple[float, ...], float]] | None:
        if parallel.env.rank != 0 or not is_begun_log(path):
            return None
        tail = records_from(path, start)
        theirs = logged_header(path) if tail is not None else None
        if theirs is None or tail is None:
            theirs, tail = read_seed_log_once(path)
        check_same_run(path, theirs, header)
        return [(r["step"], step_grads(r), r["lr"]) for r in tail if r["step"] >= start]

    try:
        records = agreed(parallel.comm, read)  # a refusal by rank 0 ends every rank with it
    finally:
        forget_seed_log_reads()  # the resume's last read of the log (every rank's)
    records = parallel.comm.broadcast_object(records) if parallel.is_distributed else records
    if not records:
        return start
    if engine.config.rounds_on_host:
        logger.info(
            "steps %d-%d are in the seed log, but a low-bit transfer rounds at every step: "
            "training them again from step %d",
            start,
            records[-1][0],
            start,
        )
        return start
    engine.catch_up(records)
    logger.info(
        "caught up with steps %d-%d from the seed log in one pass; training from step %d",
        start,
        records[-1][0],
        engine.step_index,
    )
    return engine.step_index
