"""The checks and defaults that span sections of the job's options, run after each
section's own ``validate``. They read no file: what needs the run directory, the task's
files or the model's config is checked by the job (``distzo.job.validation``)."""

from __future__ import annotations

from distzo.config.engine_options import engine_default
from distzo.config.job import JobConfig
from distzo.data.task_data import TASK_NAMES, check_objective, default_objective
from distzo.dist import LaunchEnv, ParallelDims
from distzo.runtime.option_names import named_as_flags
from distzo.zo.estimators import ESTIMATORS


def default_lr(job: JobConfig) -> float:
    """The lr when --lr is not given. ZO steps scale with sqrt(parameters) and a
    pretrained model sits in a narrow basin: MeZO tuned full-parameter OPT with 1e-6 to
    1e-7 (the engine's default), FZOO's script uses 1e-5 (its steps are normalised), where
    the tiny random-init model needs 1e-2 to learn (1e-3 on real text, where 1e-2
    diverged)."""
    if job.model.model or job.model.model_config:
        if job.optim.estimator in ESTIMATORS:
            return ESTIMATORS[job.optim.estimator].pretrained_lr
        return float(engine_default("lr"))
    return 1e-2 if job.data.task == "counting" else 1e-3


def resolve_defaults(job: JobConfig) -> None:
    """Fill in the options whose default depends on another (the lr on the model and
    task, the objective on the task, the number of queries on the estimator), so that the
    run's config.toml records them."""
    if job.optim.lr is None:
        job.optim.lr = default_lr(job)
    if job.optim.num_queries is None and job.optim.estimator in ESTIMATORS:
        job.optim.num_queries = ESTIMATORS[job.optim.estimator].default_queries
    if job.data.task in TASK_NAMES and job.optim.objective is None:
        job.optim.objective = default_objective(job.data.task)


def check_job(job: JobConfig, env: LaunchEnv) -> ParallelDims:
    """Each section's checks, then those across sections and against the launch (the
    world's size, whether a process group exists); returns the parallel layout."""
    job.validate()
    data, optim = job.data, job.optim
    with named_as_flags():  # the layout's errors name --dp and --pert, as typed
        dims = ParallelDims.resolve(env.world_size, job.parallel.dp, job.parallel.pert)
        dims.check_batch(data.batch_size)
        # (a count below 1 is the engine options' own one-line error, raised later)
        queries = optim.num_queries
        if optim.estimator in ESTIMATORS and queries is not None and queries >= 1:
            dims.check_passes(optim.estimator, queries)
    if job.offload.transfer == "sliced" and not env.launched:
        raise ValueError(
            "--transfer sliced needs a torchrun launch (a process group); use --transfer naive "
            "or auto"
        )
    if job.offload.low_bit_master in ("recompute", "double") and job.peft.peft != "none":
        raise ValueError(
            f"--low-bit-master {job.offload.low_bit_master} places the masters of trained "
            "blocks that stream; an adapter's stay on the device and its base is never "
            "updated: drop it"
        )
    if job.offload.perturb_scope == "module" and job.peft.peft != "none":
        raise ValueError(
            "--perturb-scope module perturbs the modules of trained blocks; an adapter's base "
            "is never perturbed and its blocks are small: drop it"
        )
    if data.task in TASK_NAMES and optim.objective is not None:  # an unknown task: the job's
        check_objective(data.task, optim.objective)
    if optim.grad_accum < 1 or optim.grad_accum > data.batch_size // dims.dp:
        raise ValueError(
            f"--grad-accum {optim.grad_accum} must be between 1 and the "
            f"{data.batch_size // dims.dp} sequences of a rank's batch (--batch-size / dp); "
            "change one of them"
        )
    if data.num_demos is not None and optim.max_steps > 0:
        raise ValueError(
            f"--num-demos evaluates with demonstrations and trains nothing (MeZO: no "
            f"in-context learning if there is training), but --max-steps is "
            f"{optim.max_steps}; give --max-steps 0, or drop --num-demos to train"
        )
    if job.run.export_best:
        check_best_replayable(job)
    if data.eval_batch_size < env.world_size:
        raise ValueError(
            f"--eval-batch-size {data.eval_batch_size} is smaller than the {env.world_size} "
            "ranks; raise it"
        )
    return dims


def check_best_replayable(job: JobConfig) -> None:
    """``--export-best`` replays the seed log to the best dev step: refused before training
    where the weights are no function of the log (stochastic rounding on the host), as the
    replay itself would refuse the log at the end, and where nothing trains (a copy of the
    model loaded is no best step)."""
    if job.optim.max_steps == 0:
        raise ValueError(
            "--export-best with --max-steps 0: nothing is trained, so the best dev step's "
            "model is the one loaded; drop --export-best"
        )
    transfer, state = job.offload.transfer_dtype, job.optim.state_dtype
    rounds = None
    if transfer not in (None, "fp32") and job.peft.peft == "none":
        rounds = f"--transfer-dtype {transfer}"
    elif state not in (None, "fp32"):
        rounds = f"--state-dtype {state}"
    if rounds is not None:
        raise ValueError(
            f"--export-best replays the seed log to the best dev step, but {rounds} rounds "
            "stochastically on the host, so a step's weights are not a function of the log; "
            "drop --export-best (--save-steps with --eval-steps keeps checkpoints of the "
            "evaluated steps)"
        )
