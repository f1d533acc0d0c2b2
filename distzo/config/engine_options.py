"""Engine options, validated up front so that bad input fails before any model is built."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from distzo.config.engine_checks import check_options
from distzo.runtime.option_names import option_name as _n
from distzo.zo.estimators import Estimator, Pass, estimator_for


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
    ``micro_batch_rows`` (0: no bound) bounds the rows of a pass that one such micro-batch
    holds: a step runs as many as that takes, at least ``grad_accum``. A choice batch's
    rows are its examples' candidate rows, so one example of 50 candidates can run a few
    rows a forward (``grad_accum`` counts micro-batches, and cannot go below one example).
    ``optimizer`` ``sgd`` is MeZO's ZO-SGD; ``momentum`` is ZO-SGD with momentum
    (``m_t = beta1 m_{t-1} + g_t z_t``, ``theta -= lr (m_t + wd theta)``) held as MeZO's
    appendix B.2 suggests: no state memory, ``m_t`` regenerated at each update from the
    last ``momentum_window`` steps' seeds and g, so the momentum is truncated after W
    steps (the terms dropped weigh ``beta1^W`` relative to the newest: 0.9^32 = 3.4 %).
    ``adam`` is MeZO-Adam: the moments of the estimate ``g_t z_t`` with
    ``beta1``/``beta2``, bias-corrected, ``adam_eps`` added to ``sqrt(v)`` and the weight
    decay decoupled, as the AdamW of transformers that MeZO trains with.
    ``optimizer_state`` says how a momentum or Adam keeps its state: ``recomputed``
    (momentum only, the default for it), ``lowrank`` (LOZO-M: momentum with ``noise``
    lowrank, kept as m x r factors on the device, ``distzo.zo.lowrank_momentum``) or
    ``stored``: moment buckets beside each
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
    micro_batch_rows: int = 0
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
        """Every option, each check naming its option and the fix (``engine_checks``)."""
        check_options(self)

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
    def lowrank_state(self) -> bool:
        """Whether the momentum is LOZO-M's, kept in the low-rank factors on the device."""
        return self.optimizer == "momentum" and self.optimizer_state == "lowrank"

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
        else "lowrank"
        if config.lowrank_state
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
    if record.get("state") in ("stored", "lowrank"):
        options["optimizer_state"] = record["state"]
    return options
