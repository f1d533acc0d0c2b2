"""distzo's MeZO-SGD and FZOO steps against the peers' own code, on the same z.

    python benchmarks/peer_steps.py --mezo ../MeZO --fzoo ../FZOO [--steps 3] [--family llama]

``--mezo``: a checkout of princeton-nlp/MeZO (its ``large_models/trainer.py``) or that file;
``--fzoo``: a checkout of DKmiyan/FZOO (its ``trainer.py``) or that file. Nothing of theirs
is imported or vendored: the peer's ``zo_perturb_parameters``, ``zo_step``, ``zo_update``
and ``zo_forward`` are read from the file with ``ast`` and run as written, as methods of a
minimal trainer (the Hugging Face ``Trainer`` they need is not loaded), on a tiny float64
model built from its config. Their noise draws (``torch.normal``, ``torch.randint`` after
``torch.manual_seed``) return distzo's own z for that step, direction and parameter, so
each step of the peer and of a ``ZOEngine`` on the same weights, batch and loss must
agree: the script prints, per step, both losses, the largest difference of the update
coefficients (MeZO's ``projected_grad``; FZOO's ``projected_grad[j]``, which is distzo's
``c_j / N``) and of the weights after the step, each against the step's own length.

The verdict is relative: a peer step agrees when its loss, coefficients and weights are
within ``--rtol`` of distzo's, measured against the loss, the coefficients' and the step's
largest magnitude; the weights' also within float64's rounding of the weights themselves
(``ROUNDING_ULPS`` per step), which a small ``--lr``'s step falls below.

FZOO gathers its perturbed losses in float32 (``torch.tensor(loss1s,
dtype=torch.float32)``): the stand-in ``torch.tensor`` keeps them in float64 like the rest,
so that a difference is the algorithm's; ``--float32-losses`` keeps its rounding (on the
tiny OPT at eps 1e-3 it moves the coefficients by about 0.5 %: float32's 2^-24 of a
loss near 4 against differences of order 1e-4). The loss is the next-token
cross-entropy in float64 for both (a Hugging Face model's ``.loss`` casts the logits to
float32). Exit 0 when every step of every peer agrees, 1 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import logging
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig

from distzo import ZOConfig, ZOEngine
from distzo.engine import RESIDENT_BLOCK_ID
from distzo.models import model_from_config
from distzo.models.tiny import tiny_opt_config

PEER_METHODS = ("zo_perturb_parameters", "zo_step", "zo_update", "zo_forward")
# where each peer keeps its trainer in a checkout
TRAINER_FILES = {"mezo": "large_models/trainer.py", "fzoo": "trainer.py"}
SEED_STRIDE = 1000  # the seed the peer draws for (step t, its j-th draw) is t * 1000 + j
VOCAB = 64
# A float64 weight is known to its last place: each side rounds every weight at each
# in-place perturbation and at the update, so at the peers' own small learning rates
# (MeZO's 1e-6, 1e-7) those roundings, not the step, set the weights' difference, which
# rtol of the step called a difference (a faithful peer "DIFFERS" from --lr 1e-6 down).
# Measured on the stand-ins, OPT and Llama, lr 1e-5 to 1e-9: at most 4 units in the last
# place of the largest weight after 5 steps; allowed: 4 per step taken.
ROUNDING_ULPS = 4


def trainer_file(peer: str, path: Path) -> Path:
    """The peer's trainer: ``path`` itself, or its file in a checkout."""
    found = path / TRAINER_FILES[peer] if path.is_dir() else path
    if not found.is_file():
        raise SystemExit(
            f"--{peer} {path}: no {TRAINER_FILES[peer]} there; give a checkout of the "
            f"peer or its trainer file"
        )
    return found


def peer_methods(source: Path, namespace: dict[str, Any]) -> dict[str, Callable[..., Any]]:
    """The peer's ZO methods, compiled from its own source with ``namespace`` as their
    globals: the class that defines ``zo_step`` is searched for them."""
    tree = ast.parse(source.read_text(), filename=str(source))
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        defs = {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}
        if "zo_step" not in defs:
            continue
        missing = [name for name in PEER_METHODS if name not in defs]
        if missing:
            raise SystemExit(f"{source}: class {node.name} has no {', '.join(missing)}")
        module = ast.Module(body=[defs[name] for name in PEER_METHODS], type_ignores=[])
        exec(compile(module, str(source), "exec"), namespace)
        return {name: namespace[name] for name in PEER_METHODS}
    raise SystemExit(f"{source}: no class defines zo_step; is it the peer's trainer.py?")


