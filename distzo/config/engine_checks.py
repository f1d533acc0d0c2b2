"""The checks of the engine's options (``ZOConfig.validate``) and the choices they accept:
each names its option (``distzo.runtime.option_names``) and the fix, in a fixed order, so
that bad input fails before any model is built."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import torch

from distzo.config.field_types import field_types, is_of_type
from distzo.runtime.option_names import option_name as _n
from distzo.runtime.option_names import options_are_flags
from distzo.zo.estimators import ESTIMATORS
from distzo.zo.noise import NOISE_KINDS
from distzo.zo.schedule import SCHEDULES

if TYPE_CHECKING:
    from distzo.config.engine_options import ZOConfig

FLOAT32_MAX = torch.finfo(torch.float32).max
FLOAT32_TINY = torch.finfo(torch.float32).tiny
SEED_LIMIT = 2**63  # a checkpoint holds the run seed as an int64
# how an error names the value type an option takes
_TYPE_NAMES = {int: "a whole number", float: "a number", str: "a string", bool: "True or False"}

MODES = ("offload", "resident")
TRANSFERS = ("auto", "naive", "sliced")
TRANSFER_DTYPE_NAMES = ("fp32", "bf16", "fp16", "fp8")
COMPUTE_DTYPE_NAMES = ("auto", "fp32", "bf16", "fp16")


ESTIMATOR_NAMES = tuple(ESTIMATORS)
OPTIMIZERS = ("sgd", "momentum", "adam")
OPTIMIZER_STATES = ("auto", "recomputed", "stored", "lowrank")
STATE_DTYPES = ("fp32", "bf16")
LOW_BIT_MASTERS = ("buffer", "double", "recompute")
PERTURB_SCOPES = ("block", "module")
MAX_MOMENTUM_WINDOW = 256  # noise draws per block per update


def _check_choice(config: ZOConfig, name: str, choices: Collection[str], hint: str = "") -> None:
    """Option ``name`` is one of ``choices``; else one line naming them (and ``hint``)."""
    value = getattr(config, name)
    if value not in choices:
        raise ValueError(f"{_n(name)} must be one of {', '.join(choices)}, got {value!r}{hint}")


def check_options(config: ZOConfig) -> None:
    """Every option, each check naming its option and the fix, in a fixed order."""
    _check_types(config)
    if config.seed is not None and not 0 <= config.seed < SEED_LIMIT:
        raise ValueError(f"seed must be in [0, 2^63) or None (draw one), got {config.seed}")
    _check_step_rule(config)
    _check_layout(config)
    _check_optimizer(config)
    _check_batching(config)
    _check_estimator(config)
    _check_low_bit_master(config)
    _check_perturb_scope(config)
    if config.transfer == "sliced" and config.mode != "offload":
        raise ValueError(
            f"{_n('transfer')} sliced only applies to {_n('mode')} offload (resident blocks "
            "never travel)"
        )
    config.torch_device()  # a malformed device string fails here, not mid-build


def _check_step_rule(config: ZOConfig) -> None:
    """The step's size and schedule."""
    for name in ("eps", "lr", "weight_decay", "adam_eps"):
        value = getattr(config, name)
        if value is not None and not abs(value) <= FLOAT32_MAX:  # inf, nan, past float32
            raise ValueError(
                f"{_n(name)} must be a finite number a float32 holds, got {value}; give a "
                "value such as 1e-3"
            )
    if not config.eps > 0:
        raise ValueError(
            f"{_n('eps')} must be > 0, got {config.eps}; set {_n('eps')} to a small positive "
            "value such as 1e-3"
        )
    if config.eps < FLOAT32_TINY:  # eps * z would be 0 in float32: every g 0, nothing learns
        raise ValueError(
            f"{_n('eps')} must be at least {FLOAT32_TINY:.3g} (float32's smallest normal "
            f"number), got {config.eps}; set {_n('eps')} to a small positive value such as 1e-3"
        )
    if not config.lr >= 0:
        raise ValueError(
            f"{_n('lr')} must be >= 0, got {config.lr}; set {_n('lr')} to a non-negative value "
            "such as 1e-6"
        )
    if not config.weight_decay >= 0:
        raise ValueError(f"{_n('weight_decay')} must be >= 0, got {config.weight_decay}")
    _check_choice(config, "lr_schedule", SCHEDULES)
    if config.lr_schedule == "linear" and config.max_steps is None:
        raise ValueError(
            f"{_n('lr_schedule')} linear needs {_n('max_steps')}; set {_n('max_steps')} or use "
            f"{_n('lr_schedule')} constant"
        )
    if config.warmup_steps < 0:
        raise ValueError(f"{_n('warmup_steps')} must be >= 0, got {config.warmup_steps}")
    if config.max_steps is not None and config.max_steps < 0:
        raise ValueError(f"{_n('max_steps')} must be >= 0, got {config.max_steps}")


