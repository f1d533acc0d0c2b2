"""Every check a job can make before it builds anything, run identically on every rank:
the options (``distzo.config``), then what needs this machine, the model's config, the
task's files or the run directory. Bad input stops here, in one line, before any
process group or model exists."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from transformers import PretrainedConfig

from distzo.config.checks import check_job, resolve_defaults
from distzo.config.engine_options import ZOConfig
from distzo.config.job import JobConfig, expand_home
from distzo.data.hub_spec import COMMIT, hub_spec
from distzo.data.loaders import (
    HubPin,
    cached_dataset_revision,
    fill_hub_cache,
    hub_dataset_revision,
)
from distzo.data.masked_prompts import MASKED_TASKS, masked_task
from distzo.data.task_data import LoadedRows, load_task_rows
from distzo.dist import LaunchEnv, ParallelDims
from distzo.dist import process_group as pg
from distzo.dist.collectives import initialized
from distzo.dist.launch_gate import node_first_answers, rank_0_answers
from distzo.export.hf_model import check_shard_size
from distzo.job.build import (
    DOWNLOAD_TIMEOUT,
    default_model_config,
    random_shape_config,
    token_positions,
)
from distzo.job.hub_data_commits import resumed_commits
from distzo.job.memory_plan import check_weights_fit, fewest_bytes_a_parameter
from distzo.job.moved_data import check_resumed_files_exist
from distzo.job.reporting import check_reporter
from distzo.job.resume import check_resumed_rows, drawn_noise, resume_mode
from distzo.job.run_dir import (
    check_fresh,
    check_log_leads_to_checkpoint,
    check_resumed_options,
    evaluates_as_recorded,
)
from distzo.job.run_lock import check_not_running
from distzo.job.scoring_requeue import agreed_recorded_score
from distzo.job.seed_log import SEED_LOG, is_begun_log, logged_first_step, resumed_base_revision
from distzo.models import hub
from distzo.models.config_file import config_from_text, config_text, model_size, read_config
from distzo.models.family import MASKED
from distzo.models.multimodal import checked_trained_config
from distzo.models.registry import check_causal_lm, check_supported
from distzo.models.weights import check_float_weights, check_readable
from distzo.runtime.folders import nearest_existing, unwritable
from distzo.runtime.master_dtypes import MASTER_DTYPES

logger = logging.getLogger("distzo.train")
K = TypeVar("K", bound=Hashable)


@dataclass
class CheckedJob:
    """A job whose every option was checked and resolved: the engine's options, the
    parallel layout, the task's rows (None: generated data), and a CPU rank's thread count
    with where it came from (None on CUDA, where the threads are left as they are)."""

    job: JobConfig
    config: ZOConfig
    dims: ParallelDims
    rows: LoadedRows | None
    threads: tuple[int, str] | None = None
    # a resume that evaluates as its run did: a finished run's final evaluation stands
    evaluates_as_recorded: bool = False
    # a requeue of a finished scoring run whose record stands: its evaluations, by split
    recorded_score: dict[str, dict[str, float]] | None = None


def resolve_device(name: str, env: LaunchEnv) -> str:
    """One rank = one GPU: ``auto`` and a bare ``cuda`` mean cuda:LOCAL_RANK."""
    if name in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{env.local_rank % torch.cuda.device_count()}"
    return name


def model_config_of(job: JobConfig, env: LaunchEnv) -> PretrainedConfig:
    """The model's config alone (a small file): enough to reject bad input before loading.
    A hub name's is rank 0's, told to the other ranks (``hub_model_config``)."""
    if job.model.model_config:
        return random_shape_config(job)
    name = job.model.model
    if name is None:
        return default_model_config(job.data.task)
    local = hub.local_model_dir(name)
    if local is None:  # a resume's: the commit its weights are read at, not main's
        revision = resumed_base_revision(Path(job.run.output_dir or "."), job.run.resume)
        return hub_model_config(name, env, job.parallel.dist_timeout, revision)
    check_readable(local)
    return read_config(name)


def hub_model_config(
    name: str, env: LaunchEnv, timeout_s: float, revision: str | None = None
) -> PretrainedConfig:
    """Hub model ``name``'s config, read by rank 0 alone and told to the others before the
    process group forms: each rank reading its own asked the hub 7 times (distzo's probe and
    two questions, transformers' three, huggingface_hub's one), 448 requests as 64 ranks
    launched, which the hub's rate limit refused (HTTP 429). Rank 0's refusal is every
    rank's line. The weights are downloaded later, once a node, in the build."""
    told = rank_0_answers(
        env,
        f"--model {name}'s config",
        lambda: config_text(read_config(name, revision=revision)),
        timeout_s,
    )
    return config_from_text(told)


