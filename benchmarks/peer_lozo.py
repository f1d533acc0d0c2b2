"""distzo's LOZO step beside LOZO's own code, fed the same U, V and z.

    python benchmarks/peer_lozo.py --lozo PATH [--steps 7 --interval 3 --rank 2]
    python benchmarks/peer_lozo.py --lozo PATH --momentum [--beta1 0.9]   # LOZO-M

``PATH`` is a clone of optsuite/LOZO (its ``large_models/LOZOtrainer.py`` is read) or that
file itself; it is never vendored here. Why this way: a claim about a peer is measured
against the peer's own code. That file's module imports a transformers of its time, so its
four LOZO methods (``lowrank_zo_perturb_parameters``, ``lowrank_zo_step``,
``lowrank_zo_update``, ``random_gaussian_matrix``) and its ``zo_forward`` are parsed out
with ``ast`` and run, as written, on a minimal trainer: the loss is the model's causal-LM
loss (from its float64 logits), the learning rate constant, no gradient accumulation.

Their draws are distzo's: the ``torch`` those methods see is torch but for
``manual_seed``, ``randn`` and ``normal``, which read a flat stream standing for torch's
generator. The stream of a step holds, in the order the peer's perturbation walks its
parameters, distzo's V (on a step where the peer redraws V), U of each matrix and the z of
each 1-D tensor, all from distzo's ``LowRankNoise`` of that step. ``numpy``'s
``random.randint`` (the peer's per-step seed) returns the step, so reseeding a step rewinds
its stream, as ``torch.manual_seed`` rewinds the generator.

``--momentum`` runs LOZO-M instead: LOZO's ``medium_models/src/LOZOtrainer.py`` (its
RoBERTa trainer, the one with LOZO-M), its ``lowrank_zo_update_momentum`` for the update,
beside distzo's ``--optimizer-state lowrank``. Each side keeps its own momentum factors
from step to step, so the weights after each step compare the factors' recursion,
through V's redraws. That update regenerates U by rewinding the generator, which on a
step that redraws V stands where the perturbation drew V, not U (the difference the
plain update has, above); here the update's stream holds the perturbation's U and z, so
that the comparison is of the momentum's arithmetic, and ``--update-draws as-written``
serves it the perturbation's stream as the real generator would.

Each step starts both from distzo's weights before it (a float64 tiny OPT built from a
config, so that differences are the method's, not rounding), on the same batch, and
reports: the two projected gradients, the largest weight difference after the step, and,
for each side, the cosine between the direction it measured (its ``theta + eps z`` minus
``theta``) and the direction it moved (weight decay 0 by default, so the update is
``-lr g z'``): 1.0 when a step moves along what it measured.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import json
import subprocess
import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import OPTConfig

from distzo import ZOConfig, ZOEngine
from distzo.engine import RESIDENT_BLOCK_ID
from distzo.models import model_from_config
from distzo.models.tiny import tiny_opt_config
from distzo.zo.lowrank import LowRankNoise

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
# A float64 tiny OPT with GELU (a central difference across a ReLU kink is no derivative).
MODEL = dict(
    num_hidden_layers=2,
    hidden_size=16,
    ffn_dim=32,
    num_attention_heads=2,
    word_embed_proj_dim=8,
    max_position_embeddings=16,
    activation_function="gelu",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lozo", required=True, help="a clone of optsuite/LOZO, or its LOZOtrainer.py")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--interval", type=int, default=3, help="steps V is kept (LOZO's step_interval)")
    p.add_argument("--rank", type=int, default=2, help="LOZO's rank_r")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--eps", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the report here as JSON")
    p.add_argument(
        "--momentum",
        action="store_true",
        help="LOZO-M: medium_models' lowrank_zo_update_momentum beside --optimizer-state lowrank",
    )
    p.add_argument("--beta1", type=float, default=0.9, help="LOZO-M's beta1 (with --momentum)")
    p.add_argument(
        "--update-draws",
        choices=("perturbation", "as-written"),
        default="perturbation",
        help="LOZO-M's update draws the perturbation's U (default) or, as its code does, "
        "rewinds to the perturbation's stream",
    )
    p.add_argument(
        "--peer-draws",
        action="store_true",
        help="the peer alone with its own torch and numpy draws: only its cosine column",
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.interval < 1 or args.rank < 1:
        p.error("--steps, --interval and --rank must be >= 1")
    if args.momentum and args.peer_draws:
        p.error("--peer-draws measures the plain update's direction; drop it or --momentum")
    if args.momentum and args.interval < 2:
        p.error("--momentum needs --interval >= 2: LOZO's code keeps V_old only then")
    return args


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


def distzo_draws(engine: ZOEngine, step: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """Every trained tensor's draws at ``step``: (U, V) of a matrix, (z,) of a 1-D tensor."""
    out: dict[str, tuple[torch.Tensor, ...]] = {}
    noise = engine.noise
    assert isinstance(noise, LowRankNoise)
    layouts = [(engine.resident_layout, RESIDENT_BLOCK_ID)]
    layouts += [(layout, i + 1) for i, layout in enumerate(engine.block_layouts)]
    for layout, block_id in layouts:
        whole = noise.full(layout.numel, step, block_id)
        for e in layout.entries:
            if len(e.shape) >= 2:
                draws: tuple[torch.Tensor, ...] = noise.factors(step, block_id, e.offset)
            else:
                draws = (whole[e.offset : e.offset + e.numel].clone(),)
            for name in e.names:
                out[name] = draws
    return out


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


