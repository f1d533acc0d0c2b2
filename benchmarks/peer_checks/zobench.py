"""ZO-Bench's momentum and Adam steps (``--zobench``): a checkout of OPTML-Group/ZO-LLM
(its ``zo-bench/trainer.py``) or that file.

Its ``zo_step`` (``zo_step_v1`` with ``--zobench-queries`` above 1, as its training loop
picks) hands ``g z`` to a torch optimizer as ``p.grad``; the statement of its
``_inner_training_loop`` that builds that optimizer (``SGD(lr, momentum)`` for ``zo_sgd``,
``Adam(lr)`` for ``zo_adam``) is compiled from the file and run as written, with its
sweeps' settings (momentum 0.9, weight decay 0, constant lr). Three runs: ``zo_sgd`` beside
distzo's momentum stored and recomputed (a window longer than the run), ``zo_adam`` beside
distzo's Adam. ``--adam-eps`` sets both sides' eps (torch's default 1e-8): torch's Adam
adds it to ``sqrt(v / (1 - beta2^t))``, distzo's to ``sqrt(v)``, which the check reports as
a difference; at 1e-30 only the algorithm is left.
"""

from __future__ import annotations

import argparse
import ast
import functools
import logging
from pathlib import Path
from typing import Any

import torch

from distzo import ZOConfig, ZOEngine

from .harness import (
    PEER_METHODS,
    DistzoNoise,
    StepSeeds,
    agrees,
    batch_of,
    engine_z,
    largest,
    peer_methods,
    peer_trainer,
    tiny_model,
    trainer_class,
    verdict_line,
)

# ZO-Bench (OPTML-Group/ZO-LLM): its zo_step hands ``g z`` to the torch optimizer that its
# ``_inner_training_loop`` builds (``if args.trainer == "zo_adam": ...``), one parameter
# at a time. Each run: (label, ZO-Bench's --trainer, distzo's optimizer options).
ZOBENCH_METHODS = (*PEER_METHODS, "zo_step_v1", "get_grad_sparsity_by_name")  # v1: q > 1
ZOBENCH_SETUP = "zo_adam"  # the trainer name the optimizer set-up statement first tests


def zobench_runs(args: argparse.Namespace) -> list[tuple[str, str, dict[str, Any]]]:
    """ZO-Bench's momentum (zo_sgd with its sweeps' momentum) against distzo's stored and
    recomputed momentum (a window longer than the run: no truncation), and zo_adam
    against distzo's Adam."""
    momentum = dict(optimizer="momentum", beta1=args.momentum)
    return [
        ("zobench-momentum (stored)", "zo_sgd", {**momentum, "optimizer_state": "stored"}),
        (
            "zobench-momentum (recomputed)",
            "zo_sgd",
            {**momentum, "optimizer_state": "recomputed", "momentum_window": args.steps + 1},
        ),
        ("zobench-adam", "zo_adam", dict(optimizer="adam", adam_eps=args.adam_eps)),
    ]


def zobench_setup(source: Path) -> ast.Module:
    """The statement of ZO-Bench's ``_inner_training_loop`` that builds its optimizer
    (``if args.trainer == "zo_adam": self.optimizer = Adam(...)``, ``elif ... SGD``)."""
    node, defs = trainer_class(source)
    loop = defs.get("_inner_training_loop")
    for statement in ast.walk(loop) if loop else ():
        if isinstance(statement, ast.If) and ZOBENCH_SETUP in ast.unparse(statement.test):
            return ast.Module(body=[statement], type_ignores=[])
    raise SystemExit(
        f"{source}: class {node.name} builds no optimizer for {ZOBENCH_SETUP} in "
        f"_inner_training_loop; is it ZO-Bench's zo-bench/trainer.py?"
    )