def check_model(job: JobConfig, config: ZOConfig, env: LaunchEnv) -> bool:
    """A supported family whose weights the node can hold, with room for the task's
    longest sequence; whether it is a masked LM (its task's rows are a masked LM's)."""
    # a multimodal checkpoint: its text model, which is what trains and what the host holds
    trained = model_config_of(job, env)
    model_config = checked_trained_config(trained, job.peft.adapter_spec().targets)
    check_masked_job(job, model_config.model_type)
    job.peft.adapter_spec().check_default_targets(model_config.model_type)
    where = f"--model {job.model.model}"
    check_float_weights(getattr(model_config, "quantization_config", None), where)
    if job.model.model:  # a folder's or the hub's config.json (the built-in shapes are sane)
        each = fewest_bytes_a_parameter(config, MASTER_DTYPES[job.model.dtype])
        size = model_size(model_config, where)
        check_weights_fit(size, each, config.torch_device(), job.run.force, where)
    data = job.data
    family = check_supported(model_config.model_type)
    if data.task != "counting" and 0 < data.max_length < 2:
        # a prompt keeps one token at least, so a candidate or answer gets max_length - 1;
        # a masked LM's label words are scored at its <mask>, inside the prompt
        scored, limit = "token of a candidate or answer to score after its prompt", "the model's"
        if data.task == "text":
            scored = "next token to predict"
        elif family.lm_kind == MASKED:
            scored, limit = "room for the <mask> after the row's first token", "MeZO's"
        for_task = " for the task" if family.lm_kind == MASKED else ""
        raise ValueError(
            f"--max-length {data.max_length} leaves no {scored}; raise --max-length (at least "
            f"2, or 0: {limit} limit{for_task})"
        )
    positions = token_positions(job, model_config)
    prefix = f" less the {job.peft.prefix_length}-token prefix" if job.peft.peft == "prefix" else ""
    if positions < 2:
        # RoBERTa's rows before a first token named too: "130 less the 127-token prefix"
        # left 3 rows, and no reason why that was no room
        reserved = family.reserved_positions(model_config)
        taken = [f"the {reserved} it keeps before a first token"] if reserved else []
        taken += [f"the {job.peft.prefix_length}-token prefix"] if prefix else []
        less = f" less {' and '.join(taken)}" if taken else ""
        # without a prefix the config itself is wrong: the model holds no sequence at all
        fix = "lower --prefix-length" if prefix else "check the model's config.json"
        raise ValueError(
            f"the model's max_position_embeddings {model_config.max_position_embeddings}{less} "
            f"leaves no room for a sequence; {fix}"
        )
    longest = data.seq_len if data.task == "counting" else data.max_length
    # RoBERTa's positions count from its pad id + 1: fewer tokens than table rows
    held = f" ({positions} token positions)" if family.reserved_positions(model_config) else ""
    if longest > positions:
        flag = "--seq-len" if data.task == "counting" else "--max-length"
        raise ValueError(
            f"{flag} {longest} exceeds the model's max_position_embeddings "
            f"{model_config.max_position_embeddings}{prefix}{held}; lower {flag}"
        )
    return family.lm_kind == MASKED


def check_masked_job(job: JobConfig, model_type: str) -> None:
    """What a masked LM (RoBERTa) cannot train on, refused in one line from its config
    alone: a named shape (its text goes through the byte tokenizer, which has no
    ``<mask>``), a task with no masked-LM prompt (``MASKED_TASKS``: MeZO's RoBERTa tasks),
    the next-token objective (``f1`` scores a generation task, which none of them is:
    ``check_objective`` refuses it with the options)."""
    if check_supported(model_type).lm_kind != MASKED:
        return
    shape = job.model.model_config
    if shape:
        raise ValueError(
            f"--model-config {shape} is a masked LM, and a named shape reads text through the "
            "byte tokenizer, which has no <mask> for its prompts; train --model with a "
            f"checkpoint of it, or see its memory plan: python -m distzo.job.plan_report "
            f"--model-config {shape}"
        )
    task, objective = job.data.task, job.optim.objective
    fix = (
        f"train it on one of MeZO's RoBERTa tasks ({', '.join(MASKED_TASKS)}) with "
        "--objective classification (their default) or accuracy"
    )
    if task in ("counting", "text"):
        check_causal_lm(model_type, f"--task {task}", fix)
    masked_task(task)  # a task with no masked-LM prompt: its one line
    if objective == "lm":
        check_causal_lm(model_type, f"--objective {objective}", fix)