def _check_layout(config: ZOConfig) -> None:
    """Where blocks live and how they travel, and the noise they draw."""
    _check_choice(config, "mode", MODES)
    if config.num_slots < 1:
        raise ValueError(
            f"{_n('num_slots')} must be >= 1, got {config.num_slots}; use 2 or 3 to overlap "
            "transfers, 1 for least memory"
        )
    if config.noise_chunk < 1:
        raise ValueError(f"noise_chunk must be >= 1 element, got {config.noise_chunk}")
    _check_choice(config, "noise", NOISE_KINDS, "; gaussian is MeZO's z, rademacher SPSA's +-1")
    _check_lowrank(config)
    _check_choice(config, "transfer", TRANSFERS)
    _check_choice(config, "transfer_dtype", TRANSFER_DTYPE_NAMES)
    _check_choice(config, "compute_dtype", COMPUTE_DTYPE_NAMES)
    if config.transfer_dtype != "fp32" and config.mode != "offload":
        raise ValueError(
            f"{_n('transfer_dtype')} {config.transfer_dtype} only applies to {_n('mode')} "
            f"offload (resident blocks never travel); use {_n('transfer_dtype')} fp32 or "
            f"{_n('mode')} offload"
        )
    if config.transfer_chunks < 1:
        raise ValueError(f"{_n('transfer_chunks')} must be >= 1, got {config.transfer_chunks}")


def _check_low_bit_master(config: ZOConfig) -> None:
    """A master placed otherwise than in one buffer needs a low-bit transfer, and one
    rebuilt for each pass a stateless update."""
    _check_choice(config, "low_bit_master", LOW_BIT_MASTERS)
    if config.low_bit_master == "buffer":
        return
    if config.mode != "offload" or config.transfer_dtype == "fp32":
        raise ValueError(
            f"{_n('low_bit_master')} {config.low_bit_master} places the float32 master of a "
            f"block that travels in a low-bit {_n('transfer_dtype')}; use {_n('mode')} offload "
            f"with {_n('transfer_dtype')} bf16, fp16 or fp8, or {_n('low_bit_master')} buffer"
        )
    if config.low_bit_master == "recompute" and (config.stored_state or config.lowrank_state):
        raise ValueError(
            f"{_n('low_bit_master')} recompute applies the update again for each pass, which "
            f"stored moments (Adam, {_n('optimizer_state')} stored or lowrank) cannot take "
            "twice; use "
            f"{_n('low_bit_master')} buffer"
        )


def _check_perturb_scope(config: ZOConfig) -> None:
    """A module-wise scratch serves passes that run alone (no batched adapters)."""
    _check_choice(config, "perturb_scope", PERTURB_SCOPES)
    if config.perturb_scope == "module" and (config.dual_forward or config.batch_queries):
        raise ValueError(
            f"{_n('perturb_scope')} module perturbs a trained block's modules one pass at a "
            f"time; batched passes ({_n('dual_forward')}, {_n('batch_queries')}) train "
            f"adapters: use {_n('perturb_scope')} block"
        )


