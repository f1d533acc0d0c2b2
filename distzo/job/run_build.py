"""A run's build: every part a checked job trains with, made in order, on every rank.

``Trainer.build()`` is ``build_run``: the CUDA device or CPU threads, the process group and
the broadcast seed, the claimed run directory, rank 0's dashboard, the model and its task
data, the memory plan checked, the engine, a resumed run's checkpoint and the steps its seed
log holds after it, the resolved ``config.toml`` and rank 0's logs. What the run takes from
the process (threads, the claim, the logs, the checkpointer) is handed to the trainer's
``RunResources`` as it is taken, so a build that fails part-way gives it back; a fresh run
that fails before its first step also leaves no directory a retry would take for a run.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distzo.config.job import JobConfig, write_resolved
from distzo.dist import LaunchEnv, ParallelContext, broadcast_seed
from distzo.dist.agreement import agreed
from distzo.engine import ZOEngine
from distzo.engine.build import check_model_lozo_rank
from distzo.job.build import (
    TaskData,
    build_objective,
    build_parallel,
    build_task_data,
    choose_slots,
    rank_share,
)
from distzo.job.checkpoint import Checkpointer
from distzo.job.hub_data_commits import data_commits_record
from distzo.job.memory_plan import check_fits
from distzo.job.records import StepMeter, run_header
from distzo.job.reporting import Reporter, make_reporter
from distzo.job.resume import agreed_checkpoint, catch_up_from_log
from distzo.job.run_claim import RunClaim
from distzo.job.run_logs import RunLogs
from distzo.job.run_model import run_model
from distzo.job.run_resources import RunResources
from distzo.job.summary import SUMMARY
from distzo.job.validation import CheckedJob
from distzo.models.weights import declared_stop_ids, special_ids
from distzo.objectives import Objective
from distzo.runtime.option_names import named_as_flags
from distzo.runtime.units import counted

logger = logging.getLogger("distzo.train")


@dataclass
class RunParts:
    """What a run trains with; the trainer reads each as its own attribute."""

    device: torch.device
    parallel: ParallelContext
    seed: int  # the run seed, drawn by rank 0 when the options asked for a random one
    run_dir: Path
    reporter: Reporter | None  # rank 0's dashboard, which its logs feed
    tokenizer: Any
    data: TaskData
    objective: Objective
    engine: ZOEngine
    header: dict[str, Any]  # the seed log's
    start_step: int  # where this process's training begins (a resume: after 0)
    meter: StepMeter


def build_run(checked: CheckedJob, env: LaunchEnv, held: RunResources) -> RunParts:
    """Make the parts of ``checked``'s run (see the module's docstring)."""
    job = checked.job
    device = checked.config.torch_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif checked.threads is not None:  # resolved by validate: --threads, OMP_NUM_THREADS or 1
        held.cpu_threads.use(*checked.threads)
    parallel = build_parallel(job, env, checked.dims, device)
    seed = broadcast_seed(checked.config.seed, parallel.comm)
    digests = checked.rows.digests if checked.rows is not None else None
    claim = held.claim = RunClaim.take(job, parallel, env, digests)
    job.run.seed = seed  # the resolved config repeats the run, even when drawn
    # A dashboard that cannot start (wandb not logged in) fails every rank before any model.
    reporter = agreed(parallel.comm, lambda: _make_reporter(job, env, claim.path))
    try:
        return _Build(checked, env, held, device, parallel, seed, claim.path, reporter).parts()
    except BaseException:
        if reporter is not None:
            reporter.close()
        # A fresh run that fails before its first step (a memory plan that refuses it, a
        # checkpoint that does not fit) leaves nothing a retry would take for a run.
        claim.abandon()
        raise


def _make_reporter(job: JobConfig, env: LaunchEnv, run_dir: Path) -> Reporter | None:
    """Rank 0's dashboard, if ``--report-to`` names one."""
    if env.rank != 0:
        return None
    return make_reporter(job.run.report_to, run_dir, dataclasses.asdict(job))


