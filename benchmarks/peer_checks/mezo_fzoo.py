"""MeZO's and FZOO's steps (``--mezo``, ``--fzoo``): their trainers' ``zo_step`` and
``zo_update`` beside a ``ZOEngine`` with the same estimator, noise and queries.

MeZO's update coefficient is its ``projected_grad``; FZOO's ``projected_grad[j]`` is
distzo's ``c_j / N``. FZOO gathers its perturbed losses in float32 (``torch.tensor(loss1s,
dtype=torch.float32)``): the stand-in ``torch.tensor`` keeps them in float64 like the rest,
so that a difference is the algorithm's; ``--float32-losses`` keeps its rounding (on the
tiny OPT at eps 1e-3 it moves the coefficients by about 0.5 %: float32's 2^-24 of a loss
near 4 against differences of order 1e-4).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from distzo import ZOConfig, ZOEngine

from .harness import (
    DistzoNoise,
    StepSeeds,
    agrees,
    batch_of,
    engine_z,
    largest,
    peer_methods,
    peer_trainer,
    tiny_model,
    verdict_line,
)


def compare(peer: str, source: Path, args: argparse.Namespace) -> bool:
    """Run ``args.steps`` steps of the peer and of distzo; print each; True if all agree."""
    fzoo = peer == "fzoo"
    n = args.queries if fzoo else 1
    wd = 0.0 if fzoo else args.weight_decay  # FZOO's update has no decay
    config = ZOConfig(
        estimator="fzoo" if fzoo else "spsa",
        noise="rademacher" if fzoo else "gaussian",
        num_queries=n,
        eps=args.eps,
        lr=args.lr,
        weight_decay=wd,
        seed=args.seed,
        device="cpu",
    )
    engine = ZOEngine(tiny_model(args.family, args.seed), config)
    model = tiny_model(args.family, args.seed)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    seeds = StepSeeds()
    noise = DistzoNoise(engine_z(engine), names, args.float32_losses)
    namespace = {"torch": noise, "np": seeds}
    namespace["logger"] = logging.getLogger(peer)
    trainer = peer_trainer(peer_methods(source, namespace), args, n)
    agree = True
    print(f"{peer} ({source}): {args.family}, {len(names)} tensors, N = {n}, wd = {wd}")
    print("step  loss distzo / peer        |c| max   d(c) max   |step| max  d(theta) max")
    for t in range(args.steps):
        batch = batch_of(t)
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        seeds.start(t)
        peer_loss = float(trainer.zo_step(model, batch))
        trainer.zo_update(model)
        result = engine.step(batch)
        ours = torch.tensor(result.projected_grads, dtype=torch.float64) / n
        theirs = torch.as_tensor(trainer.projected_grad, dtype=torch.float64).reshape(-1)
        after = engine.named_parameters()
        moved = [after[name] - before[name] for name in names]
        weights = [p.detach() for _, p in model.named_parameters()]
        off = [after[name] - p.detach() for name, p in model.named_parameters()]
        loss = result.loss if fzoo else result.loss_plus  # what each peer's zo_step returns
        c, dc = largest([ours]), largest([ours - theirs])
        step, dtheta = largest(moved), largest(off)
        print(
            f"{t:>4}  {loss:.10f} / {peer_loss:.10f}  {c:9.3e}  {dc:9.3e}  {step:10.3e}  "
            f"{dtheta:10.3e}"
        )
        losses = (*result.losses, result.loss_plus, result.loss_minus)
        weight_figures = (step, dtheta, largest(weights))
        agree &= agrees(args.rtol, t, loss, peer_loss, (c, dc), weight_figures, losses)
    print(verdict_line(peer, agree, args.rtol))
    return agree
