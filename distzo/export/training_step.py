"""P-RGE's training step as one ``torch.export`` program: the step an inference runtime
runs on a device with no PyTorch training code.

One call of the program is one step of the engine with a LoRA-FA adapter, one query
and the dual forward: it applies the previous step's update to every block's ``B``
(held in the program's buffers, mutated in place), perturbs them by ``+-eps z`` and
returns ``(L+, L-)`` from one forward over the batch twice, each half through its own
``B`` (``PassBatchedLinear``). The host keeps only scalars: it computes ``g = (L+ -
L-) / (2 eps)`` and passes ``-lr g`` into the next call with the Philox keys of the
steps (``step_keys``). The noise is the engine's own (Philox4x32-10 keyed by element and
the Gaussian table, computed with integer tensor ops inside the graph), so the program's
steps are the engine's: the same ``z``, the same losses and ``B`` up to float rounding.

Where P-RGE's on-device step draws ``torch.randn`` in the graph (a seed the host cannot
replay, hence its two stored copies of ``B``), this one draws the engine's ``z`` from
keys, so a run on a phone can be resumed, replayed and exported like any other.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import numpy as np
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import PretrainedConfig, PreTrainedModel

from distzo.adapters.peft_adapters import is_prefix_tuned
from distzo.engine import ZOEngine
from distzo.engine.build import compute_dtype
from distzo.models.batched_linear import make_pass_batched
from distzo.models.weights import WeightSource
from distzo.offload.low_bit import COMPUTE_DTYPES
from distzo.runtime.safetensors_write import safetensors_write
from distzo.zo import philox
from distzo.zo.gaussian_table import gaussian_table
from distzo.zo.triton_noise import LOW_BIT_MASTERS, as_operand


def step_keys(engine: ZOEngine, step: int) -> torch.Tensor:
    """The Philox keys of every block's adapter draw at ``step``: int64 ``[blocks, 2]``."""
    return steps_keys(engine, [step])[0]


def steps_keys(engine: ZOEngine, steps: Sequence[int] | np.ndarray) -> torch.Tensor:
    """``step_keys`` of each of ``steps``: int64 ``[steps, blocks, 2]``, by array ops (a
    Python loop over the steps took 2.4 s and 63 MB for the command's ``--steps 100000``,
    and 18 s of the command's 33 for a million)."""
    blocks = np.arange(1, len(engine.block_layouts) + 1)
    keys = philox.noise_keys(engine.noise.run_seed, steps, blocks, 0, philox.STREAM_NOISE)
    return torch.from_numpy(keys)


