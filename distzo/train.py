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
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoConfig, PretrainedConfig

from distzo.adapters.peft_adapters import AdapterWeights, attach_adapter
from distzo.config.checks import check_job, resolve_defaults
from distzo.config.cli import fail
from distzo.config.engine_options import ZOConfig, optimizer_record
from distzo.config.job import JobConfig, resolve, write_resolved
from distzo.data.encoding import PromptEncoder
from distzo.data.task_data import (
    CountingData,
    LoadedRows,
    PromptData,
    TextData,
    load_task_rows,
)
from distzo.dist import (
    Collectives,
    LaunchEnv,
    ParallelContext,
    ParallelDims,
    ShardGroup,
    broadcast_seed,
)
from distzo.dist import process_group as pg
from distzo.engine import ZOEngine, resolve_transfer
from distzo.export.hf_model import export_model
from distzo.job.checkpoint import Checkpointer, checkpoint_noise, latest_checkpoint
from distzo.job.evaluation import evaluate
from distzo.job.memory_plan import MemoryPlan, check_fits, plan_memory
from distzo.job.preemption import EXIT_PREEMPTED, Preempted, StopSignals
from distzo.job.reporting import Reporter, make_reporter
from distzo.job.seed_log import SeedLogWriter, check_same_run, read_seed_log_once, step_grads
from distzo.models import check_supported, hub, model_from_config
from distzo.models.shapes import shape_config
from distzo.models.tiny import byte_tokenizer, tiny_opt_config
from distzo.models.weights import RandomWeights, open_checkpoint, skeleton
from distzo.objectives import F1, Accuracy, Classification, LanguageModeling, Objective
from distzo.runtime.devices import device_name
from distzo.runtime.host_memory import peak_rss_bytes, rss_bytes
from distzo.zo import identity_kind, noise_identity

SEED_LOG = "seedlog.jsonl"

logger = logging.getLogger("distzo.train")

MASTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
FAILURE_ENV = (
    "DISTZO_FAIL_AT"  # "RANK:STEP": that rank raises at that step (tests of failure handling)
)
SIGNAL_ENV = "DISTZO_SIGNAL_AT"  # "RANK:STEP": that rank sends itself SIGTERM just before that step (preemption tests)
KILL_ENV = "DISTZO_KILL_AT"  # "RANK:STEP": that rank SIGKILLs itself there, on a job's first attempt only (restart tests)


def configure_logging(env: LaunchEnv) -> None:
    """Rank 0 speaks; the other ranks report only warnings and errors, tagged with their rank."""
    level = logging.INFO if env.rank == 0 else logging.WARNING
    logging.basicConfig(
        level=level, format=f"%(asctime)s [rank{env.rank}] %(levelname)s %(name)s: %(message)s"
    )


def resolve_device(name: str, env: LaunchEnv) -> str:
    """One rank = one GPU: ``auto`` and a bare ``cuda`` mean cuda:LOCAL_RANK."""
    if name in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{env.local_rank % torch.cuda.device_count()}"
    return name


def default_model_config(task: str) -> PretrainedConfig:
    """The random-init model of a run without --model: the tiny OPT, sized for the byte
    tokenizer and prompt lengths when the task reads text."""
    if task == "counting":
        return tiny_opt_config()
    return tiny_opt_config(vocab_size=len(byte_tokenizer()), max_position_embeddings=512)


def model_config_of(job: JobConfig) -> PretrainedConfig:
    """The model's config alone (a small file): enough to reject bad input before loading."""
    if job.model.model_config:
        return shape_config(job.model.model_config, job.model.model_layers)
    name = job.model.model
    if name is None:
        return default_model_config(job.data.task)
    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as err:  # a missing path, a malformed name, no hub access
        raise ValueError(f"cannot load --model {name!r}: {str(err).splitlines()[0]}") from None