def task_rows(
    job: JobConfig, env: LaunchEnv, masked: bool = False, resumed: dict[str, str] | None = None
) -> LoadedRows | None:
    """The task's rows, an ``hf:`` dataset's read at the commit rank 0 was told (the hub's
    questions, rank 0's alone) and downloaded into each node's cache by its first rank, then
    read offline by all: each rank asking for itself made 15 requests, 960 as 64 ranks
    launched. One question a dataset and revision and one download a config and commit: its
    first split's prepares every split (a train and a validation split asked twice made 27
    requests on rank 0, not 16). A refusal (rank 0's, a node's first rank's) is every
    waiting rank's line. ``resumed``: the commit a resume reads a source at, by source (the
    run's, ``hub_data_commits``), asked of no hub. The commit each source was read at is
    ``LoadedRows.commits``, which the seed log records. One process reads the same way
    (its own rank 0 and node), a local folder (a clone) as ``datasets`` reads it."""
    data = job.data
    sources = dict.fromkeys(s for s in (data.train_file, data.eval_file) if s)
    hub_sources = [source for source in sources if source.startswith("hf:")]
    if not env.launched or env.world_size == 1:  # a folder has no commit to record
        hub_sources = [source for source in hub_sources if not Path(_dataset(source)[0]).is_dir()]
    if not hub_sources:
        return load_task_rows(
            data.task,
            data.train_file,
            data.eval_file,
            data.sampling,
            masked=masked,
            columns=data.column_map,
        )
    resumed = resumed or {}
    revisions = launch_commits(env, hub_sources, job.parallel.dist_timeout, resumed)
    filled = first_of_each(hub_sources, lambda source: _copy(source, revisions)).values()

    def fill_node_cache() -> str:
        for source in filled:  # rank 0 asked which commit: the hub answers, or its cache
            commit, from_cache = revisions[source]
            answered = env.rank == 0 and not from_cache and source not in resumed
            fill_hub_cache(source, commit or None, answered, from_cache)
        return "filled"

    question = f"{', '.join(hub_sources)} in the node's cache"
    node_first_answers(env, question, fill_node_cache, DOWNLOAD_TIMEOUT)
    pins = {source: HubPin(pin[0] or None, cached=True) for source, pin in revisions.items()}
    rows = load_task_rows(
        data.task, data.train_file, data.eval_file, data.sampling, pins, masked, data.column_map
    )
    if rows is not None:
        given = {"--train-file": data.train_file, "--eval-file": data.eval_file}
        read = {flag: revisions.get(source or "", ("", False))[0] for flag, source in given.items()}
        rows.commits = {flag: commit for flag, commit in read.items() if commit}
    return rows


def launch_commits(
    env: LaunchEnv, hub_sources: list[str], timeout: float, known: dict[str, str] | None = None
) -> dict[str, tuple[str, bool]]:
    """Each ``hf:`` source's commit, rank 0's answer told to every rank, and whether it is
    that of the copy rank 0's cache holds: the hub's, asked once a dataset and revision;
    where the hub answers rank 0 nothing, its cache's copy's, once a config (each node read
    its own cache's newest copy, so nodes whose caches held two commits' copies read two
    sets of rows). "": neither, each node's cache read as it is (the load's error), but for
    a spec naming a revision: refused. ``known``: a source's commit, asked of no one."""
    known = known or {}
    asking = [source for source in hub_sources if source not in known]
    asked = {
        name: rank_0_answers(
            env, f"{source}'s revision", functools.partial(hub_dataset_revision, source), timeout
        )
        for name, source in first_of_each(asking, _dataset).items()
    }
    silent = [source for source in asking if not asked[_dataset(source)]]
    launched = env.launched and env.world_size > 1
    cached = {
        key: rank_0_answers(
            env,
            f"{source}'s cached commit",
            functools.partial(rank_0s_copy, source, launched),
            timeout,
        )
        for key, source in first_of_each(silent, _dataset_config).items()
    }
    commits = {source: (known[source], False) for source in hub_sources if source in known}
    commits |= {source: (asked[_dataset(source)], False) for source in asking}
    for source in silent:
        if cached[_dataset_config(source)]:
            commits[source] = (cached[_dataset_config(source)], True)
        elif hub_spec(source).revision is not None:
            raise ValueError(unresolved(source))
    return commits