class DistzoNoise:
    """Stands in for the peer's ``torch``: ``manual_seed(seed)`` selects the direction
    the seed names, and each ``normal`` / ``randint`` then returns distzo's z of the next
    trained parameter, in the order the peer walks them. Everything else is torch's."""

    def __init__(
        self,
        z_of: Callable[[int, int], dict[str, torch.Tensor]],
        names: list[str],
        float32_losses: bool,
    ):
        self.z_of, self.names, self.float32_losses = z_of, names, float32_losses
        self.queue: Iterator[torch.Tensor] = iter(())

    def tensor(self, data: Any, **options: Any) -> torch.Tensor:
        """FZOO gathers its losses with ``torch.tensor(..., dtype=torch.float32)``: in
        float64 unless ``float32_losses``, so that the check sees the algorithm."""
        if options.get("dtype") == torch.float32 and not self.float32_losses:
            options["dtype"] = torch.float64
        return torch.tensor(data, **options)

    def manual_seed(self, seed: int) -> None:
        step, query = divmod(int(seed), SEED_STRIDE)
        z = self.z_of(step, query)
        self.queue = iter([z[name] for name in self.names])

    def _next(self, size: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        z = next(self.queue)
        if tuple(size) != tuple(z.shape):
            raise RuntimeError(f"the peer drew {tuple(size)} where z is {tuple(z.shape)}")
        return z.to(dtype)

    def normal(self, mean: float, std: float, size: torch.Size, **where: Any) -> torch.Tensor:
        assert (mean, std) == (0, 1), (mean, std)
        return self._next(size, where["dtype"])

    def randint(self, low: int, high: int, size: torch.Size, **where: Any) -> torch.Tensor:
        assert (low, high) == (0, 2), (low, high)  # z = randint * 2 - 1: Rademacher
        return (self._next(size, where["dtype"]) + 1) / 2

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class StepSeeds:
    """Stands in for the peer's ``np``: ``np.random.randint`` gives the seeds that name
    (step, draw) for ``DistzoNoise``."""

    def __init__(self) -> None:
        self.step, self.draws = 0, 0
        self.random = types.SimpleNamespace(randint=self.randint)

    def randint(self, high: int) -> int:
        seed = self.step * SEED_STRIDE + self.draws
        self.draws += 1
        return seed

    def start(self, step: int) -> None:
        self.step, self.draws = step, 0


def tiny_model(family: str, seed: int) -> torch.nn.Module:
    """A float64 model of a few thousand parameters (GELU for OPT: a difference across
    ReLU's kink is not the derivative)."""
    torch.manual_seed(seed)
    if family == "opt":
        config: Any = tiny_opt_config(
            hidden_size=16,
            ffn_dim=32,
            num_attention_heads=2,
            word_embed_proj_dim=8,
            max_position_embeddings=16,
            activation_function="gelu",
        )
    else:
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_hidden_layers=2,
            max_position_embeddings=16,
            pad_token_id=0,
        )
    return model_from_config(config, dtype=torch.float64)


def batch_of(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (4, 12), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def engine_z(engine: ZOEngine) -> Callable[[int, int], dict[str, torch.Tensor]]:
    """z of (step, query) for every trained parameter by name, from the engine's seeds."""
    layouts = [(engine.resident_layout, RESIDENT_BLOCK_ID)] + [
        (layout, i + 1) for i, layout in enumerate(engine.block_layouts)
    ]

    def z_of(step: int, query: int) -> dict[str, torch.Tensor]:
        out = {}
        for layout, block in layouts:
            flat = engine.noise.full(layout.numel, step=step, block_id=block, query=query)
            for entry in layout.entries:
                for name in entry.names:
                    out[name] = flat[entry.offset : entry.offset + entry.numel].view(entry.shape)
        return out

    return z_of


def peer_trainer(methods: dict[str, Callable[..., Any]], args: argparse.Namespace, n: int) -> Any:
    """The least of a Hugging Face ``Trainer`` the peer's methods touch, constant lr."""
    trainer = types.SimpleNamespace(
        args=types.SimpleNamespace(
            zo_eps=args.eps,
            weight_decay=args.weight_decay,
            gradient_accumulation_steps=1,
            non_diff=False,
            n_gpu=1,
            N=n,
        ),
        N=n,
        losses=None,
        current_lr=args.lr,
        lr_scheduler=types.SimpleNamespace(step=lambda: None),
    )
    trainer._get_learning_rate = lambda: args.lr
    trainer._prepare_inputs = lambda inputs: inputs
    trainer.compute_loss_context_manager = contextlib.nullcontext
    trainer.compute_loss = next_token_loss
    for name, method in methods.items():
        setattr(trainer, name, types.MethodType(method, trainer))
    return trainer


def next_token_loss(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The causal-LM loss in the model's dtype, as distzo's objective takes it (the
    ``.loss`` of a Hugging Face model casts the logits to float32 first)."""
    logits = model(inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    labels = inputs["labels"][:, 1:].reshape(-1)
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(labels.numel(), -1), labels, ignore_index=-100
    )


def largest(values: list[torch.Tensor]) -> float:
    return max(float(v.abs().max()) for v in values)


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
        rounding = (t + 1) * ROUNDING_ULPS * torch.finfo(torch.float64).eps * largest(weights)
        agree &= dc <= args.rtol * c and dtheta <= args.rtol * step + rounding
        agree &= abs(loss - peer_loss) <= args.rtol * abs(loss)
    print(f"{peer}: {'agrees with' if agree else 'DIFFERS from'} distzo (rtol {args.rtol})")
    return agree


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mezo", type=Path, help="a MeZO checkout or its large_models/trainer.py")
    p.add_argument("--fzoo", type=Path, help="an FZOO checkout or its trainer.py")
    p.add_argument("--family", choices=("opt", "llama"), default="opt")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--queries", type=int, default=8, help="FZOO's N (its fzoo.sh's 8)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eps", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1, help="MeZO's; FZOO has none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rtol", type=float, default=1e-9)
    p.add_argument(
        "--float32-losses",
        action="store_true",
        help="keep FZOO's float32 loss vector (its rounding, not its algorithm)",
    )
    args = p.parse_args(argv)
    if args.mezo is None and args.fzoo is None:
        p.error("give --mezo PATH, --fzoo PATH or both: the peers' checkouts")
    peers = [(name, getattr(args, name)) for name in ("mezo", "fzoo") if getattr(args, name)]
    sources = [(name, trainer_file(name, path)) for name, path in peers]
    results = [compare(name, source, args) for name, source in sources]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