def validate(job: JobConfig, env: LaunchEnv) -> tuple[ZOConfig, ParallelDims, LoadedRows | None]:
    """Every check that needs no model and no process group, run identically on every rank."""
    data, optim, run = job.data, job.optim, job.run
    lr_defaulted = optim.lr is None
    resolve_defaults(job)  # resolved here, so the run's config.toml records them
    dims = check_job(job, env)
    config = job.engine_config(resolve_device(job.parallel.device, env))
    pg.resolve_backend(job.parallel.backend, config.torch_device())
    model_config = model_config_of(job)
    check_supported(model_config.model_type)
    longest = data.seq_len if data.task == "counting" else data.max_length
    if longest > model_config.max_position_embeddings:
        flag = "--seq-len" if data.task == "counting" else "--max-length"
        raise ValueError(
            f"{flag} {longest} exceeds the model's max_position_embeddings "
            f"{model_config.max_position_embeddings}; lower {flag}"
        )
    rows = load_task_rows(
        data.task, data.train_file, data.eval_file
    )  # every row checked, before any model
    run.resume = resume_mode(run, env)
    if run.resume != "no":  # the run goes on with the z it was drawn with
        drawn = drawn_noise(Path(run.output_dir))
        if optim.noise not in (None, drawn):
            raise ValueError(
                f"--resume: the run was drawn with {drawn} noise; drop --noise {optim.noise} or set it to {drawn}"
            )
        config.noise = drawn
    optim.noise = config.noise  # resolved: config.toml records it
    if lr_defaulted and env.rank == 0:  # only once every check passed: bad input stays one line
        logger.info("lr %g: the default for this model and task (--lr sets it)", optim.lr)
    return config, dims, rows


def resume_mode(run, env: LaunchEnv) -> str:
    """``no`` or ``yes``, resolved: ``auto`` (the default under torchrun --max-restarts > 0)
    resumes when the run directory holds a checkpoint or logged steps to go on from."""
    if run.resume is None and env.max_restarts > 0 and not run.output_dir:
        if env.rank == 0:
            logger.warning(
                "torchrun restarts this job, but without --output-dir a restart starts afresh in a new "
                "directory: give --output-dir to resume where it stopped"
            )
        return "no"
    mode = run.resume or ("auto" if env.max_restarts > 0 else "no")
    if mode != "no" and not run.output_dir:
        raise ValueError(f"--resume {mode} needs --output-dir: the run directory to resume")
    if mode == "no":
        return mode
    directory = Path(run.output_dir)
    if latest_checkpoint(directory / "checkpoints"):
        return "yes"
    if mode == "yes":
        raise ValueError(
            f"--resume: no checkpoint in {run.output_dir}/checkpoints; drop --resume to start afresh"
        )
    return "yes" if logged_steps(directory / SEED_LOG) else "no"


def logged_steps(path: Path) -> int:
    """How many steps a seed log holds (0: none, or no log)."""
    if not path.is_file():
        return 0
    try:
        return len(read_seed_log_once(path)[1])
    except ValueError:
        return 0


def drawn_noise(run_dir: Path) -> str:
    """The noise kind a resumed run was drawn with: its checkpoint's, else its seed log's."""
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    if checkpoint is not None:
        return checkpoint_noise(checkpoint)
    return identity_kind(read_seed_log_once(run_dir / SEED_LOG)[0].get("noise", "legacy"))


def catch_up_from_log(
    engine: ZOEngine, run_dir: Path, header: dict, parallel: ParallelContext
) -> int:
    """Apply every step the seed log holds beyond the engine's (a restart after a crash
    or a preemption), in one pass over the blocks; returns the step to train from.
    Rank 0 reads the log and hands the records to every rank. A low-bit transfer or state
    rounds on the host at each step, which a catch-up cannot repeat: those steps are
    trained again instead (the same result)."""
    path = run_dir / SEED_LOG
    start = engine.step_index
    records = None
    if parallel.env.rank == 0 and path.is_file():
        logged_header, steps = read_seed_log_once(path)
        check_same_run(path, logged_header, header)
        records = [(r["step"], step_grads(r), r["lr"]) for r in steps[start:]]
    records = parallel.comm.broadcast_object(records) if parallel.is_distributed else records
    if not records:
        return start
    if engine.config.rounds_on_host:
        logger.info(
            "steps %d-%d are in the seed log, but a low-bit transfer rounds at every step: training them "
            "again from step %d",
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


def model_source(name: str | None, env: LaunchEnv, comm: Collectives) -> Path | None:
    """The local directory a --model streams from: the path itself, or a hub name's
    snapshot, downloaded once per node by its first local rank while the others wait."""
    if not name:
        return None
    if Path(name).is_dir():
        return Path(name)
    path = hub.snapshot(name, download=True) if env.local_rank == 0 else None
    comm.barrier()  # the node's download is complete
    return path if path is not None else hub.snapshot(name, download=False)


def load_tokenizer(job: JobConfig, source: Path | None):
    """The model's own tokenizer, or the built-in byte tokenizer of a random-init model."""
    if job.data.task == "counting":
        return None
    if source is None:  # the default tiny model or a --model-config shape
        return byte_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"--model {job.model.model}: no tokenizer to read the task's text ({str(err).splitlines()[0]})"
        ) from None


