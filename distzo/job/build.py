"""Building a job's parts from its checked options: the parallel context, the model
(streamed where it can be), its tokenizer, the task's data, the objective, and the
memory plan that settles the slot count."""

from __future__ import annotations

import dataclasses
import logging
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from distzo.config.engine_options import ZOConfig
from distzo.config.job import JobConfig
from distzo.data.encoding import PromptEncoder
from distzo.data.masked_prompts import MASKED_PROMPTS, MaskedPromptEncoder
from distzo.data.row_share import WHOLE, RowShare
from distzo.data.task_data import (
    CountingData,
    LoadedRows,
    MaskedPromptData,
    PromptData,
    TextData,
)
from distzo.dist import Collectives, LaunchEnv, ParallelContext, ParallelDims, ShardGroup
from distzo.dist import process_group as pg
from distzo.dist.agreement import agreed, gathered
from distzo.engine import resolve_transfer
from distzo.job.evaluation import TaskData, planned_rows
from distzo.job.memory_plan import (
    MemoryPlan,
    PlannedExport,
    RankPlace,
    check_fits,
    plan_memory,
)
from distzo.models import hub, model_from_config
from distzo.models.family import MASKED
from distzo.models.multimodal import checkpoint_model
from distzo.models.registry import check_supported
from distzo.models.shapes import shape_config
from distzo.models.tiny import byte_tokenizer, shared_byte_tokenizer, tiny_opt_config
from distzo.models.weights import (
    RandomWeights,
    WeightSource,
    check_readable,
    check_weights,
    skeleton,
    with_generation_config,
)
from distzo.objectives import F1, Accuracy, Classification, LanguageModeling, Objective
from distzo.runtime.master_dtypes import MASTER_DTYPES

logger = logging.getLogger("distzo.train")

# How long a node's other ranks wait for its first rank to download a hub model: hours (a
# 405B model is ~800 GB), not --dist-timeout's minutes. A failed download ends that rank,
# and its peers with it, at once.
DOWNLOAD_TIMEOUT = timedelta(hours=12)


def default_model_config(task: str) -> PretrainedConfig:
    """The random-init model of a run without --model: the tiny OPT, sized for the byte
    tokenizer and prompt lengths when the task reads text."""
    if task == "counting":
        return tiny_opt_config()
    return with_byte_tokenizer_ids(
        tiny_opt_config(vocab_size=len(byte_tokenizer()), max_position_embeddings=512)
    )


def random_shape_config(job: JobConfig) -> PretrainedConfig:
    """The config of a --model-config shape, with the byte tokenizer's special ids when the
    task reads text through it."""
    shape = shape_config(job.model.model_config or "", job.model.model_layers)
    return with_byte_tokenizer_ids(shape) if shape_reads_bytes(job) else shape


def shape_reads_bytes(job: JobConfig) -> bool:
    """Whether the run is a --model-config shape reading its task's text through the byte
    tokenizer: its config takes that tokenizer's ids, and its seed log says so, for the
    replay to rebuild the same config and export the same tokenizer."""
    return bool(job.model.model_config) and job.data.task != "counting"


def with_byte_tokenizer_ids(config: PretrainedConfig) -> PretrainedConfig:
    """``config`` with the byte tokenizer's bos/eos/pad ids, for a random-init model that
    reads text through it: the export's generation config, derived from these, stops
    ``generate`` at its ``</s>``; the architecture's defaults (OPT's eos 2) name a byte."""
    tokenizer = byte_tokenizer()
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    return config


def token_positions(job: JobConfig, model_config: PretrainedConfig) -> int:
    """The positions a sequence's own tokens may take: the model's, less the rows it keeps
    before a first token (RoBERTa's, ``ModelFamily.token_positions``) and a prefix
    adapter's virtual tokens (they come first; a learned position table has no row past
    its end)."""
    prefix = job.peft.prefix_length if job.peft.peft == "prefix" else 0
    return check_supported(model_config.model_type).token_positions(model_config) - prefix