class TrainingStep(nn.Module):
    """The engine's LoRA-FA step as a module whose only state is the adapter (buffers)."""

    table: torch.Tensor  # the Gaussian noise table (a buffer)

    def __init__(self, engine: ZOEngine) -> None:
        super().__init__()
        check_exportable(engine)
        self.layouts = engine.block_layouts
        self.dtype = self.layouts[0].dtype
        # the dtype an op on the adapter computes in: float32 for a 16-bit one
        self.wide = torch.float32 if self.dtype in LOW_BIT_MASTERS else self.dtype
        self.eps = as_operand(engine.config.eps, self.dtype)
        values = dict(engine.stream_parameters()) | dict(engine.stream_parameters(frozen=True))
        self.model = model = _program_model(engine, values)
        for i, layout in enumerate(self.layouts):
            flat = torch.zeros(layout.numel, dtype=layout.dtype)
            for e in layout.entries:
                flat[e.offset : e.offset + e.numel] = values[e.names[0]].reshape(-1)
            self.register_buffer(f"adapter_{i}", flat)
        self.factors = [
            [
                (make_pass_batched(model.get_submodule(e.names[0].rpartition(".")[0])), e)
                for e in layout.entries
            ]
            for layout in self.layouts
        ]
        self.register_buffer("table", gaussian_table())
        self.decay_ends = [layout.decay_end for layout in self.layouts]
        self.widest = max(layout.numel for layout in self.layouts)

    def _noise(self, keys: torch.Tensor) -> torch.Tensor:
        """``z`` for every key row of ``keys`` (``[k, 2]``) over the largest block: one
        Philox graph for all blocks and both steps, so the program (and the time to lower
        it for a runtime) does not grow with the number of blocks. A block reads the
        first ``numel`` values of its row: an element's draw does not depend on how many
        are drawn."""
        bits = philox.torch_lanes((keys[:, :1], keys[:, 1:]), 0, self.widest, philox.LANES16)
        return self.table[bits]

    def _operand(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as the engine's ops on the adapter take it: rounded to a 16-bit adapter's
        dtype, then computed with in float32 (``add_scaled``'s rule)."""
        return x.to(self.dtype).to(self.wide)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor,
        previous_keys: torch.Tensor,
        update_scale: torch.Tensor,
        shrink: torch.Tensor,
        keys: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``update_scale`` = -lr g of the previous step (0 at the first), ``shrink`` =
        1 - lr wd."""
        noise = self._noise(torch.cat([previous_keys, keys])).unflatten(0, (2, len(self.layouts)))
        # a 16-bit adapter rounds as the engine's ops on its master do (``add_scaled``): z
        # and each scalar in its dtype, each op's float32 result rounded to it
        noise, update_scale = self._operand(noise), self._operand(update_scale)
        for i, layout in enumerate(self.layouts):
            theta = getattr(self, f"adapter_{i}")
            held, end = theta.to(self.wide), self.decay_ends[i]
            decayed = self._operand(torch.cat([held[:end] * shrink, held[end:]]))
            theta.copy_(decayed + update_scale * noise[0, i, : layout.numel])
            held, z = theta.to(self.wide), self.eps * noise[1, i, : layout.numel]
            both = torch.stack([held + z, held - z]).to(self.dtype)
            for module, e in self.factors[i]:
                module.stacked = both[:, e.offset : e.offset + e.numel].unflatten(1, e.shape)
        logits = self.model(
            input_ids=input_ids.repeat(2, 1), attention_mask=attention_mask.repeat(2, 1)
        ).logits
        for factors in self.factors:
            for module, _ in factors:
                module.stacked = None
        shifted = logits[:, :-1].float().log_softmax(-1)
        targets = labels[:, 1:].repeat(2, 1)
        real = targets != -100
        picked = shifted.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1) * real
        halves = picked.view(2, -1).sum(1) / -real[: labels.shape[0]].sum()
        return halves[0], halves[1]


def check_exportable(engine: ZOEngine) -> None:
    """Refuse, in one line before anything is traced, an engine whose step the program
    does not compute: P-RGE's on-device step is SPSA and ZO-SGD on a LoRA
    adapter inside the blocks, one query, one process, in the model's dtype."""
    if engine.config.estimator != "spsa":
        raise ValueError(
            f"the exportable step is SPSA's two passes (P-RGE's on-device step); the engine "
            f"runs estimator {engine.config.estimator}"
        )
    if engine.config.optimizer != "sgd":
        raise ValueError(
            f"the exportable step is ZO-SGD's update (P-RGE's on-device step); the engine "
            f"runs optimizer {engine.config.optimizer}"
        )
    if engine.peft_model is None or engine.config.noise != "gaussian":
        raise ValueError(
            "the exportable step needs a lora-fa (or lora) adapter engine with gaussian noise"
        )
    if is_prefix_tuned(engine.peft_model):
        raise ValueError(
            "the exportable step trains a LoRA adapter's factors (P-RGE's on-device "
            "step), not a prefix: attach --peft lora-fa (or lora)"
        )
    if engine.resident_layout.numel:
        trained = ", ".join(e.names[0] for e in engine.resident_layout.entries)
        raise ValueError(
            f"the exportable step trains adapters inside the blocks only, not on the "
            f"embeddings or the head ({trained}); leave those out of --lora-targets"
        )
    if engine.config.num_queries != 1 or engine.parallel.is_distributed:
        raise ValueError(
            "the exportable step runs one query in one process (P-RGE's on-device step)"
        )
    master = engine.block_layouts[0].dtype
    if compute_dtype(engine.config, master) != master:
        raise ValueError(
            f"the exportable step computes in the model's dtype ({master}); the engine "
            f"computes in {engine.config.compute_dtype}: build it with compute_dtype auto"
        )


# The experts' implementation the program traces where the engine's computes them one
# expert at a time (``eager``, a float64 mixture's: ``distzo.models.moe``): that loop over
# the experts the tokens were routed to is data-dependent, which torch.export refused
# ("Could not guard on data-dependent expression"); transformers' ``batched_mm`` computes
# the same products as one batched matmul of each token's chosen experts.
TRACEABLE_EXPERTS = "batched_mm"


def _program_model(engine: ZOEngine, values: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of the engine's model holding ``values`` as parameters of its own (the
    engine's are views of its scratch buckets): the frozen base becomes the program's
    constants, the adapter its mutable buffers."""
    model = copy.deepcopy(engine.model)
    from peft import PeftModel

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    if isinstance(base, PreTrainedModel):
        base.set_attn_implementation(_engines_attention(base))
        if getattr(base.config, "_experts_implementation", None) == "eager":
            base.set_experts_implementation(TRACEABLE_EXPERTS)
    with torch.no_grad():
        for name, _ in list(model.named_parameters()):
            owner, _, attr = name.rpartition(".")
            setattr(
                model.get_submodule(owner),
                attr,
                nn.Parameter(values[name].clone(), requires_grad=False),
            )
    return model


def _engines_attention(model: PreTrainedModel) -> str:
    """The attention the program computes: the engine's own. Eager and sdpa differ on a
    left-padded row's pad positions (every key masked: eager's softmax spreads over all
    keys, the future ones too, sdpa's gives 0), and the loss reads the last pad position's
    logits (they predict the first real token), so another attention is another step's
    losses. Kernels other than these two (flash, flex) compute sdpa's function."""
    return "eager" if model.config._attn_implementation == "eager" else "sdpa"


def export_training_step(
    engine: ZOEngine, batch: dict[str, torch.Tensor]
) -> torch.export.ExportedProgram:
    """``torch.export`` of the engine's step for batches shaped like ``batch``. Traced with
    sdpa's math kernel: the CPU's fused kernel returns a layout whose ``.contiguous()`` the
    trace drops, and once ``to_edge`` decomposes sdpa, GPT-2's Conv1D cannot view its input."""
    step = TrainingStep(engine).eval()
    keys = step_keys(engine, 0)
    # distinct tensors: inputs that alias while tracing are traced as one (labels that are
    # the input_ids tensor, as a language-modelling batch often has them, made a program
    # that embedded its labels and ignored its input_ids)
    args = (
        batch["input_ids"].clone(),
        batch["attention_mask"].clone(),
        batch["labels"].clone(),
        keys.clone(),
        torch.tensor(0.0),
        torch.tensor(1.0),
        keys.clone(),
    )
    with sdpa_kernel(SDPBackend.MATH):
        return torch.export.export(step, args)


def save_training_step(
    engine: ZOEngine, batch: dict[str, torch.Tensor], directory: str | Path, pte: bool = True
) -> list[Path]:
    """Write the exported step into ``directory``: ``step.pt2`` (``torch.export.save``;
    ``torch.export.load`` reads it back without unpickling code) and, where ``executorch``
    is installed, ``step.pte`` for the ExecuTorch runtime. Returns the files written.

    The program's adapter is the engine's flushed one (the last step's update applied): its
    first call takes ``update_scale`` 0 and ``shrink`` 1, after any number of steps."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    program = export_training_step(engine, batch)
    written = [directory / "step.pt2"]
    tmp = written[0].with_suffix(".tmp.pt2")  # torch.export.save wants the .pt2 suffix
    torch.export.save(program, tmp)
    tmp.replace(written[0])
    try:
        from executorch.exir import to_edge
    except ImportError:
        return written
    if not pte:
        return written
    lowered = to_edge(program).to_executorch()
    written.append(directory / "step.pte")
    tmp = written[-1].with_suffix(".pte.tmp")
    tmp.write_bytes(lowered.buffer)
    tmp.replace(written[-1])
    return written


def _parser() -> argparse.ArgumentParser:
    from distzo.config.cli import (
        add_version_flag,
        home_path,
        program,
        takes_negative_exponents,
    )

    p = argparse.ArgumentParser(
        prog=program("distzo.export.training_step"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    takes_negative_exponents(p)
    add_version_flag(p)
    p.add_argument(
        "--model",
        default=None,
        type=os.path.expanduser,
        help="local path or hub name of the base model (default: the tiny OPT)",
    )
    p.add_argument(
        "--out",
        required=True,
        type=home_path,
        help="folder for step.pt2 (and step.pte), keys.safetensors",
    )
    p.add_argument(
        "--dtype",
        choices=tuple(COMPUTE_DTYPES),
        default="fp32",
        help="the model's dtype, the adapter's and the step's arithmetic (an on-device "
        "model's bf16 or fp16: B and its updates round as the engine's on a model held so)",
    )
    p.add_argument("--batch", type=int, default=1, help="rows per step (the program's fixed shape)")
    p.add_argument("--seq", type=int, default=64, help="tokens per row (the program's fixed shape)")
    p.add_argument(
        "--steps", type=int, default=1000, help="steps whose Philox keys keys.safetensors holds"
    )
    p.add_argument("--seed", type=int, default=0, help="run seed: the adapter's init and every z")
    p.add_argument("--eps", type=float, default=1e-2)
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument(
        "--lora-targets", default=None, help="comma-separated module names (default: peft's)"
    )
    p.add_argument(
        "--pte",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also write step.pte for the ExecuTorch runtime (default: where executorch is "
        "installed; --pte without it is an error)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out (without it, an existing one is refused)",
    )
    return p


def _pte_wanted(asked: bool | None) -> bool:
    """Whether the command writes ``step.pte``. ``executorch`` is an extra: ``--pte`` without
    it is refused before any model is built (not a run that ends without the file asked
    for), and the default skips the file where it is missing, saying so."""
    try:
        import executorch.exir  # noqa: F401
    except ImportError as err:
        if asked:
            raise ValueError(
                f"--pte needs the executorch package ({err}): pip install "
                "'distzo[executorch]', or pass --no-pte"
            ) from None
        if asked is None:
            logging.getLogger("distzo.export.training_step").warning(
                "step.pte not written: the executorch package is not installed (%s); "
                "pip install 'distzo[executorch]' writes it, --no-pte skips it quietly",
                err,
            )
        return False
    return asked is not False


def _lora_fa_engine(args: argparse.Namespace) -> ZOEngine:
    """The command's engine: a LoRA-FA adapter on ``--model`` (or the tiny OPT), checked
    against the program's fixed shape before anything is traced."""
    from distzo.adapters.peft_adapters import AdapterSpec, AdapterWeights, attach_adapter
    from distzo.config.engine_options import ZOConfig
    from distzo.models import model_from_config
    from distzo.models.tiny import tiny_opt_config

    if args.batch < 1 or args.seq < 2 or args.steps < 1:
        raise ValueError("--batch and --steps must be >= 1 and --seq >= 2")
    targets = AdapterSpec.parse_targets(args.lora_targets)
    spec = AdapterSpec("lora-fa", args.lora_r, args.lora_alpha, 0.0, targets)
    spec.validate()
    base: nn.Module
    weights: WeightSource | None = None
    if args.model:
        base, weights = _checkpoint(args.model, targets)
    else:
        torch.manual_seed(args.seed)
        base = model_from_config(tiny_opt_config(), torch.float32)
    positions = cast(PretrainedConfig, base.config).max_position_embeddings
    if args.seq > positions:
        raise ValueError(f"--seq {args.seq} exceeds the model's {positions} positions")
    # the adapter is attached in float32, then cast with the base: the engine trains a
    # model of one dtype (peft would keep a 16-bit model's adapter in float32)
    model = attach_adapter(base, spec, args.seed).to(COMPUTE_DTYPES[args.dtype])
    return ZOEngine(
        model,
        ZOConfig(device="cpu", mode="resident", seed=args.seed, eps=args.eps),
        weights=AdapterWeights(weights, model) if weights is not None else None,
    )


def _checkpoint(name: str, targets: tuple[str, ...] | None) -> tuple[nn.Module, WeightSource]:
    """(skeleton, weight source) of ``--model`` as a training run reads it: a folder or a
    hub snapshot, its family checked from config.json before any weight is read, and a
    multimodal checkpoint's text model (what trains). transformers' own loader read a
    multimodal one as a model without positions (an AttributeError), and took a folder
    holding only an adapter for a hub name (a minute of retries)."""
    from distzo.models.config_file import read_config
    from distzo.models.hub import local_model_dir, snapshot
    from distzo.models.multimodal import checked_trained_config, checkpoint_model
    from distzo.models.registry import check_causal_lm
    from distzo.models.weights import check_weights

    source = local_model_dir(name) or snapshot(name, True)
    config = read_config(source)
    check_causal_lm(
        checked_trained_config(config, targets).model_type,
        "the exported training step (its loss is next-token cross-entropy)",
        "export the step of a causal LM",
    )
    model, weights = checkpoint_model(source, config, torch.float32)
    check_weights(weights, model)
    return model, weights


def _write(engine: ZOEngine, args: argparse.Namespace, directory: Path) -> list[Path]:
    """The command's files into ``directory``: the step program(s) and the steps' keys."""
    from safetensors.torch import save_file

    ids = torch.ones(args.batch, args.seq, dtype=torch.int64)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    files = save_training_step(engine, batch, directory, pte=args.pte)
    keys = steps_keys(engine, np.arange(args.steps))
    files.append(directory / "keys.safetensors")
    with safetensors_write(files[-1]):
        save_file({"keys": keys}, str(files[-1]), metadata={"eps": str(args.eps)})
    return files


def main(argv: list[str] | None = None) -> int:
    """``python -m distzo.export.training_step``: the LoRA-FA training step of a model, for a
    runtime, written under ``<out>.tmp`` and renamed (an existing --out only with
    --overwrite)."""
    from distzo.config.cli import fail
    from distzo.export.out_dir import check_out, publish, staging_dir

    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        args.pte = _pte_wanted(args.pte)
        args.out = check_out(args.out, args.overwrite)
        engine = _lora_fa_engine(args)
        tmp = staging_dir(args.out)
        try:
            files = _write(engine, args, tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # no half-written output left behind
            raise
        publish(tmp, args.out)
    except (ValueError, OSError) as err:
        return fail(str(err).splitlines()[0])
    for f in files:
        logging.getLogger("distzo.export.training_step").info("wrote %s", args.out / f.name)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
