"""The training job's options: one tree, three layers (defaults < TOML file < flags).

Each option is a field of a section dataclass; its command-line flag is its name with
dashes (``max_steps`` -> ``--max-steps``) and its TOML key is ``[section] name``. An
unknown TOML section or key is an error, never a silent no-op. The resolved tree is
written into the run directory, so a run can be repeated from its own folder.

The engine's options (``ZOConfig``) are part of the tree: each is declared by exactly
one section with ``engine_option``, which takes its default from the engine's field
(or None where the job resolves it, or a job default the option's help explains), and
``JobConfig.engine_config`` builds the engine's flat options from the sections, field by
field. The engine checks its own options when that config is built (one check, one
message); each section's ``validate`` checks the options only the job has, and the
checks across sections live in ``distzo.config.checks``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distzo.adapters.peft_adapters import PEFT_METHODS, PREFIX_INITS, AdapterSpec
from distzo.config.cli import add_version_flag, program, takes_negative_exponents
from distzo.config.engine_checks import (
    COMPUTE_DTYPE_NAMES,
    ESTIMATOR_NAMES,
    LOW_BIT_MASTERS,
    MODES,
    OPTIMIZER_STATES,
    OPTIMIZERS,
    PERTURB_SCOPES,
    SEED_LIMIT,
    STATE_DTYPES,
    TRANSFER_DTYPE_NAMES,
    TRANSFERS,
)
from distzo.config.engine_options import ZOConfig, engine_default
from distzo.config.field_types import field_types, is_of_type
from distzo.config.inapplicable import ignored_warning, inapplicable
from distzo.data.column_map import ColumnMap, parse_columns
from distzo.data.demonstrations import DEMO_SETS, check_demonstrable
from distzo.data.sampling import SEED_LIMIT as SAMPLING_SEED_LIMIT
from distzo.data.sampling import Sampling
from distzo.dist import LaunchEnv
from distzo.runtime.master_dtypes import MASTER_DTYPES
from distzo.runtime.option_names import named_as_flags
from distzo.runtime.toml_file import UnreadableToml, read_toml
from distzo.zo.estimators import estimator_for
from distzo.zo.noise import NOISE_KINDS
from distzo.zo.schedule import SCHEDULES

logger = logging.getLogger("distzo.train")

# The dashboards --report-to names (``distzo.job.reporting`` builds them).
REPORTERS = ("none", "tensorboard", "wandb")
# The largest safetensors file of an export by default (Hugging Face's own default).
DEFAULT_MAX_SHARD_SIZE = "5GB"
RESUME_MODES = ("no", "yes", "auto")
# What one command does with its run directory, not what the run is: flags only, never in
# a TOML file (read or written).
RUN_ACTIONS = ("resume", "overwrite")
# Where each section's options are explained (the --help epilog names them).
SECTION_DOCS = {
    "model": "docs/models.md",
    "data": "docs/tasks.md",
    "optim": "docs/optimizers.md",
    "peft": "docs/peft.md",
    "offload": "docs/distributed.md",
    "parallel": "docs/distributed.md",
    "run": "docs/training.md, docs/checkpoints.md",
}
# ZOConfig's fields that the job resolves from options of its own meaning: the device per
# local rank (parallel.device: auto is cuda:LOCAL_RANK), the run seed (run.seed: -1 draws one).
JOB_RESOLVED = ("device", "seed")
# ZOConfig's fields a job leaves at the engine's default: not job options.
ENGINE_ONLY = ("noise_chunk",)
_ENGINE_DEFAULT = object()
_ADAPTER = AdapterSpec()  # the adapter's defaults: the [peft] options take theirs


def option(default: Any, help: str, choices: tuple | None = None, bare: Any = None) -> Any:
    """A job option; ``bare``: the value of its flag given without one (``--resume``)."""
    return field(default=default, metadata={"help": help, "choices": choices, "bare": bare})


def engine_option(
    name: str, help: str, choices: tuple | None = None, default: Any = _ENGINE_DEFAULT
) -> Any:
    """A job option that is also ``ZOConfig.<name>`` (the field of the same name), with the
    engine's default unless the job gives its own: None for one it resolves later, or a
    value its help explains."""
    value = engine_default(name) if default is _ENGINE_DEFAULT else default
    return field(
        default=value, metadata={"help": help, "choices": choices, "bare": None, "engine": name}
    )


@dataclass
class ModelOptions:
    model: str | None = option(
        None,
        "hub name or local path of a model (gemma, gemma2, gemma3_text, gpt2, granite, llama, "
        "mistral, mixtral, olmo2, olmoe, opt, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe, roberta, "
        "xlm-roberta) or of a multimodal Gemma 3 (gemma3, 4B-27B: its text model trains); "
        "roberta and xlm-roberta train as masked LMs on MeZO's RoBERTa prompts; default: a "
        "tiny random-init OPT",
    )
    model_config: str | None = option(
        None, "a named shape with random weights, no checkpoint (e.g. opt-13b, llama-2-7b)"
    )
    model_layers: int | None = option(
        None, "override the layer count of --model-config (memory checks, benchmarks)"
    )
    dtype: str = option("fp32", "master (parameter) dtype", tuple(MASTER_DTYPES))

    def validate(self) -> None:
        """One model source; the shape's own checks come when its config is read."""
        if self.model_config and self.model:
            raise ValueError("--model and --model-config both name a model; keep one")
        if not self.model_config and self.model_layers is not None:
            raise ValueError("--model-layers only applies to --model-config")


