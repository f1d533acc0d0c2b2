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

Their draws are distzo's: the ``torch`` those methods see reads a flat stream standing for
torch's generator, which holds, in the order the peer's perturbation walks its parameters,
distzo's V (on a step where the peer redraws V), U of each matrix and the z of each 1-D
tensor, all from distzo's ``LowRankNoise`` of that step. The peer's side (its methods, the
minimal trainer, the stream) is ``benchmarks/peer_checks/lozo.py``; this script is the
command, distzo's side and the comparison.

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
import hashlib
import json
import sys
import types
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import OPTConfig

from distzo import ZOConfig, ZOEngine
from distzo.engine import RESIDENT_BLOCK_ID
from distzo.models import model_from_config
from distzo.models.tiny import tiny_opt_config
from distzo.zo.lowrank import LowRankNoise

# Run as a script, Python puts benchmarks/ first on the path: the peer's side is imported
# from the repository's root, as the package benchmarks.peer_checks that mypy and the tests see.
REPOSITORY = str(Path(__file__).resolve().parents[1])
if REPOSITORY not in sys.path:
    sys.path.append(REPOSITORY)

from benchmarks.peer_checks.lozo import (  # noqa: E402
    MOMENTUM_METHODS,
    PEER_METHODS,
    PeerTrainer,
    StreamTorch,
    measured_direction,
    peer_commit,
    peer_file,
    peer_methods,
    peer_step,
    peer_stream,
)

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


def cosine(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    x = torch.cat([a[k].reshape(-1) for k in sorted(a)])
    y = torch.cat([b[k].reshape(-1) for k in sorted(a)])
    return float(x @ y / (x.norm() * y.norm()))


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