@dataclass
class _Build:
    """The parts made once the run has its directory: the model onwards."""

    checked: CheckedJob
    env: LaunchEnv
    held: RunResources
    device: torch.device
    parallel: ParallelContext
    seed: int
    run_dir: Path
    reporter: Reporter | None

    def parts(self) -> RunParts:
        """The model and its data, the engine, a resumed run's state, the logs; the
        resolved config.toml once a resume's checkpoint has been accepted (a refused resume
        leaves the run's own as it was)."""
        job, env, comm = self.checked.job, self.env, self.parallel.comm
        dims = self.checked.dims
        logger.info(
            "run %s: seed %d; %s as dp %d x pert %d",
            self.run_dir,
            self.seed,
            counted(env.world_size, "rank"),
            dims.dp,
            dims.pert,
        )
        model, weights, tokenizer, revision = run_model(job, self.seed, env, comm, self.run_dir)
        with named_as_flags():  # from the shapes: before the data, or a weight, is read
            check_model_lozo_rank(model, self.checked.config)
        rows = self.checked.rows
        stop_ids = declared_stop_ids(model, special_ids(tokenizer))
        share = rank_share(self.parallel)
        data = build_task_data(job, rows, tokenizer, model.config, self.seed, stop_ids, share)
        if env.rank == 0:  # MeZO warns of a cut too ("Exceed max length")
            for line in (*(rows.notices if rows else ()), *data.cut_notices):
                logger.warning(line)
        self._plan_memory(model, data)
        objective = build_objective(job.optim.objective or "lm", data)
        with named_as_flags():  # what the engine says names --dual-forward, not dual_forward
            engine = ZOEngine(
                model,
                self.checked.config,
                parallel=self.parallel,
                run_seed=self.seed,
                weights=weights,
                objective=objective,
            )
        checkpoints = self.run_dir / "checkpoints"
        checkpointer = Checkpointer(checkpoints, engine, job.run.keep_checkpoints)
        self.held.checkpointer = checkpointer
        header, start_step = self._restore(engine, objective, checkpointer, revision)
        agreed(comm, self._write_config)  # rank 0's write: every rank's verdict
        logs = self.held.logs = agreed(comm, lambda: self._open_logs(start_step, header))
        if logs is not None:
            checkpointer.before_publish = logs.seeds.sync
        meter = StepMeter(objective.name, engine.link_bytes_per_step, self.device)
        return RunParts(
            self.device,
            self.parallel,
            self.seed,
            self.run_dir,
            self.reporter,
            tokenizer,
            data,
            objective,
            engine,
            header,
            start_step,
            meter,
        )

    def _plan_memory(self, model: nn.Module, data: TaskData) -> None:
        """Settle the slot count and refuse a run that cannot fit (unless --force)."""
        job, config = self.checked.job, self.checked.config
        plan = choose_slots(job, model, data, config, self.parallel, self.device)
        logger.info("memory plan: %s", plan.describe())
        local_ranks, force = self.env.local_world_size, job.run.force
        # one GPU short of memory ends every rank, not that one alone
        agreed(self.parallel.comm, lambda: check_fits(plan, self.device, local_ranks, force))

    def _restore(
        self,
        engine: ZOEngine,
        objective: Objective,
        checkpointer: Checkpointer,
        revision: str | None,
    ) -> tuple[dict[str, Any], int]:
        """The seed log's header (with ``revision``, the hub commit of the base) and the
        steps done: for a resumed run, its latest checkpoint, then the steps its seed log
        holds after it."""
        job = self.checked.job
        resuming = job.run.resume == "yes"
        # rank 0's choice, on every rank: a lagging file system may list others (NFS)
        comm, rank = self.parallel.comm, self.env.rank
        checkpoint = agreed_checkpoint(self.run_dir, comm, rank) if resuming else None
        step = checkpointer.load(checkpoint) if checkpoint is not None else 0
        rows = self.checked.rows
        header = run_header(
            job,
            self.checked.config,
            engine.run_seed,
            self.seed,
            objective.name,
            self.device,
            self.run_dir,
            getattr(engine.model, "config", None),
            rows.digests["--train-file"] if rows is not None else None,
            revision,
            data_commits_record(job, rows.commits) if rows is not None else None,
            rows.digests["--eval-file"] if rows is not None else None,
        )
        if resuming:
            step = catch_up_from_log(engine, self.run_dir, header, self.parallel)
        return header, step

    def _write_config(self) -> None:
        if self.env.rank == 0:
            write_resolved(self.checked.job, self.run_dir)

    def _open_logs(self, start_step: int, header: dict[str, Any]) -> RunLogs | None:
        """Rank 0's logs, cut back to the step a resumed run goes on from."""
        if self.env.rank != 0:
            return None
        job = self.checked.job
        if start_step < job.optim.max_steps:
            # an earlier session's summary says the run ended there: it goes on, and this
            # session writes its own at the end (a stopped one, none, as a first would)
            (self.run_dir / SUMMARY).unlink(missing_ok=True)
        run = job.run
        log_dir = Path(run.log_dir) if run.log_dir else self.run_dir
        return RunLogs(self.run_dir, log_dir, start_step, header, run.log_sync_steps, self.reporter)