@dataclass
class DataOptions:
    task: str = option(
        "counting",
        "counting (generated, no files), text (raw text, causal LM), or a prompt task: "
        "sst2, rte, cb, boolq, wic, wsc, copa, multirc, record, squad, drop; a masked LM's "
        "(MeZO's RoBERTa prompts): sst2, sst5, mr, cr, mpqa, subj, trec, cola, qqp, mrpc, qnli, "
        "rte, mnli, snli",
    )
    train_file: str | None = option(None, "local training data file (task-specific schema)")
    eval_file: str | None = option(None, "local evaluation data file")
    columns: str | None = option(
        None,
        "the task's columns read from other names in --train-file and --eval-file, "
        "TASK_COLUMN=SOURCE_COLUMN pairs: sentence=text,label=coarse_label (CogComp/trec)",
    )
    num_train: int | None = option(
        None, "train on N rows drawn from --train-file (MeZO's --num_train; default: all)"
    )
    num_dev: int | None = option(
        None,
        "also draw N dev rows from --train-file, evaluated every --eval-steps and at the end "
        "(MeZO's --num_dev)",
    )
    num_eval: int | None = option(
        None,
        "evaluate on N rows drawn from --eval-file (MeZO's --num_eval; default: all); with "
        "--train-per-class, LM-BFF's 1k-test rows: seed 42, a file of N rows or fewer whole",
    )
    train_per_class: int | None = option(
        None,
        "train on K rows of each label drawn from --train-file (LM-BFF's k-shot sets, MeZO's "
        "RoBERTa runs: K=16 or 512; --train-set-seed is its data seed)",
    )
    dev_per_class: int | None = option(
        None,
        "with --train-per-class: also draw K dev rows of each label from the rest (LM-BFF's "
        "dev set: as many as --train-per-class)",
    )
    train_set_seed: int = option(
        0,
        "seed of the --num-train/--num-dev/--num-eval and --train-per-class draws (MeZO's "
        "--train_set_seed, LM-BFF's data seed; its 1k-test rows: 42)",
    )
    num_demos: int | None = option(
        None,
        "evaluate with N training rows as demonstrations before every --eval-file prompt "
        "(MeZO's in-context learning: its --num_train with --trainer none); with --max-steps 0",
    )
    demo_sets: str = option(
        "per-row",
        "with --num-demos: per-row (a set per evaluation row, MeZO's seeds, drawn under "
        "--train-set-seed) or shared (one set for all, under --train-set-seed: MeZO's "
        "--train_set_seed)",
        DEMO_SETS,
    )
    batch_size: int = option(16, "global sequences per step (split over dp)")
    seq_len: int = option(16, "tokens per generated sequence (counting task)")
    max_length: int = option(
        0, "longest token sequence of text and prompt tasks (0: the model's limit)"
    )
    max_new_tokens: int = option(
        16, "greedy decoding length when evaluating generation tasks (squad, drop)"
    )
    eval_batch_size: int = option(
        64,
        "sequences per evaluation forward call over all ranks; the whole --eval-file (its "
        "--num-eval rows with that flag) is evaluated (counting: also the size of its generated "
        "evaluation set)",
    )

    @property
    def sampling(self) -> Sampling:
        """The sets drawn from the files (``distzo.data.sampling``)."""
        return Sampling(
            self.num_train,
            self.num_dev,
            self.num_eval,
            self.train_set_seed,
            self.train_per_class,
            self.dev_per_class,
            self.num_demos,
            self.demo_sets,
        )

    @property
    def column_map(self) -> ColumnMap:
        """``--columns`` as (task column, source column) pairs (``distzo.data.column_map``)."""
        return parse_columns(self.columns)

    def validate(self) -> None:
        """Sizes and the --columns syntax: the task and its files are checked when the job
        loads the rows."""
        parse_columns(self.columns)
        for flag, size in (
            ("--batch-size", self.batch_size),
            ("--eval-batch-size", self.eval_batch_size),
        ):
            if size < 1:
                raise ValueError(f"{flag} must be >= 1, got {size}")
        for flag, count, unset in (  # unset: what leaving the flag out gives
            ("--num-train", self.num_train, "every row"),
            ("--num-dev", self.num_dev, "no dev rows"),
            ("--num-eval", self.num_eval, "every row"),
            ("--train-per-class", self.train_per_class, "every row"),
            ("--dev-per-class", self.dev_per_class, "no dev rows"),
            ("--num-demos", self.num_demos, "no demonstrations, zero-shot"),
        ):
            if count is not None and count < 1:
                raise ValueError(f"{flag} must be >= 1 (leave it out: {unset}), got {count}")
        self._validate_per_class()
        self._validate_demos()
        if not 0 <= self.train_set_seed < SAMPLING_SEED_LIMIT:
            raise ValueError(
                f"--train-set-seed must be in [0, 2^32) (numpy's seeds, as MeZO's), got "
                f"{self.train_set_seed}"
            )
        if self.max_length < 0:
            raise ValueError(
                f"--max-length must be >= 0 (0: the model's limit), got {self.max_length}"
            )
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.seq_len < 2:  # a token and the next one it is trained to predict
            raise ValueError(f"--seq-len must be >= 2, got {self.seq_len}")

    def _validate_demos(self) -> None:
        """MeZO's ICL draws its demonstrations from the whole training file and trains on
        none of it: no training draw beside it (the step count: ``distzo.config.checks``)."""
        if self.num_demos is None:
            return
        if self.task in ("counting", "text"):
            check_demonstrable(self.task, masked=False)
        draws = [
            flag
            for flag, value in (
                ("--num-train", self.num_train),
                ("--num-dev", self.num_dev),
                ("--train-per-class", self.train_per_class),
                ("--dev-per-class", self.dev_per_class),
            )
            if value is not None
        ]
        if draws:
            raise ValueError(
                f"--num-demos draws its demonstrations from the whole --train-file, as MeZO's "
                f"in-context learning does, and trains nothing: drop {' and '.join(draws)}"
            )

    def _validate_per_class(self) -> None:
        """A draw per class (LM-BFF's) or a draw of counts (MeZO's run.py), never both."""
        if self.train_per_class is not None:
            counts = [
                f for f, n in (("--num-train", self.num_train), ("--num-dev", self.num_dev)) if n
            ]
            if counts:
                raise ValueError(
                    f"--train-per-class and {' and '.join(counts)} both draw the training "
                    "file's rows; keep --train-per-class (with --dev-per-class) or the counts"
                )
        elif self.dev_per_class is not None:
            raise ValueError(
                "--dev-per-class draws dev rows beside --train-per-class's; give "
                "--train-per-class too (or --num-dev for MeZO's run.py draw)"
            )


