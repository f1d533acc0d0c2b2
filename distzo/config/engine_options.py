"""Engine options, validated up front so that bad input fails before any model is built."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from distzo.config.field_types import field_types, is_of_type
from distzo.config.option_names import option_name as _n
from distzo.zo.estimators import ESTIMATORS, Estimator, Pass, estimator_for
from distzo.zo.noise import NOISE_KINDS
from distzo.zo.schedule import SCHEDULES

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
OPTIMIZER_STATES = ("auto", "recomputed", "stored")
STATE_DTYPES = ("fp32", "bf16")
LOW_BIT_MASTERS = ("buffer", "double", "recompute")
PERTURB_SCOPES = ("block", "module")
MAX_MOMENTUM_WINDOW = 256  # noise draws per block per update


@dataclass
class ZOConfig:
    """Options of one ZO run (MeZO-SGD on a resident or offloaded model).

    ``seed`` None draws a run seed at random; the step noise derives from it alone.
    ``noise`` is the kind of z: ``gaussian`` (default) or ``rademacher`` draw each element
    from Philox keyed by its coordinates, the same on every device (``noise_chunk`` is
    then only the workspace size); ``legacy`` is the ``torch.Generator`` noise of earlier
    versions, for their checkpoints and seed logs (its z depends on ``noise_chunk`` and
    on the device type); ``lowrank`` is LOZO's: ``U V^T`` per weight matrix, U of rank
    ``lozo_rank`` redrawn every step, V every ``lozo_interval`` steps (1-D tensors take
    Gaussian z; ``distzo.zo.lowrank``). ``transfer`` picks how blocks
    cross the link (``auto``: sliced on CUDA+NCCL with several local ranks, else naive);
    ``transfer_dtype`` is their format in host memory and on the wire (fp32 masters stay
    on the device); ``compute_dtype`` (``auto``: the model's dtype) is what the
    perturbed weights and activations use (AMP); ``transfer_chunks`` pieces of each
    rank's share pipeline the sliced upload's copy with its all-gather.
    ``low_bit_master`` says where a trained block that crosses the link in a low-bit
    ``transfer_dtype`` keeps its float32 master while it computes: ``buffer`` (one
    buffer the size of the largest block, the update applied once), ``double`` (two such
    buffers: a block's upcast runs on the upload stream and its stochastic rounding for
    the way back on the offload stream, while the compute stream runs the passes of
    another block; one float32 block more device memory) or
    ``recompute`` (no buffer: the master rebuilt ``noise_chunk`` elements at a time from
    the block's low-bit copy for each pass and for the write-back, the update's noise
    drawn again each time; one float32 block less device memory). All three take the
    same trajectory bit for bit.
    ``perturb_scope`` says how much of a block the passes hold perturbed at once:
    ``block`` (a scratch the size of the largest block, perturbed in one launch) or
    ``module`` (a scratch the size of its largest module, each module perturbed just
    before it runs: the same trajectory bit for bit, a dozen launches a block instead of
    one; full fine-tuning only, ``distzo.engine.module_scratch``).
    ``estimator`` turns a step's forward passes into its update (``distzo.zo.estimators``):
    ``spsa`` (MeZO's two-sided differences, n-SPSA with several queries) or ``fzoo``
    (FZOO: ``num_queries`` one-sided differences plus the unperturbed loss, normalised
    by the spread of the losses; it needs ``num_queries`` >= 2, FZOO's own is 8, and
    draws Rademacher z in its paper, which a job gives it unless told otherwise).
    ``num_queries`` directions per step average their estimates: each adds two forward
    passes per block under SPSA, one under FZOO, but no transfer, since a block is
    uploaded once per step.
    ``dual_forward`` / ``batch_queries`` (adapters only): the +eps and -eps passes of a
    query, and the passes of the several queries, run as one forward over a duplicated
    batch, each slice with its own adapter weights (P-RGE).
    ``grad_accum`` splits each step's batch into that many micro-batches that share the
    step's z: each runs through a block while the block is on the device (one upload per
    block per step), so the activations are one micro-batch's; the losses, and so g, are
    those of the whole batch.
    ``optimizer`` ``sgd`` is MeZO's ZO-SGD; ``momentum`` is ZO-SGD with momentum
    (``m_t = beta1 m_{t-1} + g_t z_t``, ``theta -= lr (m_t + wd theta)``) held as MeZO's
    appendix B.2 suggests: no state memory, ``m_t`` regenerated at each update from the
    last ``momentum_window`` steps' seeds and g, so the momentum is truncated after W
    steps (the terms dropped weigh ``beta1^W`` relative to the newest: 0.9^32 = 3.4 %).
    ``adam`` is MeZO-Adam: the moments of the estimate ``g_t z_t`` with
    ``beta1``/``beta2``, bias-corrected, ``adam_eps`` added to ``sqrt(v)`` and the weight
    decay decoupled, as the AdamW of transformers that MeZO trains with.
    ``optimizer_state`` says how a momentum or Adam keeps its state: ``recomputed``
    (momentum only, the default for it) or ``stored``: moment buckets beside each
    trained bucket, exact at any length, 1x (momentum) or 2x (Adam) the trained
    parameters' memory; streamed blocks carry theirs through the link with them, in
    ``state_dtype`` at rest in host memory (``bf16`` rounds them stochastically, as a
    low-bit transfer does the weights).
    ``num_slots`` device buffers hold streamed blocks: 3 lets upload, compute and offload
    of three blocks run at once (a period of max(transfer, compute) per block); with 2,
    upload(i+2) waits for offload(i), which waits for compute(i) (docs/ARCHITECTURE.md,
    section 5).
    """

    lr: float = 1e-6
    eps: float = 1e-3
    weight_decay: float = 0.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    max_steps: int | None = None
    mode: str = "offload"
    num_slots: int = 3
    device: str = "auto"
    seed: int | None = None
    noise_chunk: int = 1 << 22
    transfer: str = "auto"
    transfer_dtype: str = "fp32"
    compute_dtype: str = "auto"
    transfer_chunks: int = 4
    low_bit_master: str = "buffer"
    perturb_scope: str = "block"
    num_queries: int = 1
    estimator: str = "spsa"
    noise: str = "gaussian"
    lozo_rank: int = 2
    lozo_interval: int = 50
    dual_forward: bool = False
    batch_queries: bool = False
    grad_accum: int = 1
    optimizer: str = "sgd"
    beta1: float = 0.9
    momentum_window: int = 32
    beta2: float = 0.999
    adam_eps: float = 1e-8
    optimizer_state: str = "auto"
    state_dtype: str = "fp32"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Every option, each check naming its option and the fix, in a fixed order."""
        _check_types(self)
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be in [0, 2^63) or None (draw one), got {self.seed}")
        self._check_step_rule()
        self._check_layout()
        self._check_optimizer()
        self._check_batching()
        self._check_estimator()
        self._check_low_bit_master()
        self._check_perturb_scope()
        if self.transfer == "sliced" and self.mode != "offload":
            raise ValueError(
                f"{_n('transfer')} sliced only applies to {_n('mode')} offload (resident blocks "
                "never travel)"
            )
        self.torch_device()  # a malformed device string fails here, not mid-build

    def _check_step_rule(self) -> None:
        """The step's size and schedule."""
        for name in ("eps", "lr", "weight_decay", "adam_eps"):
            value = getattr(self, name)
            if value is not None and not abs(value) <= FLOAT32_MAX:  # inf, nan, past float32
                raise ValueError(
                    f"{_n(name)} must be a finite number a float32 holds, got {value}; give a "
                    "value such as 1e-3"
                )
        if not self.eps > 0:
            raise ValueError(
                f"{_n('eps')} must be > 0, got {self.eps}; set {_n('eps')} to a small positive "
                "value such as 1e-3"
            )
        if self.eps < FLOAT32_TINY:  # eps * z would be 0 in float32: every g 0, nothing learns
            raise ValueError(
                f"{_n('eps')} must be at least {FLOAT32_TINY:.3g} (float32's smallest normal "
                f"number), got {self.eps}; set {_n('eps')} to a small positive value such as 1e-3"
            )
        if not self.lr >= 0:
            raise ValueError(
                f"{_n('lr')} must be >= 0, got {self.lr}; set {_n('lr')} to a non-negative value "
                "such as 1e-6"
            )
        if not self.weight_decay >= 0:
            raise ValueError(f"{_n('weight_decay')} must be >= 0, got {self.weight_decay}")
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(
                f"{_n('lr_schedule')} must be one of {', '.join(SCHEDULES)}, got "
                f"{self.lr_schedule!r}"
            )
        if self.lr_schedule == "linear" and self.max_steps is None:
            raise ValueError(
                f"{_n('lr_schedule')} linear needs {_n('max_steps')}; set {_n('max_steps')} or use "
                f"{_n('lr_schedule')} constant"
            )
        if self.warmup_steps < 0:
            raise ValueError(f"{_n('warmup_steps')} must be >= 0, got {self.warmup_steps}")
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError(f"{_n('max_steps')} must be >= 0, got {self.max_steps}")

    def _check_layout(self) -> None:
        """Where blocks live and how they travel, and the noise they draw."""
        if self.mode not in MODES:
            raise ValueError(f"{_n('mode')} must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.num_slots < 1:
            raise ValueError(
                f"{_n('num_slots')} must be >= 1, got {self.num_slots}; use 2 or 3 to overlap "
                "transfers, 1 for least memory"
            )
        if self.noise_chunk < 1:
            raise ValueError(f"noise_chunk must be >= 1 element, got {self.noise_chunk}")
        if self.noise not in NOISE_KINDS:
            raise ValueError(
                f"{_n('noise')} must be one of {', '.join(NOISE_KINDS)}, got {self.noise!r}; "
                "gaussian is MeZO's z, rademacher SPSA's +-1"
            )
        self._check_lowrank()
        if self.transfer not in TRANSFERS:
            raise ValueError(
                f"{_n('transfer')} must be one of {', '.join(TRANSFERS)}, got {self.transfer!r}"
            )
        if self.transfer_dtype not in TRANSFER_DTYPE_NAMES:
            raise ValueError(
                f"{_n('transfer_dtype')} must be one of {', '.join(TRANSFER_DTYPE_NAMES)}, got "
                f"{self.transfer_dtype!r}"
            )
        if self.compute_dtype not in COMPUTE_DTYPE_NAMES:
            raise ValueError(
                f"{_n('compute_dtype')} must be one of {', '.join(COMPUTE_DTYPE_NAMES)}, got "
                f"{self.compute_dtype!r}"
            )
        if self.transfer_dtype != "fp32" and self.mode != "offload":
            raise ValueError(
                f"{_n('transfer_dtype')} {self.transfer_dtype} only applies to {_n('mode')} "
                f"offload (resident blocks never travel); use {_n('transfer_dtype')} fp32 or "
                f"{_n('mode')} offload"
            )
        if self.transfer_chunks < 1:
            raise ValueError(f"{_n('transfer_chunks')} must be >= 1, got {self.transfer_chunks}")

    def _check_low_bit_master(self) -> None:
        """A master placed otherwise than in one buffer needs a low-bit transfer, and one
        rebuilt for each pass a stateless update."""
        if self.low_bit_master not in LOW_BIT_MASTERS:
            raise ValueError(
                f"{_n('low_bit_master')} must be one of {', '.join(LOW_BIT_MASTERS)}, got "
                f"{self.low_bit_master!r}"
            )
        if self.low_bit_master == "buffer":
            return
        if self.mode != "offload" or self.transfer_dtype == "fp32":
            raise ValueError(
                f"{_n('low_bit_master')} {self.low_bit_master} places the float32 master of a "
                f"block that travels in a low-bit {_n('transfer_dtype')}; use {_n('mode')} offload "
                f"with {_n('transfer_dtype')} bf16, fp16 or fp8, or {_n('low_bit_master')} buffer"
            )
        if self.low_bit_master == "recompute" and self.stored_state:
            raise ValueError(
                f"{_n('low_bit_master')} recompute applies the update again for each pass, which "
                f"stored moments (Adam, {_n('optimizer_state')} stored) cannot take twice; use "
                f"{_n('low_bit_master')} buffer"
            )

    def _check_perturb_scope(self) -> None:
        """A module-wise scratch serves passes that run alone (no batched adapters)."""
        if self.perturb_scope not in PERTURB_SCOPES:
            raise ValueError(
                f"{_n('perturb_scope')} must be one of {', '.join(PERTURB_SCOPES)}, got "
                f"{self.perturb_scope!r}"
            )
        if self.perturb_scope == "module" and (self.dual_forward or self.batch_queries):
            raise ValueError(
                f"{_n('perturb_scope')} module perturbs a trained block's modules one pass at a "
                f"time; batched passes ({_n('dual_forward')}, {_n('batch_queries')}) train "
                f"adapters: use {_n('perturb_scope')} block"
            )

    def _check_lowrank(self) -> None:
        """LOZO's rank and interval: positive, and set only for the noise that uses them."""
        if self.lozo_rank < 1:
            raise ValueError(
                f"{_n('lozo_rank')} must be >= 1, got {self.lozo_rank}; LOZO uses 1 or 2 "
                "(default 2)"
            )
        if self.lozo_interval < 1:
            raise ValueError(
                f"{_n('lozo_interval')} must be >= 1 step, got {self.lozo_interval}; LOZO keeps V "
                "for 50 or 100 steps (default 50)"
            )
        changed = [
            f"{_n(name)} {getattr(self, name)}"
            for name in ("lozo_rank", "lozo_interval")
            if getattr(self, name) != engine_default(name)
        ]
        if changed and self.noise != "lowrank":
            verb, them = ("applies", "it") if len(changed) == 1 else ("apply", "them")
            raise ValueError(
                f"{' and '.join(changed)} only {verb} to {_n('noise')} lowrank (LOZO), the run "
                f"draws {self.noise}; set {_n('noise')} lowrank or drop {them}"
            )

    def _check_optimizer(self) -> None:
        """The update rule and its state."""
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"{_n('optimizer')} {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}"
            )
        if not 0 <= self.beta1 < 1:
            raise ValueError(f"{_n('beta1')} must be in [0, 1), got {self.beta1}")
        if not 1 <= self.momentum_window <= MAX_MOMENTUM_WINDOW:
            raise ValueError(
                f"{_n('momentum_window')} must be in [1, {MAX_MOMENTUM_WINDOW}], got "
                f"{self.momentum_window}: each step regenerates that many steps' noise per block"
            )
        if not 0 <= self.beta2 < 1:
            raise ValueError(f"{_n('beta2')} must be in [0, 1), got {self.beta2}")
        if not self.adam_eps > 0:
            raise ValueError(f"{_n('adam_eps')} must be > 0, got {self.adam_eps}; MeZO's is 1e-8")
        if self.optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(
                f"{_n('optimizer_state')} must be one of {', '.join(OPTIMIZER_STATES)}, got "
                f"{self.optimizer_state!r}"
            )
        if self.optimizer_state == "recomputed" and self.optimizer == "adam":
            raise ValueError(
                f"{_n('optimizer_state')} recomputed applies to momentum only (Adam's second "
                f"moment is not linear in the noise); use {_n('optimizer_state')} stored for adam"
            )
        if self.optimizer_state == "stored" and self.optimizer == "sgd":
            raise ValueError(
                f"ZO-SGD has no optimizer state to store; choose {_n('optimizer')} momentum or adam"
            )
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(
                f"{_n('state_dtype')} must be one of {', '.join(STATE_DTYPES)}, got "
                f"{self.state_dtype!r}"
            )
        if self.state_dtype != "fp32" and not (self.stored_state and self.mode == "offload"):
            raise ValueError(
                f"{_n('state_dtype')} {self.state_dtype} applies to stored optimizer state at rest "
                f"in host memory ({_n('optimizer')} adam, or momentum with {_n('optimizer_state')} "
                f"stored, in {_n('mode')} offload); use {_n('state_dtype')} fp32"
            )

    def _check_batching(self) -> None:
        """How a step's passes split the batch and the directions."""
        if self.grad_accum < 1:
            raise ValueError(
                f"{_n('grad_accum')} must be >= 1, got {self.grad_accum}; 1 runs the whole batch "
                "at once"
            )
        if self.num_queries < 1:
            raise ValueError(
                f"{_n('num_queries')} must be >= 1, got {self.num_queries}; use 1 for MeZO's SPSA, "
                "more to average directions"
            )

    def _check_estimator(self) -> None:
        """The estimator, and the options it cannot honour."""
        if self.estimator not in ESTIMATORS:
            raise ValueError(
                f"{_n('estimator')} must be one of {', '.join(ESTIMATORS)}, got {self.estimator!r}"
            )
        rule = self.estimator_rule
        if self.num_queries < rule.min_queries:
            raise ValueError(
                f"{_n('estimator')} {self.estimator} needs {_n('num_queries')} >= "
                f"{rule.min_queries}, got {self.num_queries}: sigma, the spread of its perturbed "
                f"losses, is 0 for one; its default is {rule.default_queries}"
            )
        if self.estimator == "fzoo" and self.dual_forward:
            raise ValueError(
                f"{_n('dual_forward')} batches each query's +eps and -eps passes, and fzoo's "
                f"passes are one-sided; drop {_n('dual_forward')} ({_n('batch_queries')} batches "
                "fzoo's perturbed passes)"
            )
        if self.estimator == "lozo" and self.noise != "lowrank":
            raise ValueError(
                f"{_n('estimator')} lozo perturbs along low-rank z, got {_n('noise')} "
                f"{self.noise}: set {_n('noise')} lowrank (the default of {_n('estimator')} lozo), "
                f"or use {_n('estimator')} spsa for {self.noise} z"
            )
        if self.estimator == "fzoo" and self.noise == "legacy":
            raise ValueError(
                f"{_n('noise')} legacy replays earlier versions' SPSA runs; fzoo draws rademacher "
                "(its default) or gaussian"
            )

    @property
    def estimator_rule(self) -> Estimator:
        """The estimator's passes and update coefficients (``distzo.zo.estimators``)."""
        return estimator_for(self.estimator)

    def step_passes(self) -> tuple[Pass, ...]:
        """Every pass of a step, in the order of its loss vector (a rank runs its share)."""
        return self.estimator_rule.passes(self.num_queries)

    @property
    def stored_state(self) -> bool:
        """Whether moment buckets are kept (Adam always; momentum when asked)."""
        return self.optimizer == "adam" or (
            self.optimizer == "momentum" and self.optimizer_state == "stored"
        )

    @property
    def rounds_on_host(self) -> bool:
        """Whether something rests on the host in a low-bit format, rounded stochastically at
        every offload (a low-bit transfer, bf16 moments): a step's result then depends on
        when it went back, so logged steps cannot be applied in one catch-up pass."""
        return self.transfer_dtype != "fp32" or self.state_dtype != "fp32"

    @property
    def master_buffers(self) -> int:
        """The float32 buffers a low-bit block's master is rebuilt in while it computes
        (``low_bit_master``): two where the upload and offload streams upcast and round it."""
        return {"buffer": 1, "double": 2, "recompute": 0}[self.low_bit_master]

    @property
    def num_moments(self) -> int:
        """Moment buckets per trained bucket: Adam's m and v, a stored momentum's m, else none."""
        return {"adam": 2, "momentum": 1}.get(self.optimizer, 0) if self.stored_state else 0

    def torch_device(self) -> torch.device:
        """The compute device: ``auto`` is the local CUDA device when present, else the CPU
        (any other device type is refused: the engine runs on CUDA or the CPU)."""
        if self.device == "auto":
            return (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise ValueError(
                f"{_n('device')} {self.device!r} is not a torch device; use auto, cpu, cuda or "
                "cuda:N"
            ) from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"{_n('device')} {self.device!r}: distzo runs on CUDA or the CPU; use auto, cpu, "
                "cuda or cuda:N"
            )
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"{_n('device')} {self.device!r} asked for, but CUDA is not available; use "
                f"{_n('device')} cpu"
            )
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device