def build_parallel(
    job: JobConfig, env: LaunchEnv, dims: ParallelDims, device: torch.device
) -> ParallelContext:
    """The process group, the mesh and the node's shard group (a plain run: none of them)."""
    if not env.launched:
        return ParallelContext(env, dims, comm=Collectives(device))
    backend = pg.resolve_backend(job.parallel.backend, device)
    pg.init_process_group(env, backend, job.parallel.dist_timeout)
    timeout = timedelta(seconds=job.parallel.dist_timeout)
    # the device group's collectives, and a gloo group for the host's: every group the job
    # makes has the job's timeout
    comm = Collectives.for_job(device, timeout)
    mesh = pg.build_mesh(dims, device, timeout)
    group, members = pg.node_groups(env, comm)
    return ParallelContext(env, dims, mesh, ShardGroup.of(group, members, env.rank), comm)


def model_source(
    name: str | None, env: LaunchEnv, comm: Collectives, revision: str | None = None
) -> Path | None:
    """The local directory a --model streams from: the path itself, or a hub name's
    snapshot at one commit for every node (``revision``, a resumed run's; else, on several
    nodes, the one rank 0 reads as ``main``), downloaded once per node by its first local
    rank while the others wait. A node that cannot fetch it fails every rank with its line."""
    if not name:
        return None
    local = hub.local_model_dir(name)
    if local is not None:
        return local
    pinned_by = "the one the run trained on"
    main = None
    if revision is None and env.local_world_size < env.world_size:
        # each node's own main may be another commit (a cache filled last week)
        main = ranks_commit(name, env, comm)
        revision, pinned_by = main.commit, "the one rank 0 reads as main"
    failure: ValueError | None = None
    path = None
    if env.local_rank == 0:
        try:
            path = hub.snapshot(name, True, revision, pinned_by=pinned_by)
            if main is not None and main.hubs:  # the hub's main now: the node's too
                hub.point_main(path)
        except ValueError as err:  # said by every rank, after the node's wait
            failure = err
    comm.barrier(DOWNLOAD_TIMEOUT)  # the node's download is complete (not --dist-timeout's wait)

    def read() -> Path:
        if failure is not None:
            raise failure
        found = path or hub.snapshot(name, False, revision, pinned_by=pinned_by)
        # as a local folder's, before anything is built: a shard an interrupted download
        # left out was read at its first bucket, and said as "cannot write" it
        check_readable(found)
        return found

    return agreed(comm, read)


def ranks_commit(name: str, env: LaunchEnv, comm: Collectives) -> hub.MainCommit:
    """The commit rank 0 reads hub model ``name``'s ``main`` as, on every rank; a name rank
    0 cannot resolve fails every rank with its line."""
    main = agreed(comm, lambda: hub.main_commit(name) if env.rank == 0 else None)
    commit, hubs = comm.broadcast_object(None if main is None else tuple(main))
    return hub.MainCommit(str(commit), bool(hubs))


def source_tokenizer(source: Path) -> Any:
    """The tokenizer a model folder holds, or None where it holds none."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):
        return None
    return tokenizer if has_vocabulary(tokenizer) else None


def has_vocabulary(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` has a token that is not special: for a folder with no tokenizer
    files, transformers builds its model type's tokenizer class with an empty vocabulary
    (special tokens alone) instead of failing, and such a tokenizer turns text into nothing."""
    return bool(set(tokenizer.get_vocab()) - set(tokenizer.all_special_tokens))


def load_tokenizer(job: JobConfig, source: Path | None) -> Any:
    """The model's own tokenizer, or the built-in byte tokenizer of a random-init model. The
    counting task reads no text: a model's own tokenizer, where it has one, is still what
    the export carries beside the weights."""
    if job.data.task == "counting":
        return source_tokenizer(source) if source is not None else None
    if source is None:  # the default tiny model or a --model-config shape
        return shared_byte_tokenizer()
    from transformers import AutoTokenizer

    name = str(job.model.model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"--model {name}: no tokenizer to read the task's text "
            f"({str(err).splitlines()[0]}); {tokenizer_fix(name)}"
        ) from None
    if not has_vocabulary(tokenizer):
        raise ValueError(
            f"--model {name}: no tokenizer to read the task's text (the folder "
            f"holds no tokenizer files); {tokenizer_fix(name)}"
        )
    return tokenizer