@dataclass
class OptimOptions:
    # The engine's default is None (no length); a job always has one.
    max_steps: int = engine_option("max_steps", "ZO steps to take", default=2000)
    lr: float | None = engine_option(
        "lr",
        "learning rate (default: 1e-6, MeZO's, for --model and --model-config, 1e-5 with "
        "--estimator fzoo, FZOO's; 1e-2 for the built-in tiny model on counting, 1e-3 on the "
        "other tasks)",
        default=None,
    )
    eps: float = engine_option("eps", "perturbation scale")
    weight_decay: float = engine_option("weight_decay", "decoupled weight decay on matrices")
    # The engine's default, constant, needs no max_steps; a job has one, so it decays to 0.
    lr_schedule: str = engine_option(
        "lr_schedule", "learning-rate schedule", SCHEDULES, default="linear"
    )
    warmup_steps: int = engine_option(
        "warmup_steps", "linear warm-up steps, from an lr of 0 (as transformers' schedules)"
    )
    objective: str | None = option(
        None,
        "what a step minimises on prompt tasks: classification (cross-entropy over the "
        "candidates' scores), lm (teacher forcing on the answer), accuracy or f1 "
        "(non-differentiable metrics); default: MeZO's choice, classification for sst2, rte, cb, "
        "boolq, wic, wsc, multirc and lm for copa, record, squad, drop, text, counting",
        ("lm", "classification", "accuracy", "f1"),
    )
    estimator: str = engine_option(
        "estimator",
        "how a step's forward passes become its update: spsa (MeZO's two-sided differences, "
        "n-SPSA with --num-queries), fzoo (FZOO: N one-sided differences plus the unperturbed "
        "loss, normalised by the spread of the N losses; N is --num-queries, 8 by default) or "
        "lozo (LOZO: SPSA along low-rank z = U V^T per weight matrix, --noise lowrank; see "
        "--lozo-rank, --lozo-interval)",
        ESTIMATOR_NAMES,
    )
    noise: str | None = engine_option(
        "noise",
        "the random directions z: gaussian (MeZO's, the default for spsa) or rademacher (+-1, "
        "SPSA's and FZOO's, the default for fzoo), both drawn per element from Philox and the "
        "same on every device; lowrank (LOZO's: U V^T per weight matrix, the default and only "
        "choice for lozo; see --lozo-rank, --lozo-interval); legacy (torch.Generator, earlier "
        "versions' runs). A resumed run keeps its checkpoint's",
        NOISE_KINDS,
        default=None,
    )
    lozo_rank: int = engine_option(
        "lozo_rank",
        "--noise lowrank: the rank r of each weight matrix's z = U V^T (U: rows x r, V: columns "
        "x r; LOZO uses 1 or 2)",
    )
    lozo_interval: int = engine_option(
        "lozo_interval",
        "--noise lowrank: steps V is kept before it is redrawn (LOZO's nu, 50 or 100); U is "
        "redrawn every step",
    )
    num_queries: int | None = engine_option(
        "num_queries",
        "random directions per step (default: 1 for spsa, 8 for fzoo), their estimates "
        "averaged: each adds two forward passes per block under spsa, one under fzoo, no "
        "transfer",
        default=None,
    )
    optimizer: str = engine_option(
        "optimizer",
        "sgd (MeZO's ZO-SGD), momentum (m = beta1 m + g z; by default regenerated each update "
        "from the last --momentum-window steps' seeds and g: no state memory, MeZO's appendix "
        "B.2) or adam (MeZO-Adam: bias-corrected moments of g z, stored beside the weights)",
        OPTIMIZERS,
    )
    beta1: float = engine_option("beta1", "momentum coefficient (Adam's first moment)")
    beta2: float = engine_option("beta2", "Adam's second-moment coefficient")
    adam_eps: float = engine_option("adam_eps", "added to Adam's sqrt(v)")
    momentum_window: int = engine_option(
        "momentum_window",
        "steps the momentum is regenerated from (1-256): each update draws that many steps' noise "
        "per block; older steps are dropped (they weigh beta1^W)",
    )
    optimizer_state: str = engine_option(
        "optimizer_state",
        "how momentum or Adam keeps its state: recomputed (momentum only, the default for it: no "
        "memory), stored (moment buckets beside the weights, moved with each block: exact at "
        "any length, 1x the trained parameters for momentum, 2x for Adam, always for adam) or "
        "lowrank (LOZO-M: momentum with --noise lowrank, m x r factors on the device)",
        OPTIMIZER_STATES,
    )
    state_dtype: str = engine_option(
        "state_dtype",
        "stored moments at rest in host memory under --mode offload: fp32, or bf16 (half the host "
        "memory and link bytes, rounded stochastically)",
        STATE_DTYPES,
    )
    grad_accum: int = engine_option(
        "grad_accum",
        "micro-batches per step sharing its z: each runs through a block while it is on the "
        "device (one upload "
        "per block per step), so activations are one micro-batch's; g is the whole batch's",
    )
    micro_batch_rows: int = engine_option(
        "micro_batch_rows",
        "at most this many rows of a pass in a step's micro-batch (0: no bound): a step runs as "
        "many micro-batches as that takes, at least --grad-accum; a choice task's candidates "
        "are rows, so an example of 50 candidates can run a few at a time; g is unchanged",
    )

    def validate(self) -> None:
        """The loop's length; the update's options are the engine's, checked by ZOConfig."""
        if self.max_steps < 0:
            raise ValueError(f"--max-steps must be >= 0, got {self.max_steps}")