def _check_lowrank(config: ZOConfig) -> None:
    """LOZO's rank and interval: positive, and set only for the noise that uses them."""
    if config.lozo_rank < 1:
        raise ValueError(
            f"{_n('lozo_rank')} must be >= 1, got {config.lozo_rank}; LOZO uses 1 or 2 (default 2)"
        )
    if config.lozo_interval < 1:
        raise ValueError(
            f"{_n('lozo_interval')} must be >= 1 step, got {config.lozo_interval}; LOZO keeps V "
            "for 50 or 100 steps (default 50)"
        )
    changed = [
        f"{_n(name)} {getattr(config, name)}"
        for name in ("lozo_rank", "lozo_interval")
        if getattr(config, name) != _default(config, name)
    ]
    if changed and config.noise != "lowrank":
        verb, them = ("applies", "it") if len(changed) == 1 else ("apply", "them")
        raise ValueError(
            f"{' and '.join(changed)} only {verb} to {_n('noise')} lowrank (LOZO), the run "
            f"draws {config.noise}; set {_n('noise')} lowrank or drop {them}"
        )


def _check_optimizer(config: ZOConfig) -> None:
    """The update rule and its state."""
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(
            f"{_n('optimizer')} {config.optimizer!r} is not one of {', '.join(OPTIMIZERS)}"
        )
    if not 0 <= config.beta1 < 1:
        raise ValueError(f"{_n('beta1')} must be in [0, 1), got {config.beta1}")
    if not 1 <= config.momentum_window <= MAX_MOMENTUM_WINDOW:
        raise ValueError(
            f"{_n('momentum_window')} must be in [1, {MAX_MOMENTUM_WINDOW}], got "
            f"{config.momentum_window}: each step regenerates that many steps' noise per block"
        )
    if not 0 <= config.beta2 < 1:
        raise ValueError(f"{_n('beta2')} must be in [0, 1), got {config.beta2}")
    if not config.adam_eps > 0:
        raise ValueError(f"{_n('adam_eps')} must be > 0, got {config.adam_eps}; MeZO's is 1e-8")
    _check_choice(config, "optimizer_state", OPTIMIZER_STATES)
    if config.optimizer_state == "recomputed" and config.optimizer == "adam":
        raise ValueError(
            f"{_n('optimizer_state')} recomputed applies to momentum only (Adam's second "
            f"moment is not linear in the noise); use {_n('optimizer_state')} stored for adam"
        )
    if config.optimizer_state == "stored" and config.optimizer == "sgd":
        raise ValueError(
            f"ZO-SGD has no optimizer state to store; choose {_n('optimizer')} momentum or adam"
        )
    _check_lowrank_state(config)
    _check_choice(config, "state_dtype", STATE_DTYPES)
    if config.state_dtype != "fp32" and not (config.stored_state and config.mode == "offload"):
        raise ValueError(
            f"{_n('state_dtype')} {config.state_dtype} applies to stored optimizer state at rest "
            f"in host memory ({_n('optimizer')} adam, or momentum with {_n('optimizer_state')} "
            f"stored, in {_n('mode')} offload; lowrank's factors stay on the device); use "
            f"{_n('state_dtype')} fp32"
        )


