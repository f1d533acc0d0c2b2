"""The training job's options: one tree, three layers (defaults < TOML file < flags).

Each option is a field of a section dataclass; its command-line flag is its name with
dashes (``max_steps`` -> ``--max-steps``) and its TOML key is ``[section] name``. An
unknown TOML section or key is an error, never a silent no-op. The resolved tree is
written into the run directory, so a run can be repeated from its own folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distzo.adapters.peft_adapters import PEFT_METHODS, PREFIX_INITS
from distzo.config.cli import program
from distzo.config.engine_options import (
    COMPUTE_DTYPE_NAMES,
    MODES,
    OPTIMIZER_STATES,
    OPTIMIZERS,
    STATE_DTYPES,
    TRANSFER_DTYPE_NAMES,
    TRANSFERS,
)
from distzo.job.reporting import REPORTERS
from distzo.zo.schedule import SCHEDULES

RESUME_MODES = ("no", "yes", "auto")
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


def option(default: Any, help: str, choices: tuple | None = None, bare: Any = None) -> Any:
    """A job option; ``bare``: the value of its flag given without one (``--resume``)."""
    return field(default=default, metadata={"help": help, "choices": choices, "bare": bare})


@dataclass
class ModelOptions:
    model: str | None = option(
        None,
        "hub name or local path of a model (opt, llama, qwen2, qwen3, mistral, gpt2); default: a tiny random-init OPT",
    )
    model_config: str | None = option(
        None, "a named shape with random weights, no checkpoint (e.g. opt-13b, llama-2-7b)"
    )
    model_layers: int | None = option(
        None, "override the layer count of --model-config (memory checks, benchmarks)"
    )
    dtype: str = option("fp32", "master (parameter) dtype", ("fp32", "fp64"))


@dataclass
class DataOptions:
    task: str = option(
        "counting",
        "counting (generated, no files), text (raw text, causal LM), or a prompt task: "
        "sst2, rte, cb, boolq, wic, copa, multirc, squad",
    )
    train_file: str | None = option(None, "local training data file (task-specific schema)")
    eval_file: str | None = option(None, "local evaluation data file")
    batch_size: int = option(16, "global sequences per step (split over dp)")
    seq_len: int = option(16, "tokens per generated sequence (counting task)")
    max_length: int = option(
        0, "longest token sequence of text and prompt tasks (0: the model's limit)"
    )
    max_new_tokens: int = option(
        16, "greedy decoding length when evaluating generation tasks (squad)"
    )
    eval_batch_size: int = option(64, "sequences in the evaluation set")


@dataclass
class OptimOptions:
    max_steps: int = option(2000, "ZO steps to take")
    lr: float | None = option(
        None,
        "learning rate (default: 1e-6, MeZO's, for --model and --model-config; 1e-2 for the built-in tiny "
        "model on counting, 1e-3 on the other tasks)",
    )
    eps: float = option(1e-3, "perturbation scale")
    weight_decay: float = option(0.0, "decoupled weight decay on matrices")
    lr_schedule: str = option("linear", "learning-rate schedule", SCHEDULES)
    warmup_steps: int = option(0, "linear warm-up steps")
    objective: str | None = option(
        None,
        "what a step minimises on prompt tasks: classification (cross-entropy over the candidates' scores), "
        "lm (teacher forcing on the answer), accuracy or f1 (non-differentiable metrics); default: MeZO's choice, "
        "classification for sst2, rte, cb, boolq, wic, multirc and lm for copa, squad, text, counting",
        ("lm", "classification", "accuracy", "f1"),
    )
    noise: str | None = option(
        None,
        "the random directions z: gaussian (MeZO's, default) or rademacher (+-1, SPSA's), both drawn per "
        "element from Philox and the same on every device; legacy (torch.Generator, earlier versions' runs). "
        "A resumed run keeps its checkpoint's",
        ("gaussian", "rademacher", "legacy"),
    )
    num_queries: int = option(
        1,
        "random directions per step, their estimates averaged (n-SPSA): each adds two forward passes "
        "per block, no transfer",
    )
    optimizer: str = option(
        "sgd",
        "sgd (MeZO's ZO-SGD), momentum (m = beta1 m + g z; by default regenerated each update from the "
        "last --momentum-window steps' seeds and g: no state memory, MeZO's appendix B.2) or adam (MeZO-Adam: "
        "bias-corrected moments of g z, stored beside the weights)",
        OPTIMIZERS,
    )
    beta1: float = option(0.9, "momentum coefficient (Adam's first moment)")
    beta2: float = option(0.999, "Adam's second-moment coefficient")
    adam_eps: float = option(1e-8, "added to Adam's sqrt(v)")
    momentum_window: int = option(
        32,
        "steps the momentum is regenerated from (1-256): each update draws that many steps' noise per block; "
        "older steps are dropped (they weigh beta1^W)",
    )
    optimizer_state: str = option(
        "auto",
        "how momentum or Adam keeps its state: recomputed (momentum only, the default for it: no memory) or "
        "stored (moment buckets beside the weights, moved with each block: exact at any length, 1x the trained "
        "parameters for momentum, 2x for Adam, always for adam)",
        OPTIMIZER_STATES,
    )
    state_dtype: str = option(
        "fp32",
        "stored moments at rest in host memory under --mode offload: fp32, or bf16 (half the host memory "
        "and link bytes, rounded stochastically)",
        STATE_DTYPES,
    )
    grad_accum: int = option(
        1,
        "micro-batches per step sharing its z: each runs through a block while it is on the device (one upload "
        "per block per step), so activations are one micro-batch's; g is the whole batch's",
    )


@dataclass
class PeftOptions:
    peft: str = option(
        "none",
        "what a step trains: none (every parameter), lora (LoRA's A and B, as MeZO), lora-fa (B only, A "
        "frozen at its init, as P-RGE) or prefix (virtual tokens' keys and values in every layer); adapters come "
        "from peft and the frozen base streams read-only",
        PEFT_METHODS,
    )
    lora_r: int = option(8, "LoRA rank")
    lora_alpha: float = option(16.0, "LoRA alpha (the update is scaled by alpha / r)")
    lora_dropout: float = option(
        0.0, "must stay 0: the two perturbed passes of a step compute one function"
    )
    lora_targets: str | None = option(
        None,
        "comma-separated module names to adapt (default: peft's for the family, q_proj,v_proj for OPT and Llama)",
    )
    prefix_length: int = option(5, "prefix tuning: virtual tokens per layer (MeZO's 5)")
    prefix_init: str = option(
        "real",
        "prefix tuning: real (each layer's keys and values of random tokens, as MeZO) or random (peft's init)",
        PREFIX_INITS,
    )
    merge_adapter: bool = option(
        False, "export/ holds the base with the LoRA adapter merged in, not the peft adapter"
    )
    dual_forward: bool = option(
        False,
        "run a query's +eps and -eps passes as one forward over the batch twice, each half with its own "
        "adapter weights (P-RGE; adapters only)",
    )
    batch_queries: bool = option(
        False,
        "run the --num-queries passes of a sign as one forward over the batch q times (P-RGE; adapters only)",
    )


@dataclass
class OffloadOptions:
    mode: str = option(
        "offload", "offload: blocks in host memory (ZO2); resident: all on device (MeZO)", MODES
    )
    num_slots: int | None = option(
        None,
        "device slots for streamed blocks: 3 by default (upload, compute and offload overlap fully), 2 when the "
        "memory plan does not fit 3, 1 = no overlap",
    )
    transfer: str = option(
        "auto",
        "naive: whole blocks per rank; sliced: each local rank moves 1/n and all-gathers; "
        "auto: sliced on CUDA+NCCL with >1 local ranks",
        TRANSFERS,
    )
    transfer_dtype: str = option(
        "fp32", "format of blocks in host memory and on the wire", TRANSFER_DTYPE_NAMES
    )
    compute_dtype: str = option(
        "auto",
        "dtype of perturbed weights and activations (auto: the master dtype)",
        COMPUTE_DTYPE_NAMES,
    )
    transfer_chunks: int = option(
        4, "pieces of each rank's share, pipelining the sliced upload's copy and all-gather"
    )


@dataclass
class ParallelOptions:
    device: str = option("auto", "auto (cuda:LOCAL_RANK if CUDA, else cpu), cpu, cuda or cuda:N")
    dp: int | None = option(None, "data-parallel size (default auto: world / pert)")
    pert: int | None = option(
        None, "perturbation-parallel size, 1 or 2 (default auto: 2 if the world is even)"
    )
    backend: str = option(
        "auto", "process-group backend (auto: nccl on CUDA, gloo on CPU)", ("auto", "nccl", "gloo")
    )
    dist_timeout: float = option(300.0, "seconds before a stuck collective fails the job")
    threads: int = option(0, "CPU threads per rank (0: cores / local ranks)")


@dataclass
class RunOptions:
    seed: int = option(0, "run seed (model init, data and noise); -1: rank 0 draws one")
    output_dir: str | None = option(None, "run directory (default ./runs/<timestamp>)")
    log_dir: str | None = option(
        None, "where metrics.jsonl and eval.jsonl go (default: the run directory)"
    )
    log_every: int = option(50, "log a line every N steps (0: none)")
    eval_steps: int = option(0, "evaluate every N steps (0: only before and after)")
    save_steps: int = option(0, "checkpoint every N steps (0: only at the end)")
    save_async: bool = option(
        True,
        "write --save-steps checkpoints from a background thread (each node first copies its share of the model); "
        "--no-save-async writes them from the live host copy while training waits",
    )
    resume: str | None = option(
        None,
        "no: start afresh; yes (the bare flag): resume from the latest checkpoint in the run directory, then "
        "catch up with every step the seed log holds after it; auto: that when the run directory has a checkpoint or "
        "logged steps, else start afresh. Default: auto under torchrun --max-restarts > 0, else no",
        RESUME_MODES,
        bare="yes",
    )
    report_to: str = option(
        "none",
        "the run's dashboard, from rank 0: tensorboard (event files in <run>/tensorboard; pip install "
        "'distzo[tensorboard]') or wandb (in the mode the environment sets; pip install 'distzo[wandb]')",
        REPORTERS,
    )
    keep_checkpoints: int = option(
        2,
        "complete checkpoints kept on disk, the oldest deleted first once a newer one is complete (0: keep all)",
    )
    save_on_signal: bool = option(
        False,
        "on SIGTERM or SIGUSR1 (a preemption notice) write a checkpoint after the step under way before "
        "exiting; without it the seed log, synced, is what the restart catches up from",
    )
    log_sync_steps: int = option(
        1,
        "sync the seed log to disk every N steps (a crash loses at most the last N-1 logged steps, which are "
        "then trained again)",
    )
    export_shard_size: str = option(
        "5GB", "largest safetensors file of the exported model (e.g. 5GB, 500MB)"
    )
    force: bool = option(
        False, "start even when the memory plan does not fit what this machine has free"
    )


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


def _options():
    """(section name, field) for every option, in declaration order."""
    for section in dataclasses.fields(JobConfig):
        for f in dataclasses.fields(section.default_factory()):
            yield section.name, f


def _field_types() -> dict[str, type]:
    """Each option's value type (Optional stripped); option names are unique across sections,
    since each is also a flag."""
    out: dict[str, type] = {}
    for section in dataclasses.fields(JobConfig):
        cls = section.default_factory
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
                hint = next(a for a in typing.get_args(hint) if a is not type(None))
            assert f.name not in out, f"option {f.name} appears in two sections"
            out[f.name] = hint
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
        description="Zeroth-order (MeZO / ZO2 / DistZO2) fine-tuning. Defaults train a tiny OPT on a "
        "generated counting task. Launch with torchrun for several ranks. Every option can also be set "
        "in a TOML file (--config), as [section] key = value; flags override the file.",
    )
    p.add_argument("--config", default=None, help="a TOML file of options (flags override it)")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for section, f in _options():
        group = groups.setdefault(section, p.add_argument_group(f"[{section}]"))
        flag = "--" + f.name.replace("_", "-")
        kind = _base_type(f)
        # An option that defaults to None says what that means in its own help.
        text = (
            f.metadata["help"]
            if f.default is None
            else f"{f.metadata['help']} (default: {f.default})"
        )
        if kind is bool:
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=text
            )
        else:
            bare = (
                {"nargs": "?", "const": f.metadata["bare"]}
                if f.metadata.get("bare") is not None
                else {}
            )
            group.add_argument(
                flag,
                type=kind,
                choices=f.metadata["choices"],
                default=argparse.SUPPRESS,
                help=text,
                metavar=None if f.metadata["choices"] else kind.__name__.upper(),
                **bare,
            )
    return p


def load_toml(path: str) -> dict[str, dict[str, Any]]:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ValueError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"--config {path}: not valid TOML ({err})") from None
    known = {
        section: {f.name for f in dataclasses.fields(type(obj))}
        for section, obj in JobConfig().sections().items()
    }
    for section, values in data.items():
        if section not in known or not isinstance(values, dict):
            raise ValueError(
                f"--config {path}: unknown section [{section}]; sections are {', '.join(known)}"
            )
        for key in values:
            if key not in known[section]:
                raise ValueError(
                    f"--config {path}: unknown key {key!r} in [{section}]; keys are {', '.join(sorted(known[section]))}"
                )
    return data


def resolve(argv: list[str] | None = None) -> JobConfig:
    """Defaults, then the TOML file, then the flags given on the command line."""
    args = vars(build_parser().parse_args(argv))
    config = JobConfig()
    if args.get("config"):
        for section, values in load_toml(args["config"]).items():
            target = getattr(config, section)
            for key, value in values.items():
                kind = _base_type(next(f for f in dataclasses.fields(target) if f.name == key))
                if kind is float and isinstance(value, int):
                    value = float(value)
                bare = next(f for f in dataclasses.fields(target) if f.name == key).metadata.get(
                    "bare"
                )
                if bare is not None and isinstance(
                    value, bool
                ):  # resume = true, as before it took a mode
                    value = bare if value else "no"
                if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                    raise ValueError(
                        f"--config: [{section}] {key} must be a {kind.__name__}, got {value!r}"
                    )
                setattr(target, key, value)
    for section, f in _options():
        if f.name in args:
            setattr(getattr(config, section), f.name, args[f.name])
    return config


def to_toml(config: JobConfig) -> str:
    """The resolved tree as TOML (unset options, None, are left out: TOML has no null)."""
    lines = []
    for section, values in config.sections().items():
        lines.append(f"[{section}]")
        for f in dataclasses.fields(values):
            value = getattr(values, f.name)
            if value is None:
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
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.toml"
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(to_toml(config))
    tmp.replace(path)
    return path