@dataclass
class PeftOptions:
    peft: str = option(
        _ADAPTER.method,
        "what a step trains: none (every parameter), lora (LoRA's A and B, as MeZO), lora-fa (B "
        "only, A frozen at its init, as P-RGE) or prefix (virtual tokens' keys and values in "
        "every layer); adapters come from peft and the frozen base streams read-only",
        PEFT_METHODS,
    )
    lora_r: int = option(_ADAPTER.r, "LoRA rank")
    lora_alpha: float = option(_ADAPTER.alpha, "LoRA alpha (the update is scaled by alpha / r)")
    lora_dropout: float = option(
        _ADAPTER.dropout, "must stay 0: the two perturbed passes of a step compute one function"
    )
    lora_targets: str | None = option(
        None,
        "comma-separated module names to adapt (default: peft's for the family, q_proj,v_proj for "
        "OPT and Llama)",
    )
    prefix_length: int = option(
        _ADAPTER.prefix_length, "prefix tuning: virtual tokens per layer (MeZO's 5)"
    )
    prefix_init: str = option(
        _ADAPTER.prefix_init,
        "prefix tuning: real (each layer's keys and values of random tokens, as MeZO) or random "
        "(peft's init)",
        PREFIX_INITS,
    )
    merge_adapter: bool = option(
        False, "export/ holds the base with the LoRA adapter merged in, not the peft adapter"
    )
    dual_forward: bool = engine_option(
        "dual_forward",
        "run a query's +eps and -eps passes as one forward over the batch twice, each half with "
        "its own adapter weights (P-RGE; adapters only)",
    )
    batch_queries: bool = engine_option(
        "batch_queries",
        "run the --num-queries passes of a sign as one forward over the batch q times (P-RGE; "
        "adapters only)",
    )

    def adapter_spec(self) -> AdapterSpec:
        """What the adapter options ask for, as the adapter module takes it."""
        return AdapterSpec(
            self.peft,
            self.lora_r,
            self.lora_alpha,
            self.lora_dropout,
            AdapterSpec.parse_targets(self.lora_targets),
            self.prefix_length,
            self.prefix_init,
        )

    def validate(self) -> None:
        """The adapter's own checks, and the options that need one."""
        self.adapter_spec().validate()
        if (self.dual_forward or self.batch_queries) and self.peft == "none":
            raise ValueError(
                "--dual-forward and --batch-queries need an adapter (--peft lora, lora-fa or "
                "prefix); drop them"
            )
        if self.merge_adapter and self.peft not in ("lora", "lora-fa"):
            raise ValueError(
                "--merge-adapter needs a LoRA adapter (--peft lora or lora-fa): a prefix or full "
                "tuning has no delta to merge; drop it"
            )


