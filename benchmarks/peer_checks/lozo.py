"""The peer side of ``benchmarks/peer_lozo.py``: LOZO's own methods, read from its trainer
file and run as written on a minimal trainer, drawing from a stream that stands for
torch's generator.

That file's module imports a transformers of its time, so its LOZO methods are parsed out
with ``ast`` (``peer_methods``) and bound to ``PeerTrainer``, the least of HF's Trainer
they touch. Their draws are distzo's: the ``torch`` those methods see is ``StreamTorch``,
torch but for ``manual_seed``, ``randn`` and ``normal``, which read a flat stream
(``peer_stream``: in the order the peer's perturbation walks its parameters, distzo's V on
a step where the peer redraws V, U of each matrix and the z of each 1-D tensor).
``numpy``'s ``random.randint`` (the peer's per-step seed) returns the step, so reseeding a
step rewinds its stream, as ``torch.manual_seed`` rewinds the generator.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import subprocess
import textwrap
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

PEER_FILE = Path("large_models") / "LOZOtrainer.py"
PEER_METHODS = (
    "lowrank_zo_perturb_parameters",
    "lowrank_zo_step",
    "lowrank_zo_update",
    "random_gaussian_matrix",
    "zo_forward",
)
# LOZO-M lives in LOZO's RoBERTa trainer only
MOMENTUM_FILE = Path("medium_models") / "src" / "LOZOtrainer.py"
MOMENTUM_METHODS = (*PEER_METHODS[:2], "lowrank_zo_update_momentum", *PEER_METHODS[3:])


def peer_file(path: str, momentum: bool = False) -> Path:
    """The peer's trainer file: ``path`` itself or ``large_models/LOZOtrainer.py`` under it
    (``medium_models/src/LOZOtrainer.py`` for LOZO-M)."""
    given, wanted = Path(path), MOMENTUM_FILE if momentum else PEER_FILE
    found = given / wanted if given.is_dir() else given
    if not found.is_file():
        raise SystemExit(f"--lozo {path}: no {wanted} there; give a clone of optsuite/LOZO")
    return found


def peer_methods(
    source: str, torch_module: Any, numpy_module: Any, names: tuple[str, ...] = PEER_METHODS
) -> dict[str, Callable]:
    """The peer's LOZO methods ``names``, compiled from its source with ``torch`` and ``np``
    bound to the given modules (the rest of its module, and its imports, never run)."""
    found: dict[str, str] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name in names:
                    found[item.name] = textwrap.dedent(ast.get_source_segment(source, item) or "")
    missing = [name for name in names if name not in found]
    if missing:
        raise SystemExit(f"the peer's file has no method {', '.join(missing)}: is it LOZO's?")
    namespace: dict[str, Any] = {"torch": torch_module, "np": numpy_module}
    exec(compile("\n\n".join(found.values()), "<LOZOtrainer methods>", "exec"), namespace)
    return {name: namespace[name] for name in names}


class StreamTorch(types.ModuleType):
    """torch, but ``manual_seed(seed)`` rewinds the flat stream ``streams[seed]`` and
    ``randn``/``normal`` read the next values from it, as a generator would."""

    def __init__(self, streams: dict[int, torch.Tensor]) -> None:
        super().__init__("torch")
        self.streams, self.stream, self.at = streams, torch.empty(0), 0

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def manual_seed(self, seed: int) -> None:
        self.stream, self.at = self.streams[int(seed)], 0

    def _next(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = int(torch.Size(shape).numel())
        if self.at + n > self.stream.numel():
            raise RuntimeError("the peer drew past the stream built for its step")
        out = self.stream[self.at : self.at + n].view(shape).to(dtype)
        self.at += n
        return out

    def randn(self, *size: int, device: Any = None, dtype: Any = None) -> torch.Tensor:
        return self._next(tuple(size), dtype or torch.get_default_dtype())

    def normal(self, mean: float, std: float, size: Any, **kw: Any) -> torch.Tensor:
        return mean + std * self._next(tuple(size), kw.get("dtype") or torch.get_default_dtype())


class PeerTrainer:
    """The least of HF's Trainer the peer's methods touch."""

    # the peer's methods (bound in __init__) and the state they keep
    zo_forward: Callable[[torch.nn.Module, dict], torch.Tensor]
    lowrank_zo_step: Callable[[torch.nn.Module, dict], torch.Tensor]
    lowrank_zo_update: Callable[[], None]
    lowrank_zo_update_momentum: Callable[[], None]
    step: int
    projected_grad: float

    def __init__(self, args: argparse.Namespace, methods: dict[str, Callable]) -> None:
        self.args = types.SimpleNamespace(
            step_interval=args.interval,
            rank_r=args.rank,
            rank=args.rank,  # medium_models' name for it
            beta1=args.beta1,
            zo_eps=args.eps,
            weight_decay=args.weight_decay,
            gradient_accumulation_steps=1,
            non_diff=False,
            n_gpu=1,
        )
        self.lr = args.lr
        self.lr_scheduler = types.SimpleNamespace(step=lambda: None)
        for name, fn in methods.items():
            setattr(self, name, types.MethodType(fn, self))

    def _get_learning_rate(self) -> float:
        return self.lr

    def _prepare_inputs(self, inputs: dict) -> dict:
        return inputs

    def compute_loss_context_manager(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def compute_loss(self, model: torch.nn.Module, inputs: dict) -> torch.Tensor:
        """The causal-LM loss HF's Trainer takes from the model, but from the float64
        logits: transformers' loss casts them to float32, whose rounding of L+ - L- would
        move g by ~1e-4 here and hide the method behind it."""
        logits = model(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]
        ).logits
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), inputs["labels"][:, 1:].flatten()
        )


def peer_stream(model: torch.nn.Module, draws: dict, redraws_v: bool) -> torch.Tensor:
    """The flat stream of a step, in the order the peer's perturbation draws: per matrix
    V (when it redraws V) then U, per 1-D tensor its z."""
    parts: list[torch.Tensor] = []
    for name, param in model.named_parameters():
        if param.ndim >= 2:
            u, v = draws[name]
            parts += ([v] if redraws_v else []) + [u]
        else:
            parts.append(draws[name][0])
    return torch.cat([p.reshape(-1) for p in parts])


@contextlib.contextmanager
def measured_direction(trainer: PeerTrainer, model: torch.nn.Module) -> Iterator[dict]:
    """Record (theta + eps z - theta) / eps at the peer's first forward of a step."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    seen: dict[str, torch.Tensor] = {}
    forward = trainer.zo_forward

    def recording(model_: torch.nn.Module, inputs: dict) -> torch.Tensor:
        if not seen:
            for n, p in model_.named_parameters():
                seen[n] = (p.detach() - before[n]) / trainer.args.zo_eps
        return forward(model_, inputs)

    trainer.zo_forward = recording
    try:
        yield seen
    finally:
        trainer.zo_forward = forward