def unresolved(source: str) -> str:
    """Why ``hf:`` source ``source``'s revision names no commit here: the hub is silent and
    the cache holds no copy of it (a tag or a branch only the hub resolves)."""
    revision = hub_spec(source).revision
    held = (
        "holds no copy at that commit"
        if COMMIT.fullmatch(revision or "")
        else ("cannot say which commit a tag or branch names")
    )
    return (
        f"{source}: the hub did not answer about revision {revision}, and the datasets cache "
        f"{held}; run with the hub reachable, or name a commit the cache holds a copy of "
        f"({hub_spec(source).at('COMMIT')})"
    )


def _dataset(source: str) -> tuple[str, str | None]:
    """An ``hf:`` source's dataset and revision: the hub's commit is asked once for each."""
    spec = hub_spec(source)
    return spec.path, spec.revision


def _dataset_config(source: str) -> tuple[str, str | None, str | None]:
    """An ``hf:`` source's dataset, config and revision: a cached copy is looked for once
    for each."""
    spec = hub_spec(source)
    return spec.path, spec.config, spec.revision


def _copy(source: str, commits: dict[str, tuple[str, bool]]) -> tuple[str, str | None, str]:
    """An ``hf:`` source's dataset, config and commit: a copy is prepared once for each."""
    spec = hub_spec(source)
    return spec.path, spec.config, commits[source][0]


def rank_0s_copy(source: str, launched: bool = True) -> str:
    """The commit of ``hf:`` dataset ``source``'s copy in rank 0's cache (the hub silent to
    it), said in rank 0's log: the launch reads it on every node."""
    commit = cached_dataset_revision(source)
    if commit and launched:
        logger.warning(
            "%s: the hub did not answer rank 0; every node reads the copy at commit %s in its "
            "datasets cache, as rank 0 does",
            source,
            commit,
        )
    elif commit:
        logger.warning(
            "%s: the hub did not answer; the copy at commit %s in the datasets cache is read",
            source,
            commit,
        )
    return commit


def first_of_each(sources: list[str], key: Callable[[str], K]) -> dict[K, str]:
    """The first of ``sources`` of each ``key``, in their order."""
    first: dict[K, str] = {}
    for source in sources:
        first.setdefault(key(source), source)
    return first


def check_output_dir(output_dir: str | None, flag: str = "--output-dir") -> None:
    """A run (or log) directory that can be made: refused before any run directory exists
    when a path component is a file, or the nearest existing folder is not writable."""
    existing = nearest_existing(Path(output_dir or "runs").absolute())
    if not existing.is_dir():
        raise ValueError(
            f"{flag} {output_dir}: {existing} is a file, not a directory; give another {flag}"
        )
    why = unwritable(existing)
    if why is not None:
        raise ValueError(
            f"{flag} {output_dir or 'runs/'}: {existing} is not writable ({why}); give "
            f"another {flag}"
        )


def resumed_noise(job: JobConfig, config: ZOConfig, env: LaunchEnv) -> ZOConfig:
    """A resumed run goes on with the z it was drawn with (its checkpoint's or log's)."""
    drawn = drawn_noise(Path(job.run.output_dir or "."), env.rank)
    if job.optim.noise not in (None, drawn):
        raise ValueError(
            f"--resume: the run was drawn with {drawn} noise; drop --noise {job.optim.noise} "
            f"or set it to {drawn}"
        )
    return dataclasses.replace(config, noise=drawn)


def check_log_from_step_zero(run_dir: Path, done: int) -> None:
    """``--export-best`` replays the seed log from step 0 at the run's end: a resume whose
    log begins later (a checkpoint copied in, now or by an earlier session, after ``done``
    steps) is refused here, before it trains, rather than by the replay after training."""
    log = run_dir / SEED_LOG
    first = logged_first_step(log) if is_begun_log(log) else done
    if first > 0:
        raise ValueError(
            f"--export-best replays the seed log from step 0, but the run in {run_dir} went "
            f"on from a checkpoint copied in at step {first} (its seed log begins there); drop "
            "--export-best (--save-steps with --eval-steps keeps checkpoints of the evaluated "
            "steps)"
        )