@dataclass
class OffloadOptions:
    mode: str = engine_option(
        "mode",
        "offload: blocks in host memory (ZO2); resident: all on device (MeZO)",
        MODES,
    )
    num_slots: int | None = engine_option(
        "num_slots",
        f"device slots for streamed blocks: {engine_default('num_slots')} by default (upload, "
        "compute and offload overlap fully), 2 when the memory plan does not fit 3, 1 = no overlap",
        default=None,
    )
    transfer: str = engine_option(
        "transfer",
        "naive: whole blocks per rank; sliced: each local rank moves 1/n and all-gathers; "
        "auto: sliced on CUDA+NCCL with >1 local ranks",
        TRANSFERS,
    )
    transfer_dtype: str = engine_option(
        "transfer_dtype", "format of blocks in host memory and on the wire", TRANSFER_DTYPE_NAMES
    )
    compute_dtype: str = engine_option(
        "compute_dtype",
        "dtype of perturbed weights and activations (auto: the master dtype)",
        COMPUTE_DTYPE_NAMES,
    )
    transfer_chunks: int = engine_option(
        "transfer_chunks",
        "pieces of each rank's share, pipelining the sliced upload's copy and all-gather",
    )
    low_bit_master: str | None = engine_option(
        "low_bit_master",
        "a block's float32 master under a low-bit --transfer-dtype: buffer (one float32 block "
        "on the device), double (two: a block's upcast and its rounding for the way back run "
        "on the upload and offload streams, beside the compute; one float32 block more) or "
        "recompute (none: rebuilt a noise chunk at a time for each pass; one float32 block "
        "less device memory, more noise work); the same steps bit for bit; by default buffer, "
        "recompute when the memory plan does not fit the buffer but fits that",
        LOW_BIT_MASTERS,
        default=None,
    )
    perturb_scope: str | None = engine_option(
        "perturb_scope",
        "how much of a block the passes hold perturbed at once: block (a scratch the size of the "
        "largest block) or module (one the size of its largest module, each module perturbed "
        "just before it runs: the same steps bit for bit, more kernel launches); by default "
        "block, module when the memory plan does not fit the block's scratch but fits that",
        PERTURB_SCOPES,
        default=None,
    )

    def validate(self) -> None:
        """Nothing of its own: its options are the engine's (ZOConfig checks them), and
        whether a sliced transfer has a process group is a check of the launch."""


@dataclass
class ParallelOptions:
    device: str = option("auto", "auto (cuda:LOCAL_RANK if CUDA, else cpu), cpu, cuda or cuda:N")
    dp: int | None = option(None, "data-parallel size (default auto: world / pert)")
    pert: int | None = option(
        None,
        "perturbation-parallel size: ranks sharing a step's forward passes, at most the "
        "step's passes (default auto: 2 if the world is even, else 1)",
    )
    backend: str = option(
        "auto", "process-group backend (auto: nccl on CUDA, gloo on CPU)", ("auto", "nccl", "gloo")
    )
    dist_timeout: float = option(300.0, "seconds before a stuck collective fails the job")
    threads: int | None = option(
        None,
        "CPU threads per rank on CPU runs (0: cores / local ranks); default: OMP_NUM_THREADS "
        "when set, else 1",
    )

    def validate(self) -> None:
        """The thread count; dp and pert are checked against the launched world
        (``ParallelDims.resolve``), the device and backend against this machine."""
        if self.threads is not None and self.threads < 0:
            raise ValueError(f"--threads must be >= 0 (0: cores / local ranks), got {self.threads}")
        if not 0 < self.dist_timeout < 1e9:  # nan and inf too
            raise ValueError(
                f"--dist-timeout must be a positive number of seconds, got {self.dist_timeout}"
            )


@dataclass
class RunOptions:
    seed: int = option(0, "run seed (model init, data and noise); -1: rank 0 draws one")
    output_dir: str | None = option(
        None, "run directory (default: a new ./runs/<timestamp>, -2, -3, ... appended if taken)"
    )
    log_dir: str | None = option(
        None, "where metrics.jsonl and eval.jsonl go (default: the run directory)"
    )
    log_every: int = option(50, "log a line every N steps (0: none)")
    eval_steps: int = option(0, "evaluate every N steps (0: only before and after)")
    save_steps: int = option(0, "checkpoint every N steps (0: only at the end)")
    save_async: bool = option(
        True,
        "write --save-steps checkpoints from a background thread (each node first copies its "
        "share of the model); "
        "--no-save-async writes them from the live host copy while training waits",
    )
    resume: str | None = option(
        None,
        "no: start afresh; yes (the bare flag): resume from the latest checkpoint in the run "
        "directory, then catch up with every step the seed log holds after it; auto: that when "
        "the run directory has a checkpoint or logged steps, else start afresh. Default: auto "
        "under torchrun --max-restarts > 0, else no",
        RESUME_MODES,
        bare="yes",
    )
    overwrite: bool = option(
        False,
        "start afresh in an --output-dir that holds a run (without it that is refused): first "
        "delete the old run's own files and folders, config.toml, seedlog.jsonl, metrics.jsonl, "
        "eval.jsonl, summary.json, curves.png, rankN.json, checkpoints/, export/, export-best/, "
        "base/, tensorboard/ and wandb/ (and the logs in --log-dir), never other files in the "
        "directory",
    )
    report_to: str = option(
        "none",
        "the run's dashboard, from rank 0: tensorboard (event files in <run>/tensorboard; pip "
        "install 'distzo[tensorboard]') or wandb (in the mode the environment sets; pip install "
        "'distzo[wandb]')",
        REPORTERS,
    )
    keep_checkpoints: int = option(
        2,
        "complete checkpoints kept on disk, the oldest deleted first once a newer one is complete "
        "(0: keep all)",
    )
    save_on_signal: bool = option(
        False,
        "on SIGTERM or SIGUSR1 (a preemption notice) or Ctrl-C (SIGINT) write a checkpoint "
        "after the step under way before exiting (143, or 130 after Ctrl-C); without it the "
        "seed log, synced, is what the restart catches up from",
    )
    log_sync_steps: int = option(
        1,
        "sync the seed log to disk every N steps (a crash loses at most the last N-1 logged "
        "steps, which are then trained again)",
    )
    export_shard_size: str = option(
        DEFAULT_MAX_SHARD_SIZE,
        "largest safetensors file of the exported model (e.g. 5GB, 500MB)",
    )
    force: bool = option(
        False, "start even when the memory plan does not fit what this machine has free"
    )
    export_best: bool = option(
        False,
        "with --num-dev or --dev-per-class: also write the model of the best dev step to "
        "export-best/, replayed from the seed log (MeZO's --load_best_model_at_end)",
    )

    @property
    def engine_seed(self) -> int | None:
        """The engine's run seed: None (-1) has rank 0 draw one."""
        return None if self.seed == -1 else self.seed

    def validate(self) -> None:
        """Intervals and retention. Whether the export's shard size parses and the
        dashboard's package is installed are the job's checks (``distzo.job.validation``),
        as is whether a resume has something to resume (it reads the run directory)."""
        if not -1 <= self.seed < SEED_LIMIT:
            raise ValueError(f"--seed must be -1 (draw one) or in [0, 2^63), got {self.seed}")
        for name in ("log_every", "eval_steps", "save_steps"):
            if getattr(self, name) < 0:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be >= 0 (0: off), got {getattr(self, name)}")
        if self.keep_checkpoints < 0:
            raise ValueError(
                f"--keep-checkpoints must be >= 0 (0: keep all), got {self.keep_checkpoints}"
            )
        if self.log_sync_steps < 1:
            raise ValueError(f"--log-sync-steps must be >= 1, got {self.log_sync_steps}")


