"""What every peer step check runs on: the peer's code read from its own file, a tiny
float64 model, the batches, distzo's z served to the peer's draws, and the verdict.

Nothing of a peer is imported or vendored: its methods are read from the file with ``ast``
and run as written, as methods of a minimal trainer (``peer_trainer``; the Hugging Face
``Trainer`` they need is not loaded). Their noise draws (``torch.normal``,
``torch.randint`` after ``torch.manual_seed``) return distzo's own z for that step,
direction and parameter (``DistzoNoise``, seeded by ``StepSeeds``), so each step of the
peer and of a ``ZOEngine`` on the same weights, batch and loss must agree (``agrees``).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, Qwen3Config

from distzo import ZOEngine
from distzo.engine import RESIDENT_BLOCK_ID
from distzo.models import model_from_config
from distzo.models.tiny import tiny_opt_config

PEER_METHODS = ("zo_perturb_parameters", "zo_step", "zo_update", "zo_forward")
# where each peer keeps its trainer in a checkout
TRAINER_FILES = {
    "mezo": "large_models/trainer.py",
    "fzoo": "trainer.py",
    "zobench": "zo-bench/trainer.py",
}
SEED_STRIDE = 1000  # the seed the peer draws for (step t, its j-th draw) is t * 1000 + j
VOCAB = 64
# A float64 weight is known to its last place: each side rounds every weight at each
# in-place perturbation and at the update, so at the peers' own small learning rates
# (MeZO's 1e-6, 1e-7) those roundings, not the step, set the weights' difference, which
# rtol of the step called a difference (a faithful peer "DIFFERS" from --lr 1e-6 down).
# Measured on the stand-ins, OPT and Llama, lr 1e-5 to 1e-9: at most 4 units in the last
# place of the largest weight after 5 steps; allowed: 4 per step taken.
# A coefficient is a difference of losses over a small length (MeZO's 2 eps, FZOO's N times
# the losses' spread): each loss known to its last place, a coefficient to that place over
# the length, which at --eps 1e-5 is 4e-11 of MeZO's g, past rtol's 1e-9 of a g near 0.02.
ROUNDING_ULPS = 4


def agrees(
    rtol: float,
    t: int,
    loss: float,
    peer_loss: float,
    coefficients: tuple[float, float],
    weights: tuple[float, float, float],
    losses: tuple[float, ...],
) -> bool:
    """Step ``t``'s verdict: within ``rtol`` of distzo's loss, coefficients and step, or
    within float64's rounding of what each is computed from (``ROUNDING_ULPS``).
    ``coefficients`` are (largest, difference), ``weights`` (this step's move, the weights'
    difference, the largest weight), ``losses`` the step's (their spread over a coefficient
    is the length it divides by)."""
    ulp = torch.finfo(torch.float64).eps
    (c, dc), (step, dtheta, largest_weight) = coefficients, weights
    spread = max(losses) - min(losses)
    # each loss known to its last place, and to the weights' difference so far (which the
    # loss's own shows)
    loss_error = ROUNDING_ULPS * ulp * max(map(abs, losses)) + abs(loss - peer_loss)
    c_rounding = loss_error * c / spread if spread else 0.0
    relative = rtol + (c_rounding / c if c else 0.0)  # a step carries its coefficient's
    w_rounding = (t + 1) * ROUNDING_ULPS * ulp * largest_weight
    return (
        dc <= rtol * c + c_rounding
        and dtheta <= relative * step + w_rounding
        and abs(loss - peer_loss) <= rtol * abs(loss)
    )


def verdict_line(label: str, agree: bool, rtol: float) -> str:
    """The last line of a peer's check, the one a reader (and a test) looks for."""
    return f"{label}: {'agrees with' if agree else 'DIFFERS from'} distzo (rtol {rtol})"


def trainer_file(peer: str, path: Path) -> Path:
    """The peer's trainer: ``path`` itself, or its file in a checkout."""
    found = path / TRAINER_FILES[peer] if path.is_dir() else path
    if not found.is_file():
        raise SystemExit(
            f"--{peer} {path}: no {TRAINER_FILES[peer]} there; give a checkout of the "
            f"peer or its trainer file"
        )
    return found


def trainer_class(source: Path) -> tuple[ast.ClassDef, dict[str, ast.FunctionDef]]:
    """The class of the peer's trainer (the one that defines ``zo_step``) and its methods."""
    tree = ast.parse(source.read_text(), filename=str(source))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            defs = {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}
            if "zo_step" in defs:
                return node, defs
    raise SystemExit(f"{source}: no class defines zo_step; is it the peer's trainer.py?")


def peer_methods(
    source: Path, namespace: dict[str, Any], names: tuple[str, ...] = PEER_METHODS
) -> dict[str, Callable[..., Any]]:
    """The peer's ZO methods ``names``, compiled from its own source with ``namespace`` as
    their globals: the class that defines ``zo_step`` is searched for them."""
    node, defs = trainer_class(source)
    missing = [name for name in names if name not in defs]
    if missing:
        raise SystemExit(f"{source}: class {node.name} has no {', '.join(missing)}")
    module = ast.Module(body=[defs[name] for name in names], type_ignores=[])
    exec(compile(module, str(source), "exec"), namespace)
    return {name: namespace[name] for name in names}


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


def tiny_model(family: str, seed: int, tied: bool = True) -> torch.nn.Module:
    """A float64 model of a few thousand parameters (GELU for OPT: a difference across
    ReLU's kink is not the derivative). ``tied=False``: OPT's or Qwen3's head is its own
    matrix, as in the race's models (Llama's always is); Qwen3 has ``q_norm``/``k_norm``."""
    torch.manual_seed(seed)
    if family == "opt":
        config: Any = tiny_opt_config(
            hidden_size=16,
            ffn_dim=32,
            num_attention_heads=2,
            word_embed_proj_dim=8,
            max_position_embeddings=16,
            activation_function="gelu",
            tie_word_embeddings=tied,
        )
    else:
        family_config = Qwen3Config if family == "qwen3" else LlamaConfig
        config = family_config(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            num_hidden_layers=2,
            max_position_embeddings=16,
            pad_token_id=0,
            tie_word_embeddings=tied and family == "qwen3",
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
    return next_token_loss_of(logits, inputs["labels"])


def next_token_loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    labels = labels[:, 1:].reshape(-1)
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(labels.numel(), -1), labels, ignore_index=-100
    )


def largest(values: list[torch.Tensor]) -> float:
    return max(float(v.abs().max()) for v in values)