def tokenizer_fix(name: str) -> str:
    """What gives ``--model name`` its tokenizer: a hub name's cache is filled by a download
    (an ``hf download --include`` that left the tokenizer out), a folder by a copy."""
    if hub.local_model_dir(name) is None:
        return (
            "download the model's tokenizer files into the Hugging Face cache where the hub "
            f"is reachable: hf download {name}"
        )
    return "copy the model's tokenizer files into it"


def build_model(
    job: JobConfig, seed: int, source: Path | None
) -> tuple[nn.Module, WeightSource | None]:
    """(model, weight source): a skeleton filled bucket by bucket for a --model-config shape
    or a checkpoint directory (a local path or a hub snapshot: never materialised whole);
    otherwise the default tiny model, built whole."""
    dtype = MASTER_DTYPES[job.model.dtype]
    if job.model.model_config:
        return skeleton(random_shape_config(job), dtype), RandomWeights(seed)
    if source is not None:
        # a multimodal checkpoint: its text model, reading only its tensors
        model, weights = checkpoint_model(source, AutoConfig.from_pretrained(source), dtype)
        # before the memory plan, which would size (and maybe refuse) the config's model
        check_weights(weights, model)
        return with_generation_config(model, source), weights
    return model_from_config(default_model_config(job.data.task), dtype), None


def build_task_data(
    job: JobConfig,
    rows: LoadedRows | None,
    tokenizer: Any,
    model_config: Any,
    seed: int,
    stop_ids: tuple[int, ...] = (),
    share: RowShare = WHOLE,
) -> TaskData:
    """Needs the model's config (vocabulary, positions) and the end-of-sequence tokens its
    generation config lists, not its weights: built before the memory plan, so the plan
    knows the real longest sequence. ``share``: the part of the rows' lengths this rank
    reads (``rank_share``). A scoring run (``--max-steps 0``) tokenizes no training row."""
    data, trains = job.data, job.optim.max_steps > 0
    if rows is None:
        return CountingData(
            model_config.vocab_size, data.seq_len, data.eval_batch_size, seed, data.eval_batch_size
        )
    if check_supported(model_config.model_type).lm_kind == MASKED:
        # MeZO's limit for the task (128, or 256), unless --max-length says another
        prompt = MASKED_PROMPTS[data.task]
        length = data.max_length or min(prompt.max_length, token_positions(job, model_config))
        masked = MaskedPromptEncoder(tokenizer, data.task, length)
        return MaskedPromptData(
            rows, masked, seed, data.eval_batch_size, job.optim.objective, share, trains
        )
    encoder = PromptEncoder(
        tokenizer, data.max_length or token_positions(job, model_config), stop_ids
    )
    if data.task == "text":
        return TextData(rows, encoder, seed, data.eval_batch_size, share, trains)
    return PromptData(
        rows,
        encoder,
        seed,
        data.eval_batch_size,
        data.max_new_tokens,
        job.optim.objective,
        share,
        trains,
    )


def rank_share(parallel: ParallelContext) -> RowShare:
    """This rank's part of the pass over the rows' lengths: every rank builds the same
    data, so each reads 1/N of the rows and the counts meet over the host group."""
    comm = parallel.comm
    return RowShare(parallel.env.rank, comm.world_size, lambda compute: gathered(comm, compute))


def build_objective(name: str, data: TaskData) -> Objective:
    """What the engine's steps minimise (the pairing with the task was checked up front)."""
    if name == "classification":
        return Classification()
    if name == "accuracy":
        return Accuracy()
    if name == "f1":
        answers = [e.answers for e in data.train_examples]  # type: ignore[union-attr]
        return F1(data.encoder.answer, answers)  # type: ignore[union-attr]
    return LanguageModeling()


def memory_plan(
    job: JobConfig,
    model: nn.Module,
    data: TaskData,
    config: ZOConfig,
    parallel: ParallelContext,
    device: torch.device,
) -> MemoryPlan:
    """This rank's plan for ``config``: the batch a step or an evaluation runs at once."""
    sliced = resolve_transfer(config, device, parallel) == "sliced"
    shard = parallel.shard_group.size if parallel.shard_group else 1
    # candidates on rows of their own
    rows = job.data.batch_size // parallel.dims.dp * data.rows_per_example
    eval_rows = planned_rows(data, parallel.env.world_size)
    batch = max(rows, eval_rows)
    export = PlannedExport(job.run.export_shard_size, job.peft.merge_adapter)
    return plan_memory(
        model,
        config,
        shard,
        sliced,
        batch,
        data.longest,
        place=RankPlace.of(parallel),
        async_save=job.run.save_async and job.run.save_steps > 0,
        # only rank 0 exports: another node's host holds none of it
        export=export if parallel.env.on_rank_zeros_node else None,
        eval_rows=eval_rows,
    )