@dataclass
class JobConfig:
    model: ModelOptions = field(default_factory=ModelOptions)
    data: DataOptions = field(default_factory=DataOptions)
    optim: OptimOptions = field(default_factory=OptimOptions)
    peft: PeftOptions = field(default_factory=PeftOptions)
    offload: OffloadOptions = field(default_factory=OffloadOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    run: RunOptions = field(default_factory=RunOptions)

    def sections(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def validate(self) -> None:
        """Each section's own checks, in the tree's order."""
        for section in self.sections().values():
            section.validate()

    def engine_config(self, device: str) -> ZOConfig:
        """The engine's options, each taken from the one section that declares it (an unset
        one, None, keeps the engine's default), and those the job resolves from options of
        its own (``JOB_RESOLVED``): ``device``, this rank's, and the seed. ZOConfig checks
        them all, with its own messages, naming each option by its flag."""
        resolved: dict[str, Any] = {"device": device, "seed": self.run.engine_seed}
        owners = engine_owners()
        values = {}
        for f in dataclasses.fields(ZOConfig):
            if f.name in resolved:
                values[f.name] = resolved[f.name]
            elif f.name in owners:
                value = getattr(getattr(self, owners[f.name]), f.name)
                if value is not None:
                    values[f.name] = value
        if self.optim.estimator in ESTIMATOR_NAMES:  # else ZOConfig names the bad one
            # unset: the estimator's own z (FZOO's Rademacher; a resume takes the drawn
            # one) and number of directions (FZOO's 8)
            rule = estimator_for(self.optim.estimator)
            values.setdefault("noise", rule.default_noise)
            values.setdefault("num_queries", rule.default_queries)
        with named_as_flags():  # its checks name --state-dtype, not state_dtype
            return ZOConfig(**values)


def engine_owners() -> dict[str, str]:
    """ZOConfig field -> the section that declares it as an engine option."""
    return {f.metadata["engine"]: section for section, f in _options() if "engine" in f.metadata}


def _options() -> Iterator[tuple[str, dataclasses.Field]]:
    """(section name, field) for every option, in declaration order."""
    for section, values in JobConfig().sections().items():
        for f in dataclasses.fields(values):
            yield section, f


def _field_types() -> dict[str, type]:
    """Each option's value type (Optional stripped); option names are unique across sections,
    since each is also a flag."""
    out: dict[str, type] = {}
    for values in JobConfig().sections().values():
        for name, (kind, _) in field_types(type(values)).items():
            assert name not in out, f"option {name} appears in two sections"
            out[name] = kind
    return out


_TYPES = _field_types()


def _base_type(f: dataclasses.Field) -> type:
    return _TYPES[f.name]


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog or program("distzo.train"),
        epilog="Documentation, by section: "
        + "; ".join(f"[{name}] {page}" for name, page in SECTION_DOCS.items())
        + " (in the repository, or its README's links).",
        description="Zeroth-order (MeZO / ZO2 / DistZO2) fine-tuning. Defaults train a tiny OPT "
        "on a generated counting task. Launch with torchrun for several ranks. Every option can "
        "also be set in a TOML file (--config), as [section] key = value; flags override the file.",
    )
    takes_negative_exponents(p)
    add_version_flag(p)
    p.add_argument(
        "--config", default=None, metavar="FILE", help="a TOML file of options (flags override it)"
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for section, f in _options():
        group = groups.setdefault(section, p.add_argument_group(f"[{section}]"))
        # An option that defaults to None says what that means in its own help.
        text = (
            f.metadata["help"]
            if f.default is None
            else f"{f.metadata['help']} (default: {f.default})"
        )
        _add_flag(group, f, text, argparse.SUPPRESS)
    return p


def add_job_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    name: str,
    default: Any,
    help: str | None = None,
) -> None:
    """The job option ``name``'s flag on another command's ``parser`` (the replay's export
    options), as ``distzo.train`` takes it (flag, type, choices, metavar), so that the two
    commands cannot drift. ``default``: what the command reads when the flag is not given
    (None: not given); ``help`` where the command means it otherwise than the job (None:
    the option's own, with the job's default)."""
    f = next(f for _, f in _options() if f.name == name)
    _add_flag(parser, f, help or f"{f.metadata['help']} (default: {f.default})", default)


def _add_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    f: dataclasses.Field,
    text: str,
    default: Any,
) -> None:
    """The flag of option ``f``: its name with dashes; a bool's with its ``--no-`` form."""
    flag = "--" + f.name.replace("_", "-")
    kind = _base_type(f)
    if kind is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text)
        return
    bare = {"nargs": "?", "const": f.metadata["bare"]} if f.metadata.get("bare") is not None else {}
    parser.add_argument(
        flag,
        type=kind,
        choices=f.metadata["choices"],
        default=default,
        help=text,
        metavar=None if f.metadata["choices"] else _metavar(f.name, kind),
        **bare,
    )