def engine_default(name: str) -> Any:
    """ZOConfig's default of the option ``name``: what a job option the engine shares
    defaults to, so that the default is written once."""
    return next(f.default for f in dataclasses.fields(ZOConfig) if f.name == name)


def _check_types(config: ZOConfig) -> None:
    """Each option of the type it takes: a number read as text (YAML's ``1e-3``) or a count
    given as a fraction fails here by name, not deep inside the engine."""
    for name, (kind, optional) in field_types(ZOConfig).items():
        value = getattr(config, name)
        if kind in _TYPE_NAMES and not (value is None and optional) and not is_of_type(value, kind):
            raise ValueError(f"{_n(name)} must be {_TYPE_NAMES[kind]}, got {value!r}")


def optimizer_record(config: ZOConfig) -> dict:
    """The seed log header's record of the optimizer: what a replay needs to rebuild its updates."""
    return {
        "name": config.optimizer,
        "beta1": config.beta1,
        "momentum_window": config.momentum_window,
        "beta2": config.beta2,
        "adam_eps": config.adam_eps,
        "state": "stored"
        if config.stored_state
        else "recomputed"
        if config.optimizer == "momentum"
        else "none",
        "state_dtype": config.state_dtype,
    }


def lowrank_record(config: ZOConfig) -> dict | None:
    """What a seed log, a checkpoint or a state records of the low-rank noise's shape (its
    z depends on it): the rank and V's interval, or None for the other kinds."""
    if config.noise != "lowrank":
        return None
    return {"rank": config.lozo_rank, "interval": config.lozo_interval}


def lowrank_options(record: dict | None) -> dict:
    """The ``ZOConfig`` fields of a recorded ``lowrank_record`` (none for the other kinds)."""
    if not record:
        return {}
    return {"lozo_rank": record["rank"], "lozo_interval": record["interval"]}


def optimizer_options(record: dict | None) -> dict:
    """The ``ZOConfig`` fields of the run's optimizer (a log from before optimizers: ZO-SGD;
    from before stored state: a recomputed momentum). A replay is resident: fp32 state."""
    if not record:
        return {}
    options = {
        "optimizer": record["name"],
        "beta1": record["beta1"],
        "momentum_window": record["momentum_window"],
    }
    if "beta2" in record:
        options.update(beta2=record["beta2"], adam_eps=record["adam_eps"])
    if record.get("state") == "stored":
        options["optimizer_state"] = "stored"
    return options