def cosine(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    x = torch.cat([a[k].reshape(-1) for k in sorted(a)])
    y = torch.cat([b[k].reshape(-1) for k in sorted(a)])
    return float(x @ y / (x.norm() * y.norm()))


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


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """Run the steps; one record per step."""
    found = peer_file(args.lozo, args.momentum)
    source = found.read_text()
    config = tiny_opt_config(**MODEL)
    engine, peer_model = twin_models(config, args)
    streams: dict[int, torch.Tensor] = {}
    numpy_seed = types.SimpleNamespace(random=types.SimpleNamespace(randint=None))
    names = MOMENTUM_METHODS if args.momentum else PEER_METHODS
    trainer = PeerTrainer(args, peer_methods(source, StreamTorch(streams), numpy_seed, names))
    gen = torch.Generator().manual_seed(args.seed)
    steps = []
    for step in range(args.steps):
        ids = torch.randint(3, config.vocab_size, (4, 12), generator=gen)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        start = engine.named_parameters()
        with torch.no_grad():
            for name, param in peer_model.named_parameters():
                param.copy_(start[name])
        draws = distzo_draws(engine, step)
        streams[step] = peer_stream(peer_model, draws, step % args.interval == 0)
        numpy_seed.random.randint = lambda high, s=step: s  # the peer's seed names the step
        theta = {n: p.detach().clone() for n, p in peer_model.named_parameters()}
        peer_z = peer_step(args, trainer, peer_model, batch, step, streams, draws)
        result = engine.step(batch)
        ours = engine.named_parameters()
        peer = {n: p.detach() for n, p in peer_model.named_parameters()}
        g_peer, g_ours = float(trainer.projected_grad), float(result.projected_grad)
        ours_z = drawn_direction(draws, theta)
        steps.append(
            step_record(step, args, theta, Side(peer, peer_z, g_peer), Side(ours, ours_z, g_ours))
        )
    return {
        "peer_file": str(found),
        "peer_sha256": hashlib.sha256(source.encode()).hexdigest(),
        "peer_commit": peer_commit(found),
        "options": {k: v for k, v in vars(args).items() if k not in ("lozo", "out")},
        "peer_method": "lowrank_zo_update_momentum" if args.momentum else "lowrank_zo_update",
        "steps": steps,
    }


def twin_models(config: OPTConfig, args: argparse.Namespace) -> tuple[ZOEngine, torch.nn.Module]:
    """distzo's LOZO engine and the peer's model: two float64 tiny OPTs of one seed."""
    torch.manual_seed(args.seed)
    ours_model = model_from_config(config, dtype=torch.float64)
    peer_model = model_from_config(config, dtype=torch.float64)
    engine = ZOEngine(
        ours_model,
        ZOConfig(
            estimator="lozo",
            noise="lowrank",
            lr=args.lr,
            eps=args.eps,
            weight_decay=args.weight_decay,
            seed=args.seed,
            device="cpu",
            lozo_rank=args.rank,
            lozo_interval=args.interval,
            **_momentum_options(args),
        ),
    )
    return engine, peer_model


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


class Side(NamedTuple):
    """One side of a step: its weights after it, the direction z, the projected gradient."""

    weights: dict[str, torch.Tensor]
    z: dict[str, torch.Tensor]
    g: float


def drawn_direction(draws: dict, theta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """distzo's z of each tensor from its draws: ``U V^T`` of a matrix, z of a 1-D tensor."""
    return {
        n: (draws[n][0] @ draws[n][1].T).view_as(theta[n]) if theta[n].ndim >= 2 else draws[n][0]
        for n in theta
    }


def step_record(
    step: int, args: argparse.Namespace, theta: dict[str, torch.Tensor], peer: Side, ours: Side
) -> dict[str, Any]:
    """A step's record, from both sides' weights before (``theta``) and after it: the two
    g, z and weights apart, and the cosine of each side's move with what it measured."""
    moved = {n: peer.weights[n] - theta[n] for n in theta}
    moved_ours = {n: ours.weights[n] - theta[n] for n in theta}
    return {
        "step": step,
        "redraws_v": step % args.interval == 0,
        "g_peer": peer.g,
        "g_distzo": ours.g,
        "g_diff": abs(peer.g - ours.g),
        "peer_z_vs_distzo_z": max(float((peer.z[n] - ours.z[n]).abs().max()) for n in theta),
        "weights_diff": max(float((peer.weights[n] - ours.weights[n]).abs().max()) for n in theta),
        "peer_moved_along_measured": -cosine(moved, peer.z) * (1 if peer.g >= 0 else -1),
        "distzo_moved_along_measured": -cosine(moved_ours, ours.z) * (1 if ours.g >= 0 else -1),
    }


def _momentum_options(args: argparse.Namespace) -> dict[str, Any]:
    """distzo's LOZO-M with ``--momentum``, else its plain LOZO step."""
    if not args.momentum:
        return {}
    return dict(optimizer="momentum", optimizer_state="lowrank", beta1=args.beta1)


def own_draws(args: argparse.Namespace) -> dict[str, Any]:
    """The peer alone, drawing from torch's generator as it does in its runs: does each
    step move along the direction it measured?"""
    import numpy

    found = peer_file(args.lozo)
    torch.manual_seed(args.seed)
    model = model_from_config(tiny_opt_config(**MODEL), dtype=torch.float64)
    trainer = PeerTrainer(args, peer_methods(found.read_text(), torch, numpy))
    numpy.random.seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    steps = []
    for step in range(args.steps):
        ids = torch.randint(3, model.config.vocab_size, (4, 12), generator=gen)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        theta = {n: p.detach().clone() for n, p in model.named_parameters()}
        with measured_direction(trainer, model) as z:
            trainer.lowrank_zo_step(model, batch)
        trainer.lowrank_zo_update()
        moved = {n: p.detach() - theta[n] for n, p in model.named_parameters()}
        g = float(trainer.projected_grad)
        steps.append(
            {
                "step": step,
                "redraws_v": step % args.interval == 0,
                "g_peer": g,
                "peer_moved_along_measured": -cosine(moved, z) * (1 if g >= 0 else -1),
            }
        )
    return {"peer_file": str(found), "peer_commit": peer_commit(found), "steps": steps}


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


def table(report: dict[str, Any]) -> str:
    if "g_distzo" not in report["steps"][0]:
        rows = ["| step | V redrawn | g peer | peer moved along z |", "|---|---|---|---|"]
        for s in report["steps"]:
            redrawn = "yes" if s["redraws_v"] else "no"
            rows.append(
                f"| {s['step']} | {redrawn} | {s['g_peer']:.6f} | "
                f"{s['peer_moved_along_measured']:.4f} |"
            )
        return "\n".join(rows)
    rows = [
        "| step | V redrawn | g peer | g distzo | max weight diff | peer moved along z | "
        "distzo moved along z |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in report["steps"]:
        rows.append(
            f"| {s['step']} | {'yes' if s['redraws_v'] else 'no'} | {s['g_peer']:.6f} | "
            f"{s['g_distzo']:.6f} | {s['weights_diff']:.2e} | "
            f"{s['peer_moved_along_measured']:.4f} | {s['distzo_moved_along_measured']:.4f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    report = own_draws(args) if args.peer_draws else compare(args)
    print(table(report))
    print(f"peer {report['peer_file']} (commit {report['peer_commit']})")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