# What --help shows a string option takes, where "STR" would say nothing.
_METAVARS = {
    "model": "NAME_OR_DIR",
    "model_config": "SHAPE",
    "task": "TASK",
    "train_file": "FILE",
    "eval_file": "FILE",
    "columns": "TASK=SOURCE,...",
    "num_train": "N",
    "num_dev": "N",
    "num_eval": "N",
    "train_per_class": "K",
    "dev_per_class": "K",
    "num_demos": "N",
    "lora_targets": "MODULES",
    "device": "DEVICE",
    "output_dir": "DIR",
    "log_dir": "DIR",
    "export_shard_size": "SIZE",
}


def _metavar(name: str, kind: type) -> str:
    return _METAVARS.get(name, kind.__name__.upper())


def _closest(key: str, section: str, known: dict[str, set[str]]) -> str:
    """Where an unknown key of ``section`` belongs: the section that has it (a key in the
    wrong section would otherwise be offered a neighbour's name, ``max_steps`` in [run]
    ``save_steps``), else a typo's likely fix (difflib), else the keys to choose from."""
    home = _section_of(key, known)
    if home is not None:
        return f"it is an option of [{home}]: move it there"
    close = difflib.get_close_matches(key, known[section], n=1)
    if close:
        return f"did you mean {close[0]!r}?"
    return f"keys are {', '.join(sorted(known[section]))}"


def _section_of(key: str, known: dict[str, set[str]]) -> str | None:
    """The section whose option ``key`` is (None: no section has it)."""
    return next((section for section, keys in known.items() if key in keys), None)


def _unknown_section(section: str, known: dict[str, set[str]]) -> str:
    """An unknown ``[section]``: a typo's likely fix, as for a key, and the sections."""
    close = difflib.get_close_matches(section, known, n=1)
    hint = f"did you mean [{close[0]}]? " if close else ""
    return f"unknown section [{section}]; {hint}sections are {', '.join(known)}"


def load_toml(path: str) -> dict[str, dict[str, Any]]:
    try:
        data = read_toml(path)
    except UnreadableToml as err:
        raise ValueError(f"--config {err}; correct the path or the file") from None
    known = {
        section: {f.name for f in dataclasses.fields(type(obj))}
        for section, obj in JobConfig().sections().items()
    }
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ValueError(f"--config {path}: {_outside_sections(section, known)}")
        if section not in known:
            raise ValueError(f"--config {path}: {_unknown_section(section, known)}")
        for key in values:
            if key not in known[section]:
                raise ValueError(
                    f"--config {path}: unknown key {key!r} in [{section}]; "
                    + _closest(key, section, known)
                )
    return data


def _outside_sections(key: str, known: dict[str, set[str]]) -> str:
    """What a key written before any ``[section]`` header is: an option in the wrong place
    (named with its section), or a name no section has."""
    home = _section_of(key, known)
    if home is not None:
        return f"{key} is outside any section; write it under [{home}]"
    return f"{key!r} is outside any section, and no section has such a key"


# How an error names the type a TOML value must have.
_TOML_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _toml_value(section: str, f: dataclasses.Field, value: Any) -> Any:
    """A TOML value as the option's type: an int where a float is due widened, a boolean
    of a bare-flag option (``resume = true``, as files wrote it before it took a mode) read
    as that flag; any other mismatch is a one-line error."""
    kind = _base_type(f)
    if kind is float and isinstance(value, int):
        value = float(value)
    bare = f.metadata.get("bare")
    if bare is not None and isinstance(value, bool):
        value = bare if value else "no"
    if not is_of_type(value, kind):
        want = _TOML_KINDS.get(kind, kind.__name__)
        raise ValueError(f"--config: [{section}] {f.name} must be {want}, got {value!r}")
    choices = f.metadata.get("choices")
    if choices and value not in choices:  # what the flag's own choices refuse
        raise ValueError(
            f"--config: [{section}] {f.name} must be one of {', '.join(choices)}, got {value!r}"
        )
    return value