def peer_step(
    args: argparse.Namespace,
    trainer: PeerTrainer,
    model: torch.nn.Module,
    batch: dict,
    step: int,
    streams: dict[int, torch.Tensor],
    draws: dict,
) -> dict[str, torch.Tensor]:
    """The peer's step and update on ``model``, drawing from ``streams`` (the update's of a
    LOZO-M step served from ``draws``, distzo's); the direction it measured."""
    with measured_direction(trainer, model) as peer_z:
        trainer.lowrank_zo_step(model, batch)
    if not args.momentum:
        trainer.lowrank_zo_update()
    else:
        if args.update_draws == "perturbation":  # U and z as the perturbation drew them
            streams[step] = peer_stream(model, draws, False)
        trainer.lowrank_zo_update_momentum()
    if trainer.step != step:
        raise RuntimeError(f"the peer counts step {trainer.step} where distzo takes {step}")
    return peer_z


def peer_commit(found: Path) -> str | None:
    """The commit of the LOZO clone the file lies in (None for a file outside one)."""

    def git(*args: str) -> str:
        cmd = ["git", "-C", str(found.parent), *args]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()

    try:
        top = Path(git("rev-parse", "--show-toplevel"))
        if found.resolve() not in ((top / PEER_FILE).resolve(), (top / MOMENTUM_FILE).resolve()):
            return None
        return git("rev-parse", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        return None