def build_task_data(job: JobConfig, rows: LoadedRows | None, tokenizer, model_config, seed: int):
    """Needs the model's config only (vocabulary, positions): built before the model, so
    the memory plan knows the real longest sequence."""
    if rows is None:
        return CountingData(
            model_config.vocab_size,
            job.data.seq_len,
            job.data.eval_batch_size,
            seed,
            job.data.eval_batch_size,
        )
    encoder = PromptEncoder(tokenizer, job.data.max_length or model_config.max_position_embeddings)
    if job.data.task == "text":
        return TextData(rows, encoder, seed, job.data.eval_batch_size)
    return PromptData(
        rows, encoder, seed, job.data.eval_batch_size, job.data.max_new_tokens, job.optim.objective
    )


def build_objective(name: str, data, tokenizer) -> Objective:
    """What the engine's steps minimise (the pairing with the task was checked in validate)."""
    if name == "classification":
        return Classification()
    if name == "accuracy":
        return Accuracy()
    if name == "f1":
        answers = [e.answers for e in data.train_examples]
        return F1(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), answers)
    return LanguageModeling()


def build_model(job: JobConfig, dtype: torch.dtype, seed: int, source: Path | None):
    """(model, weight source): a skeleton filled bucket by bucket for a --model-config shape
    or a checkpoint directory (a local path or a hub snapshot: never materialised whole);
    otherwise the default tiny model, built whole."""
    if job.model.model_config:
        return skeleton(
            shape_config(job.model.model_config, job.model.model_layers), dtype
        ), RandomWeights(seed)
    if source is not None:
        return skeleton(AutoConfig.from_pretrained(source), dtype), open_checkpoint(source)
    return model_from_config(default_model_config(job.data.task), dtype), None


def memory_plan(
    job: JobConfig, model, data, config: ZOConfig, parallel: ParallelContext, device: torch.device
) -> MemoryPlan:
    sliced = resolve_transfer(config, device, parallel) == "sliced"
    seq = data.longest
    shard = parallel.shard_group.size if parallel.shard_group else 1
    rows = (
        job.data.batch_size // parallel.dims.dp * data.rows_per_example
    )  # candidates on rows of their own
    batch = max(rows, job.data.eval_batch_size // parallel.env.world_size, 1)
    env = parallel.env
    return plan_memory(
        model,
        config,
        shard,
        sliced,
        batch,
        seq,
        len(parallel.signs),
        env.world_size,
        env.local_world_size,
        async_save=job.run.save_async and job.run.save_steps > 0,
    )


def choose_slots(
    job: JobConfig, model, data, config: ZOConfig, parallel: ParallelContext, device: torch.device
) -> MemoryPlan:
    """The memory plan, with the slot count resolved: 3 unless --num-slots says otherwise or
    3 do not fit where 2 do (then 2, said in the log). Recorded in config.toml."""
    plan = memory_plan(job, model, data, config, parallel, device)
    if job.offload.num_slots is None and config.mode == "offload":
        try:
            check_fits(plan, device, parallel.env.local_world_size, force=False)
        except ValueError:
            two = memory_plan(
                job, model, data, dataclasses.replace(config, num_slots=2), parallel, device
            )
            try:
                check_fits(two, device, parallel.env.local_world_size, force=False)
            except ValueError:
                pass  # neither fits: the 3-slot plan's refusal (or --force) decides
            else:
                logger.info(
                    "3 device slots do not fit; using 2 (upload then waits for the offload two blocks back)"
                )
                config.num_slots, plan = 2, two
    job.offload.num_slots = config.num_slots
    return plan


def build_parallel(
    job: JobConfig, env: LaunchEnv, dims: ParallelDims, device: torch.device
) -> ParallelContext:
    if not env.launched:
        return ParallelContext(env, dims, comm=Collectives(device))
    pg.init_process_group(
        env, pg.resolve_backend(job.parallel.backend, device), job.parallel.dist_timeout
    )
    comm = Collectives.for_job(
        device
    )  # the device group's collectives, and a gloo group for the host's
    mesh = pg.build_mesh(dims, device)
    group, members = pg.node_groups(env, comm)
    return ParallelContext(
        env, dims, mesh, ShardGroup(group, members, members.index(env.rank)), comm
    )


def injected_failure(rank: int, variable: str = FAILURE_ENV) -> int | None:
    """The step at which this rank must fail, from ``variable=RANK:STEP``."""
    spec = os.environ.get(variable)
    if not spec:
        return None
    fail_rank, fail_step = (int(x) for x in spec.split(":"))
    return fail_step if fail_rank == rank else None


def describe(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k.removeprefix('eval_')} {v:.4f}" for k, v in metrics.items())


def _truncate_jsonl(path: Path, keep_below: int) -> None:
    """Drop the records a resumed run will write again (those of step >= ``keep_below``),
    and a last line a crash tore (not JSON), through a temporary file and a rename."""
    if path.exists():
        kept = []
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "step" not in record or record["step"] < keep_below:
                kept.append(line)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)