def _drop_actions(path: str, data: dict[str, Any]) -> None:
    """A file never sets ``RUN_ACTIONS``: they say what one command does with its run
    directory, not what the run is, and a run's config.toml passed back with --config for
    a new run must not carry them (an earlier version's config.toml of a resumed run
    records ``resume = "yes"``: it would resume whatever directory it is passed with).
    Dropped, so such files still load; one warning line where one asked for an action."""
    run = data.get("run", {})
    asked: list[tuple[str, Any]] = []
    for key in RUN_ACTIONS:
        value = run.pop(key, False)
        if value not in ("no", False):
            asked.append((key, value))
    if asked and LaunchEnv.from_environ().rank == 0:
        logger.warning(
            "--config %s: [run] %s ignored: --resume and --overwrite act on the run directory "
            "and are given on the command line, never by a file",
            path,
            " and ".join(f"{key} = {value!r}" for key, value in asked),
        )


# Options naming a file or folder, whose empty value would silently read as unset.
PATH_FLAGS = ("config", "output_dir", "log_dir", "model", "train_file", "eval_file")


def _refuse_empty_paths(path: str, data: dict[str, dict[str, Any]]) -> None:
    """A file's empty path, refused as the flag's is: ``output_dir = ""`` trained into a
    new ./runs/<timestamp>, ``log_dir = ""`` logged into the run directory, and
    ``model = ""`` failed as a malformed hub name."""
    for section, values in data.items():
        for key, value in values.items():
            if key in PATH_FLAGS and value == "":
                raise ValueError(
                    f"--config {path}: [{section}] {key} is empty; give a path or remove the key"
                )


def expand_home(job: JobConfig) -> None:
    """A path option's leading ``~`` is the home folder, as a shell reads it. A TOML file,
    ``--flag=~/x`` (which the shell leaves as it is) and Python pass it on as written: the
    run went into a folder named ``~`` under the working directory, and a ``--model`` there
    was taken for a hub name."""
    for section, f in _options():
        values = getattr(job, section)
        value = getattr(values, f.name)
        if f.name in PATH_FLAGS and isinstance(value, str):
            setattr(values, f.name, os.path.expanduser(value))


def resolve(argv: list[str] | None = None) -> JobConfig:
    """Defaults, then the TOML file (its one-off actions dropped), then the flags given on
    the command line."""
    args = vars(build_parser().parse_args(argv))
    config = JobConfig()
    empty = [flag for flag, value in args.items() if value == "" and flag in PATH_FLAGS]
    if empty:  # "" would read as unset: the default, where the user named something
        raise ValueError(f"--{empty[0].replace('_', '-')} is empty; give a path or leave it out")
    if args.get("config"):
        args["config"] = os.path.expanduser(args["config"])
        data = load_toml(args["config"])
        _drop_actions(args["config"], data)
        _refuse_empty_paths(args["config"], data)
        for section, values in data.items():
            target = getattr(config, section)
            fields = {f.name: f for f in dataclasses.fields(target)}
            for key, value in values.items():
                setattr(target, key, _toml_value(section, fields[key], value))
    for section, f in _options():
        if f.name in args:
            setattr(getattr(config, section), f.name, args[f.name])
    if args.get("config") and "output_dir" not in args:
        config.run.output_dir = _run_folder(Path(args["config"]), config.run.output_dir)
    ignored = inapplicable(config, [f.name for _, f in _options() if f.name in args])
    if ignored and LaunchEnv.from_environ().rank == 0:
        logger.warning(ignored_warning(ignored))
    for section, f in _options():  # ignored means ignored: no later check sees them
        if f.name in ignored:
            setattr(getattr(config, section), f.name, f.default)
    return config


# A run's own files: its config.toml, written beside its seed log (distzo.job.seed_log's)
RUN_CONFIG, SEED_LOG_NAME = "config.toml", "seedlog.jsonl"


def _run_folder(file: Path, recorded: str | None) -> str | None:
    """The run directory of ``--config FILE`` without ``--output-dir``: ``FILE``'s folder
    where ``FILE`` is a run's own config.toml (beside its seed log) and the folder it
    records is another, the run's folder moved or copied since (the old one gone, its
    resume was "no checkpoint"; still there, the copy's resume went on in the original).
    Else ``recorded``, as the file says."""
    folder = file.parent
    if file.name != RUN_CONFIG or not (folder / SEED_LOG_NAME).is_file():
        return recorded
    if recorded is not None and Path(recorded).resolve() == folder.resolve():
        return recorded
    if LaunchEnv.from_environ().rank == 0:
        logger.warning(
            "--config %s: the run's folder is %s, not the %s its config.toml records (moved "
            "or copied since); give --output-dir to name another",
            file,
            folder,
            recorded or "new ./runs/<timestamp>",
        )
    return str(folder)


def to_toml(config: JobConfig) -> str:
    """The resolved tree as TOML: the options that define the run. Unset options (None) are
    left out (TOML has no null), and so are ``RUN_ACTIONS``, which no file sets."""
    lines = []
    for section, values in config.sections().items():
        lines.append(f"[{section}]")
        for f in dataclasses.fields(values):
            value = getattr(values, f.name)
            if value is None or (section == "run" and f.name in RUN_ACTIONS):
                continue
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, str):
                text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
            else:
                text = repr(value)
            lines.append(f"{f.name} = {text}")
        lines.append("")
    return "\n".join(lines)


def write_resolved(config: JobConfig, run_dir: Path) -> Path:
    """``config.toml``: the resolved tree (``to_toml``), without --resume and --overwrite,
    which say how a command treats its directory, not what the run is."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.toml"
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(to_toml(config))
    tmp.replace(path)
    return path