SLOTS_FALLBACK = (
    "3 device slots do not fit; using 2 (upload then waits for the offload two blocks back)"
)
MODULE_FALLBACK = (
    "a block's perturbed scratch does not fit; perturbing each block module by module in a "
    "scratch the size of its largest module, shared by the embedding and head a vocabulary "
    "slice at a time, instead (--perturb-scope module: the same steps, more kernel launches)"
)
RECOMPUTE_FALLBACK = (
    "the low-bit blocks' float32 master buffer does not fit; rebuilding each block's master a "
    "noise chunk at a time instead (--low-bit-master recompute: the same steps, more noise work)"
)


def device_fallbacks(job: JobConfig, config: ZOConfig) -> list[tuple[ZOConfig, list[str]]]:
    """The layouts to try in turn until one fits, each with the log lines saying what it
    gave up: ``config`` first; then, where the job was left to choose, the blocks perturbed
    module by module (the same steps), the low-bit blocks' masters rebuilt without their
    buffer (the same steps, more noise work), both, and then each of those with 2 slots
    (less overlap)."""
    tries: list[tuple[ZOConfig, list[str]]] = [(config, [])]
    full = job.peft.peft == "none"
    if job.offload.perturb_scope is None and full:
        tries += [
            (dataclasses.replace(c, perturb_scope="module"), [*why, MODULE_FALLBACK])
            for c, why in tries
        ]
    if config.mode != "offload":
        return tries
    if (
        job.offload.low_bit_master is None
        and config.transfer_dtype != "fp32"
        and not (config.stored_state or config.lowrank_state)
        and full
    ):
        tries += [
            (dataclasses.replace(c, low_bit_master="recompute"), [*why, RECOMPUTE_FALLBACK])
            for c, why in tries
        ]
    if job.offload.num_slots is None:
        tries += [(dataclasses.replace(c, num_slots=2), [*why, SLOTS_FALLBACK]) for c, why in tries]
    return tries


def choose_slots(
    job: JobConfig,
    model: nn.Module,
    data: TaskData,
    config: ZOConfig,
    parallel: ParallelContext,
    device: torch.device,
) -> MemoryPlan:
    """The memory plan, with what the job resolves itself where no option says: the
    engine's 3 slots, whole-block perturbation and buffered low-bit masters, unless they
    do not fit where a fallback does (``device_fallbacks``, said in the log). Every rank
    takes the first layout that fits on all of them, so that a GPU with less free memory
    never leaves its peers on another layout. Recorded in config.toml; where nothing fits,
    the first plan's refusal (or --force) decides."""
    tries = device_fallbacks(job, config)
    plans = [memory_plan(job, model, data, candidate, parallel, device) for candidate, _ in tries]
    fits = [_fits(plan, device, parallel.env.local_world_size) for plan in plans]
    if parallel.comm.distributed:
        fits = [all(each) for each in zip(*parallel.comm.all_gather_object(fits), strict=True)]
    chosen = fits.index(True) if any(fits) else 0
    candidate, gave_up = tries[chosen]
    for line in gave_up:
        logger.info(line)
    config.num_slots, config.low_bit_master = candidate.num_slots, candidate.low_bit_master
    config.perturb_scope = candidate.perturb_scope
    job.offload.num_slots = config.num_slots
    job.offload.low_bit_master = config.low_bit_master
    job.offload.perturb_scope = config.perturb_scope
    return plans[chosen]


def _fits(plan: MemoryPlan, device: torch.device, local_ranks: int) -> bool:
    """Whether ``plan`` fits this rank's device and its node's host memory."""
    try:
        check_fits(plan, device, local_ranks, force=False)
    except ValueError:
        return False
    return True