def score_again(job: JobConfig, env: LaunchEnv) -> None:
    """A requeue of a finished scoring run whose record does not stand (cut short, or this
    command evaluates otherwise): it scores afresh over the old run's files, said first."""
    if env.rank == 0:
        logger.warning(
            "--resume: the scoring run in %s finished, but its eval.jsonl does not record "
            "what this command evaluates (a record is missing, or an option such as "
            "--max-new-tokens changed): scoring again; its old run's files go, as with "
            "--overwrite",
            job.run.output_dir,
        )
    job.run.resume, job.run.overwrite = "no", True


def check_one_group(env: LaunchEnv) -> None:
    """A launched process trains one job: the process group is the job's, and a second
    group of the same torchrun attempt would meet the first one's keys in its store. A
    second Trainer there (a sweep under torchrun) failed in build, in torch's words
    ("trying to initialize the default process group twice!")."""
    if env.launched and initialized():
        raise ValueError(
            "this process already joined a process group (an earlier Trainer's, or the "
            "script's own): under torchrun a process trains one job; launch each run with "
            "a torchrun of its own"
        )


def validate(job: JobConfig, env: LaunchEnv) -> CheckedJob:
    """Check and resolve ``job`` in place (its config.toml records the resolved values)."""
    check_one_group(env)
    lr_defaulted = job.optim.lr is None
    expand_home(job)
    resolve_defaults(job)
    dims = check_job(job, env)
    config = job.engine_config(resolve_device(job.parallel.device, env))
    pg.resolve_backend(job.parallel.backend, config.torch_device())
    cpu = config.torch_device().type == "cpu"
    threads = pg.cpu_threads(job.parallel.threads, env) if cpu else None
    masked = check_model(job, config, env)
    check_output_dir(job.run.output_dir)
    if job.run.output_dir is not None:  # a live job's files would mislead the checks below
        check_not_running(Path(job.run.output_dir))
    if job.run.log_dir:
        check_output_dir(job.run.log_dir, "--log-dir")
    job.run.resume = resume_mode(job.run, env, scoring=job.optim.max_steps == 0)
    run_dir = Path(job.run.output_dir or ".")
    # a resume reads each hf: source at the commit its run read
    resumed = resumed_commits(job, run_dir, env.rank) if job.run.resume == "yes" else None
    if job.run.resume == "yes":  # the run's data file gone: said as the run's, with the way on
        check_resumed_files_exist(job, run_dir)
    # every row checked, before any model
    rows = task_rows(job, env, masked, resumed)
    check_shard_size(job.run.export_shard_size)
    check_reporter(job.run.report_to)
    recorded = None
    if job.run.resume == "yes":  # the run directory's own checks, before reading a checkpoint
        done = check_log_leads_to_checkpoint(Path(job.run.output_dir or "."), env.rank == 0)
        if job.optim.max_steps < done:
            raise ValueError(
                f"--resume: the run in {job.run.output_dir} has done {done} steps, more than "
                f"--max-steps {job.optim.max_steps}; give --max-steps {done} or more"
            )
        as_recorded = evaluates_as_recorded(job)  # before the resume's own options are kept
        check_resumed_options(job, env, rows)  # may take the run's seed for -1
        if job.run.export_best:
            check_log_from_step_zero(Path(job.run.output_dir or "."), done)
        check_resumed_rows(
            Path(job.run.output_dir or "."), rows, job.data.train_file, job.data.eval_file
        )
        config = dataclasses.replace(config, seed=job.run.engine_seed)
        if job.optim.max_steps == 0:  # a finished scoring run (none done: no checkpoint)
            recorded = agreed_recorded_score(job, env, as_recorded)
            if recorded is None:
                score_again(job, env)
    else:
        as_recorded = False
        check_fresh(job)
    if job.run.resume != "no":
        config = resumed_noise(job, config, env)
    job.optim.noise = config.noise  # resolved: config.toml records it
    if lr_defaulted and env.rank == 0:  # only once every check passed: bad input stays one line
        logger.info("lr %g: the default for this model and task (--lr sets it)", job.optim.lr)
    return CheckedJob(job, config, dims, rows, threads, as_recorded, recorded)