def zobench_trainer(
    source: Path,
    args: argparse.Namespace,
    name: str,
    model: torch.nn.Module,
    noise: DistzoNoise,
    seeds: StepSeeds,
) -> Any:
    """ZO-Bench's trainer as far as its ZO step reaches: its methods and its optimizer
    set-up run as written on ``model`` (``Adam``'s eps is ``--adam-eps``, torch's default
    unless given), with its sweeps' arguments."""
    namespace = {"torch": noise, "np": seeds, "logger": logging.getLogger("zobench")}
    trainer = peer_trainer(peer_methods(source, namespace, ZOBENCH_METHODS), args, 1)
    trainer.args.__dict__.update(
        trainer=name,
        q=args.zobench_queries,
        perturbation_mode="two_side",
        momentum=args.momentum,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        optimizer="sgd",
    )
    trainer.model, trainer.gradient_sparsity = model, None
    trainer.sparse_grad_rng, trainer.sparse_grad_random_seed = torch.Generator(), 0
    optimizers = {
        "args": trainer.args,
        "self": trainer,
        "SGD": torch.optim.SGD,
        "Adam": functools.partial(torch.optim.Adam, eps=args.adam_eps),
    }
    exec(compile(zobench_setup(source), str(source), "exec"), optimizers)
    return trainer


def compare_zobench_run(
    source: Path, args: argparse.Namespace, label: str, name: str, options: dict[str, Any]
) -> bool:
    """``args.steps`` steps of ZO-Bench's ``name`` trainer and of a ``ZOEngine`` with
    ``options``, weight decay 0 (ZO-Bench's optimizers take none, whatever its
    --weight_decay), constant lr; print each; True if all agree. With q queries ZO-Bench
    steps by ``zo_step_v1``, as its training loop does, and keeps the last query's g and
    ``L+``, which are compared with distzo's last."""
    q = args.zobench_queries
    config = ZOConfig(
        eps=args.eps, lr=args.lr, seed=args.seed, device="cpu", num_queries=q, **options
    )
    engine = ZOEngine(tiny_model(args.family, args.seed), config)
    model = tiny_model(args.family, args.seed)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    seeds, noise = StepSeeds(), DistzoNoise(engine_z(engine), names, float32_losses=False)
    trainer = zobench_trainer(source, args, name, model, noise, seeds)
    zo_step = trainer.zo_step if q == 1 else trainer.zo_step_v1
    print(f"{label} ({source}): {args.family}, {len(names)} tensors, q = {q}, {options}")
    print("step  loss distzo / ZO-Bench    |g|        d(g)       |step| max  d(theta) max")
    agree = True
    for t in range(args.steps):
        batch = batch_of(t)
        before = engine.named_parameters()
        seeds.start(t)
        peer_loss = float(zo_step(model, batch))
        trainer.zo_update(model)
        result = engine.step(batch)
        after = engine.named_parameters()
        loss = result.losses[-2]  # the last query's L+ (SPSA's losses: L+_j, L-_j, ...)
        g = largest([torch.tensor(result.projected_grads)])
        dg = abs(result.projected_grads[-1] - trainer.projected_grad)
        step = largest([after[n] - before[n] for n in names])
        dtheta = largest([after[n] - p.detach() for n, p in model.named_parameters()])
        print(
            f"{t:>4}  {loss:.10f} / {peer_loss:.10f}  {g:9.3e}  {dg:9.3e}  "
            f"{step:10.3e}  {dtheta:10.3e}"
        )
        weights = (step, dtheta, largest([p.detach() for p in model.parameters()]))
        losses = (*result.losses, result.loss_plus, result.loss_minus)
        agree &= agrees(args.rtol, t, loss, peer_loss, (g, dg), weights, losses)
    print(verdict_line(label, agree, args.rtol))
    return agree


def compare_zobench(source: Path, args: argparse.Namespace) -> bool:
    """Each of ``zobench_runs``; True if all agree."""
    return all([compare_zobench_run(source, args, *run) for run in zobench_runs(args)])