def _check_lowrank_state(config: ZOConfig) -> None:
    """LOZO-M keeps a momentum of one low-rank estimate a step in that estimate's factors."""
    if config.optimizer_state != "lowrank":
        return
    state = f"{_n('optimizer_state')} lowrank"
    if config.optimizer != "momentum":
        raise ValueError(
            f"{state} is LOZO-M, a momentum kept in the low-rank factors; use "
            f"{_n('optimizer')} momentum, or {_n('optimizer_state')} stored for {config.optimizer}"
        )
    if config.noise != "lowrank":
        raise ValueError(
            f"{state} keeps the momentum in the factors of low-rank z, the run draws "
            f"{_n('noise')} {config.noise}: use {_n('estimator')} lozo, or "
            f"{_n('optimizer_state')} stored or recomputed"
        )
    if config.num_queries != 1:
        raise ValueError(
            f"{state} takes one low-rank estimate a step, got {_n('num_queries')} "
            f"{config.num_queries}: use {_n('num_queries')} 1, or {_n('optimizer_state')} stored"
        )


def _check_batching(config: ZOConfig) -> None:
    """How a step's passes split the batch and the directions."""
    if config.grad_accum < 1:
        raise ValueError(
            f"{_n('grad_accum')} must be >= 1, got {config.grad_accum}; 1 runs the whole batch "
            "at once"
        )
    if config.micro_batch_rows < 0:
        raise ValueError(
            f"{_n('micro_batch_rows')} must be >= 0, got {config.micro_batch_rows}; 0 leaves "
            "a micro-batch's rows unbounded"
        )
    if config.num_queries < 1:
        raise ValueError(
            f"{_n('num_queries')} must be >= 1, got {config.num_queries}; use 1 for MeZO's SPSA, "
            "more to average directions"
        )


def _check_estimator(config: ZOConfig) -> None:
    """The estimator, and the options it cannot honour."""
    _check_choice(config, "estimator", ESTIMATORS)
    rule = config.estimator_rule
    if config.num_queries < rule.min_queries:
        default = (  # ZOConfig's num_queries is 1 whatever the estimator; the job's follows it
            f"its default is {rule.default_queries}"
            if options_are_flags()
            else f"the command line's default for it is {rule.default_queries}"
        )
        raise ValueError(
            f"{_n('estimator')} {config.estimator} needs {_n('num_queries')} >= "
            f"{rule.min_queries}, got {config.num_queries}: sigma, the spread of its perturbed "
            f"losses, is 0 for one; {default}"
        )
    if config.estimator == "fzoo" and config.dual_forward:
        raise ValueError(
            f"{_n('dual_forward')} batches each query's +eps and -eps passes, and fzoo's "
            f"passes are one-sided; drop {_n('dual_forward')} ({_n('batch_queries')} batches "
            "fzoo's perturbed passes)"
        )
    if config.estimator == "lozo" and config.noise != "lowrank":
        why = (  # ZOConfig's noise is gaussian whatever the estimator; the job's follows it
            f"the default of {_n('estimator')} lozo"
            if options_are_flags()
            else "lozo's only noise; ZOConfig's noise is gaussian whatever the estimator"
        )
        raise ValueError(
            f"{_n('estimator')} lozo perturbs along low-rank z, got {_n('noise')} "
            f"{config.noise}: set {_n('noise')} lowrank ({why}), "
            f"or use {_n('estimator')} spsa for {config.noise} z"
        )
    if config.estimator == "fzoo" and config.noise == "legacy":
        raise ValueError(
            f"{_n('noise')} legacy replays earlier versions' SPSA runs; fzoo draws rademacher "
            f"({'its default' if options_are_flags() else 'as in its paper'}) or gaussian"
        )


def _check_types(config: ZOConfig) -> None:
    """Each option of the type it takes: a number read as text (YAML's ``1e-3``) or a count
    given as a fraction fails here by name, not deep inside the engine."""
    for name, (kind, optional) in field_types(type(config)).items():
        value = getattr(config, name)
        if kind in _TYPE_NAMES and not (value is None and optional) and not is_of_type(value, kind):
            raise ValueError(f"{_n(name)} must be {_TYPE_NAMES[kind]}, got {value!r}")


def _default(config: ZOConfig, name: str) -> Any:
    """The engine's default of the option ``name``."""
    return next(f.default for f in dataclasses.fields(config) if f.name == name)