class RunLogs:
    """Rank 0's JSON-lines files: per-step metrics, evaluations and the seed log."""

    def __init__(
        self,
        run_dir: Path,
        log_dir: Path,
        resume_step: int,
        header: dict,
        sync_every: int = 1,
        reporter: Reporter | None = None,
    ) -> None:
        self.reporter = reporter  # the dashboard: every metrics and eval record's numbers
        log_dir.mkdir(parents=True, exist_ok=True)
        self.paths = {
            "metrics": log_dir / "metrics.jsonl",
            "eval": log_dir / "eval.jsonl",
            "seeds": run_dir / SEED_LOG,
        }
        for name, path in self.paths.items():
            if not resume_step:
                path.unlink(missing_ok=True)
            else:
                # Step records are 0-based steps taken; an evaluation "at step N" saw the state
                # after N steps, which is the checkpoint the run resumes from: it stays.
                _truncate_jsonl(path, resume_step + 1 if name == "eval" else resume_step)
        self.files = {name: open(path, "a") for name, path in self.paths.items() if name != "seeds"}
        self.seeds = SeedLogWriter(self.paths["seeds"], sync_every)
        if not resume_step:
            self.write("seeds", {"kind": "header", **header})

    def write(self, name: str, record: dict) -> None:
        if name == "seeds":
            self.seeds.write(record)
            return
        self.files[name].write(json.dumps(record) + "\n")
        self.files[name].flush()
        if self.reporter is not None:
            prefix = "train" if name == "metrics" else "eval"
            self.reporter.log(
                {
                    f"{prefix}/{key.removeprefix('eval_')}": float(value)
                    for key, value in record.items()
                    if key != "step"
                    and isinstance(value, (int, float))
                    and not isinstance(value, bool)
                },
                record["step"],
            )

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.seeds.close()
        if self.reporter is not None:
            self.reporter.close()


def stop_after(
    job: JobConfig,
    checkpointer: Checkpointer,
    logs: RunLogs | None,
    done: int,
    received: str | None,
) -> None:
    """End a preempted run at a step boundary: a checkpoint of ``done`` steps with
    ``--save-on-signal`` (else the synced seed log is what a restart catches up from), an
    asynchronous save in flight completed, the logs closed; then ``Preempted``."""
    if job.run.save_on_signal:
        checkpointer.save(asynchronous=False)
    else:
        checkpointer.wait()
    if logs:
        logs.close()  # syncs the seed log
    raise Preempted(done, received or "a signal to another rank")


def train(
    job: JobConfig,
    env: LaunchEnv,
    config: ZOConfig,
    dims: ParallelDims,
    rows: LoadedRows | None,
    signals: StopSignals | None = None,
) -> dict:
    device = config.torch_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif env.launched or job.parallel.threads:
        logger.info("%d CPU threads per rank", pg.set_cpu_threads(env, job.parallel.threads))
    parallel = build_parallel(job, env, dims, device)
    seed = broadcast_seed(config.seed, parallel.comm)
    stamp = parallel.comm.broadcast_object(datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    run_dir = Path(job.run.output_dir or f"runs/{stamp}")
    job.run.seed = seed  # the resolved config repeats the run, even when the seed was drawn
    logger.info(
        "run %s: seed %d; %d ranks as dp %d x pert %d",
        run_dir,
        seed,
        env.world_size,
        dims.dp,
        dims.pert,
    )

    torch.manual_seed(seed)  # the random init of the default model: equal on every rank
    dtype = MASTER_DTYPES[job.model.dtype]
    source = model_source(job.model.model, env, parallel.comm)
    tokenizer = load_tokenizer(job, source)
    model, weights = build_model(job, dtype, seed, source)
    if env.rank == 0 and weights is None and not job.model.model and job.run.resume == "no":
        model.save_pretrained(run_dir / "base")  # replay needs the initial weights
        if tokenizer is not None:
            tokenizer.save_pretrained(run_dir / "base")
    spec = job.peft.adapter_spec()
    if (
        spec.enabled
    ):  # the same adapter init on every rank, on resume and in a replay: seeded by the run
        model = attach_adapter(model, spec, seed)
        weights = AdapterWeights(weights, model) if weights is not None else None
    data = build_task_data(job, rows, tokenizer, model.config, seed)
    plan = choose_slots(job, model, data, config, parallel, device)
    logger.info("memory plan: %s", plan.describe())
    check_fits(plan, device, env.local_world_size, job.run.force)
    if env.rank == 0:
        write_resolved(job, run_dir)
    objective = build_objective(job.optim.objective or "lm", data, tokenizer)
    engine = ZOEngine(
        model, config, parallel=parallel, run_seed=seed, weights=weights, objective=objective
    )
    checkpointer = Checkpointer(run_dir / "checkpoints", engine, job.run.keep_checkpoints)
    checkpoint = latest_checkpoint(run_dir / "checkpoints") if job.run.resume == "yes" else None
    start_step = checkpointer.load(checkpoint) if checkpoint is not None else 0
    header = {
        "run_seed": engine.run_seed,
        "noise_chunk": config.noise_chunk,
        "noise": noise_identity(config.noise),
        "weight_decay": config.weight_decay,
        "device_type": device.type,
        "dtype": job.model.dtype,
        "transfer_dtype": config.transfer_dtype,
        "base": job.model.model or (None if job.model.model_config else str(run_dir / "base")),
        "model_config": job.model.model_config,
        "model_layers": job.model.model_layers,
        "init_seed": seed,
        "objective": objective.name,
        "peft": spec.record() if spec.enabled else None,
        "optimizer": optimizer_record(config),
    }
    if job.run.resume == "yes":
        start_step = catch_up_from_log(engine, run_dir, header, parallel)
    logs = None
    if env.rank == 0:
        reporter = make_reporter(job.run.report_to, run_dir, dataclasses.asdict(job))
        logs = RunLogs(
            run_dir,
            Path(job.run.log_dir) if job.run.log_dir else run_dir,
            start_step,
            header,
            job.run.log_sync_steps,
            reporter,
        )
    fail_at = injected_failure(env.rank)
    kill_at = injected_failure(env.rank, KILL_ENV) if env.restart_count == 0 else None
    signal_at = injected_failure(env.rank, SIGNAL_ENV) if job.run.resume != "yes" else None
    link_bytes = (
        engine.link_bytes_per_step
    )  # what one step moves over the host link: fixed by the layout

    # A resumed run does not evaluate where it starts: an evaluation applies the pending
    # update (a flush), and with a low-bit transfer a flush moves a rounding point, so an
    # extra one would part the resumed trajectory from the uninterrupted run's.
    before = evaluate(engine, data, parallel) if start_step == 0 else None
    if before is not None:
        logger.info("eval before training: %s", describe(before))
        if logs:
            logs.write("eval", {"step": 0, **before})
    started, tokens = time.perf_counter(), 0
    progress = tqdm(
        range(start_step, job.optim.max_steps),
        desc="train",
        initial=start_step,
        total=job.optim.max_steps,
        disable=None if env.rank == 0 else True,
    )
    for step in progress:
        if step == fail_at:
            raise RuntimeError(f"failure injected by {FAILURE_ENV} at step {step}")
        if step == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)  # delivered to the handler before the step starts
        if step == kill_at:
            logger.error("killing rank %d at step %d (%s)", env.rank, step, KILL_ENV)
            os.kill(os.getpid(), signal.SIGKILL)
        step_start = time.perf_counter()
        global_batch = data.batch(job.data.batch_size, step)  # the same rows on every rank
        num_items = objective.num_items(
            global_batch
        )  # label tokens or examples of the global batch
        result = engine.step(
            parallel.shard_batch(global_batch),
            num_items=num_items,
            stop=signals is not None and signals.requested,
        )
        step_tokens = global_batch["input_ids"].numel()
        tokens += step_tokens
        step_seconds = max(time.perf_counter() - step_start, 1e-9)
        tokens_per_s = step_tokens / step_seconds
        progress.set_postfix(
            loss=f"{result.loss:.4f}",
            g=f"{result.projected_grad:+.3g}",
            tok_s=f"{tokens_per_s:.0f}",
        )
        if logs:
            record = {
                "step": step,
                "objective": objective.name,
                "loss": result.loss,
                "loss_plus": result.loss_plus,
                "loss_minus": result.loss_minus,
                "projected_grad": result.projected_grad,
                "lr": result.lr,
                "tokens_per_s": tokens_per_s,
                "link_gb_per_s": link_bytes
                / step_seconds
                / 1e9,  # uploaded by rank 0 (offloaded alike)
                "host_rss_gb": current_rss / 1e9
                if (current_rss := rss_bytes()) is not None
                else None,
                "host_peak_rss_gb": peak_rss_bytes() / 1e9,
            }
            if device.type == "cuda":
                record["peak_device_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
            if len(result.projected_grads) > 1:
                record["projected_grads"] = list(result.projected_grads)
            logs.write("metrics", record)
            logs.write(
                "seeds",
                {
                    "step": step,
                    "run_seed": engine.run_seed,
                    "projected_grads": list(result.projected_grads),
                    "lr": result.lr,
                },
            )
        if result.stop:  # a rank was signalled: every rank stops here, after this step's records
            stop_after(job, checkpointer, logs, step + 1, signals.received if signals else None)
        if job.run.log_every and (step % job.run.log_every == 0 or step == job.optim.max_steps - 1):
            logger.info(
                "step %d loss %.4f g %+.4g lr %.3g",
                step,
                result.loss,
                result.projected_grad,
                result.lr,
            )
        done = step + 1
        if job.run.eval_steps and done % job.run.eval_steps == 0 and done < job.optim.max_steps:
            metrics = evaluate(engine, data, parallel)
            logger.info("eval at step %d: %s", done, describe(metrics))
            if logs:
                logs.write("eval", {"step": done, **metrics})
        if job.run.save_steps and done % job.run.save_steps == 0 and done < job.optim.max_steps:
            checkpointer.save(asynchronous=job.run.save_async)
        checkpointer.poll()
    elapsed = time.perf_counter() - started

    # Saved before the final evaluation, whose flush a longer run would not make here.
    checkpointer.save(asynchronous=False)
    after = evaluate(engine, data, parallel)
    if logs:
        logs.write("eval", {"step": job.optim.max_steps, **after})
    export = export_model(
        engine, run_dir / "export", tokenizer, job.run.export_shard_size, job.peft.merge_adapter
    )
    record = {
        "rank": env.rank,
        "device": device_name(device),
        "transfer": engine.transfer,
        "noise": noise_identity(config.noise),
        "noise_backend": engine.noise.backend,
        "shard_group": parallel.shard_group.members if parallel.shard_group else [env.rank],
        "mesh_coordinates": [parallel.dp_rank, parallel.pert_rank],
        "formula_coordinates": list(dims.coordinates(env.rank)),
        "host_bytes": engine.host_bytes,
        "device_bytes": engine.device_bytes,
        "peft": job.peft.peft,
        "trained_parameters": engine.num_parameters,
        "frozen_parameters": engine.num_frozen,
        "base_read_only": engine.frozen_base,
        "eval_before": before,
        "eval_after": after,
    }
    (run_dir / f"rank{env.rank}.json").write_text(json.dumps(record))
    if logs:
        logs.close()
        logger.info(
            "done: %d steps in %.1f s (%.0f tokens/s); eval %s%s; model exported to %s",
            job.optim.max_steps - start_step,
            elapsed,
            tokens / max(elapsed, 1e-9),
            f"{describe(before)} -> " if before else f"(resumed at step {start_step}) ",
            describe(after),
            export,
        )
    return after


def main(argv: list[str] | None = None) -> int:
    env = LaunchEnv.from_environ()
    configure_logging(env)
    try:
        job = resolve(argv)
        config, dims, rows = validate(job, env)
    except ValueError as err:
        return fail(str(err))  # every rank, the same line, before any model
    try:
        with StopSignals() as signals:
            train(job, env, config, dims, rows, signals)
    except ValueError as err:
        return fail(str(err))
    except Preempted as stopped:
        if env.rank == 0:
            logger.warning(
                "preempted: %s; %d steps done, --resume (or a restart) goes on from there",
                stopped,
                stopped.step,
            )
        pg.shutdown()  # every rank stopped after the same step: no collective is pending
        return EXIT_PREEMPTED
    # Any other failure propagates: the process exits non-zero and torchrun stops the other
    # ranks (a peer blocked in a collective fails by itself within --dist-timeout). The
    # process group is torn down only after success: tearing it down under a collective
    # that a dead peer will never join can hang.
    pg.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
