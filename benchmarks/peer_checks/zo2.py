"""ZO2's steps (``--zo2``): a checkout of liangyuwang/zo2, the peer of
``benchmarks/peers.py``'s race, both its modes against a resident and an offloaded
``ZOEngine``.

Its classes ``BaseOptimizer``, ``MeZOSGDConfig``, ``MeZOSGD`` (its ``zo2=False`` step) and
``MeZO2SGD`` (its ``zo2=True`` offload) are compiled from its files, built by their own
constructors and run as written, in this interpreter (their package, which needs
transformers 4.51, is never imported), on an untied tiny float64 OPT (``--family qwen3``:
a Qwen3; ``--zo2-tied``: its head tied to the embeddings, as small Qwen3s) in eval mode,
as the race's models and ZO2's ``zo_train()``. What ZO2's model classes add is stood in:
the loss (the next-token cross-entropy of the head's logits) and, for the offload, the
walk through its units (``zo2_units``). A step that differs names the tensors whose
weights differ most. Its ``torch.normal`` draws follow a stand-in generator whose state
(``torch.cuda``'s get/set_rng_state) is the seed and the count drawn, so the offload's
replay of the previous step's z for its update is ZO2's own. The offload applies a step's
update in the next step's pass, so its weights are compared with distzo's one step
earlier.
"""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import functools
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from distzo import ZOConfig, ZOEngine

from .harness import (
    ROUNDING_ULPS,
    SEED_STRIDE,
    StepSeeds,
    agrees,
    batch_of,
    engine_z,
    largest,
    next_token_loss,
    next_token_loss_of,
    tiny_model,
    verdict_line,
)
from .zo2_units import ZO2_QWEN3_MODEL, DualUnit, split_rows, zo2_units, zo2_walk

# ZO2 (liangyuwang/zo2): the classes its step is made of, by file in a checkout
ZO2_CLASSES = (
    ("zo2/optimizer/base.py", "BaseOptimizer"),
    ("zo2/config/mezo_sgd.py", "MeZOSGDConfig"),
    ("zo2/optimizer/mezo_sgd/zo.py", "MeZOSGD"),
    ("zo2/optimizer/mezo_sgd/zo2.py", "MeZO2SGD"),
)


def zo2_checkout(checkout: Path, family: str) -> Path:
    """``checkout`` if it holds ZO2's optimizer files (and the family's model file that
    the check reads), else a one-line refusal before any run."""
    model_files = [(ZO2_QWEN3_MODEL, "")] if family == "qwen3" else []
    for relative, _ in [*ZO2_CLASSES, *model_files]:
        if not (checkout / relative).is_file():
            raise SystemExit(
                f"--zo2 {checkout}: no {relative} there; give a clone of liangyuwang/zo2"
            )
    return checkout


def zo2_classes(checkout: Path, namespace: dict[str, Any]) -> dict[str, type]:
    """ZO2's optimizer classes compiled from its own files with ``namespace`` as their
    globals (their imports never run: ZO2's package needs transformers 4.51)."""
    for relative, name in ZO2_CLASSES:
        source = checkout / relative
        tree = ast.parse(source.read_text(), filename=str(source))
        found: list[ast.stmt] = [
            n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name
        ]
        if not found:
            raise SystemExit(f"{source}: no class {name}; is it ZO2's?")
        module = ast.Module(body=found, type_ignores=[])  # annotations evaluated, as ZO2's
        exec(compile(module, str(source), "exec", dont_inherit=True), namespace)
    return {name: namespace[name] for _, name in ZO2_CLASSES}


@dataclasses.dataclass
class RngState:
    """A generator's state: the seed and how many tensors were drawn since it was set."""

    seed: int
    drawn: int = 0

    def clone(self) -> RngState:
        return RngState(self.seed, self.drawn)


class RngStream:
    """Stands in for ZO2's ``torch``: the generator seeded with (step t, draw j) yields
    distzo's z of (t, j) for the trained parameters in ``walk``'s order, the order in
    which ZO2 draws them; ``torch.cuda``'s get/set_rng_state save and rewind it, as ZO2's
    offload does to replay a step's z for the next step's update. A tensor drawn again
    under another name (a head tied to the embeddings, a unit of its own in ZO2's offload)
    gets a z independent of its first, as from ZO2's generator: distzo has no such z."""

    def __init__(self, z_of: Callable[[int, int], dict[str, torch.Tensor]]):
        self.z_of, self.walk = functools.cache(z_of), [""]
        self.again: set[int] = set()  # draws of a tensor the stream already drew (tied)
        self.state, self.seeds = RngState(0), StepSeeds()  # seeds: ZO2's ``np``
        self.cuda = types.SimpleNamespace(
            manual_seed=self.manual_seed,
            get_rng_state=lambda: self.state.clone(),
            set_rng_state=self.set_rng_state,
            synchronize=lambda: None,
            Stream=lambda: types.SimpleNamespace(synchronize=lambda: None),
        )

    def manual_seed(self, seed: int) -> None:
        self.state = RngState(int(seed))

    def set_rng_state(self, state: RngState) -> None:
        self.state = state.clone()

    def normal(self, mean: float, std: float, size: torch.Size, **where: Any) -> torch.Tensor:
        assert (mean, std) == (0, 1), (mean, std)
        if self.state.drawn >= len(self.walk):
            raise RuntimeError(f"ZO2 drew {self.state.drawn + 1} tensors of one seed's stream")
        name = self.walk[self.state.drawn]
        z = self.z_of(*divmod(self.state.seed, SEED_STRIDE))[name]
        if self.state.drawn in self.again:  # ZO2's generator gives it a z of its own
            seed = self.state.seed * SEED_STRIDE + self.state.drawn
            z = torch.randn(z.shape, generator=torch.Generator().manual_seed(seed), dtype=z.dtype)
        self.state.drawn += 1
        if tuple(size) != tuple(z.shape):
            raise RuntimeError(f"ZO2 drew {tuple(size)} for {name}, whose z is {tuple(z.shape)}")
        return z.to(where["dtype"])

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def zo2_optimizer(
    checkout: Path, model: torch.nn.Module, offload: bool, args: argparse.Namespace, noise: Any
) -> Any:
    """ZO2's MeZO-SGD (``zo2=False``) or its offload (``zo2=True``) on ``model``, built by
    its own constructors; only the loss (ZO2's OPT and Qwen3 models': the next-token
    cross-entropy of the head's logits) is stood in, with ZO2's model classes that wrap it."""
    namespace: dict[str, Any] = {
        "__name__": "zo2_peer",
        "torch": noise,
        "nn": torch.nn,
        "F": torch.nn.functional,
        "np": noise.seeds,
        "deque": collections.deque,
        "dataclass": dataclasses.dataclass,
        "Optimizer": torch.optim.Optimizer,
    }
    classes = zo2_classes(checkout, namespace)
    base = classes["MeZO2SGD" if offload else "MeZOSGD"]

    class OnTinyModel(base):  # type: ignore[valid-type, misc]
        rows = 0

        def init_zo2_upload(self) -> None:
            """Everything stays on the host, where this check runs."""

        def inner_zo_forward(self, batch: dict[str, torch.Tensor]) -> Any:
            if not offload:
                return next_token_loss(self.model, batch)
            self.rows = len(batch["input_ids"])
            doubled = {k: torch.cat([v, v]) for k, v in batch.items()}
            logits = self.model(  # no cache: the second pass of a layer would attend to the first's
                doubled["input_ids"], attention_mask=doubled["attention_mask"], use_cache=False
            )
            halves = split_rows(logits.logits, self.rows)
            return tuple(next_token_loss_of(h, batch["labels"]) for h in halves)

    config = classes["MeZOSGDConfig"](
        lr=args.lr, weight_decay=args.weight_decay, eps=args.eps, zo2=offload
    )
    config.working_device = "cpu"
    return OnTinyModel(model, config)


def compare_zo2(checkout: Path, offload: bool, args: argparse.Namespace) -> bool:
    """``args.steps`` steps of ZO2's MeZO-SGD (or its offload) and of distzo's engine, in
    each of its modes, from the same weights (a float64 OPT or Qwen3, untied as the race's
    unless ``--zo2-tied``), on the same batches and z; print each; True if all agree."""
    label = "zo2-offload" if offload else "zo2-mezo"
    family, tied = args.family, args.zo2_tied
    config = dict(eps=args.eps, lr=args.lr, weight_decay=args.weight_decay, seed=args.seed)
    engines = {
        mode: ZOEngine(
            tiny_model(family, args.seed, tied=tied), ZOConfig(mode=mode, device="cpu", **config)
        )
        for mode in ("resident", "offload")
    }
    model = tiny_model(family, args.seed, tied=tied).eval()  # as ZO2's zo_train() sets it
    noise = RngStream(engine_z(engines["resident"]))
    optimizer = zo2_optimizer(checkout, model, offload, args, noise)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    noise.walk = names
    if offload:
        units = zo2_units(checkout, family, model)
        noise.walk = zo2_walk(model, units)
        drawn = [id(model.get_parameter(name)) for name in noise.walk]
        noise.again = {i for i, tensor in enumerate(drawn) if tensor in drawn[:i]}
        for name, unit, decay in units:
            model.set_submodule(name, DualUnit(unit, optimizer, decay))
    agree = True
    model_is = f"{family}{', tied' if tied else ''}"
    print(f"{label} ({checkout}): {model_is}, {len(names)} tensors, wd = {args.weight_decay}")
    if offload:
        print("(ZO2 applies a step's update in the next step's pass: d(theta) is one step late)")
    print(
        "step  engine    loss distzo / ZO2          |g|        d(g)      |step| max  d(theta) max"
    )
    for t in range(args.steps):
        batch = batch_of(t)
        noise.seeds.start(t)
        peer_loss = float(optimizer.zo_forward(batch))
        peer_g = float(optimizer.projected_grad)
        theirs = {name: p.detach().clone() for name, p in params.items()}
        for mode, engine in engines.items():
            before = engine.named_parameters()
            result = engine.step(batch)
            after = engine.named_parameters()
            ours = before if offload else after  # ZO2's offload is one update behind
            moved = largest([after[n] - before[n] for n in names])
            dtheta = largest([ours[n] - theirs[n] for n in names])
            g, dg = abs(result.projected_grads[0]), abs(result.projected_grads[0] - peer_g)
            print(
                f"{t:>4}  {mode:<8}  {result.loss_plus:.10f} / {peer_loss:.10f}  {g:9.3e}  "
                f"{dg:9.3e}  {moved:10.3e}  {dtheta:10.3e}"
            )
            weights = (moved, dtheta, largest(list(theirs.values())))
            losses = (*result.losses, result.loss_plus, result.loss_minus)
            verdict = agrees(args.rtol, t, result.loss_plus, peer_loss, (g, dg), weights, losses)
            if not verdict:
                rounding = (t + 1) * ROUNDING_ULPS * torch.finfo(torch.float64).eps * weights[2]
                print(f"      differs most in: {most_apart(ours, theirs, names, rounding)}")
            agree &= verdict
    print(verdict_line(label, agree, args.rtol))
    return agree


def most_apart(
    ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], names: list[str], over: float
) -> str:
    """The tensors whose weights differ by more than ``over`` (their rounding), largest
    first: where a difference lives (a decay rule, a tied tensor) tells its cause."""
    apart = sorted(((largest([ours[n] - theirs[n]]), n) for n in names), reverse=True)
    apart = [(d, name) for d, name in apart if d > over]
    if not apart:
        return "no tensor yet (the loss and g differ)"
    more = f" and {len(apart) - 5} more" if len(apart) > 5 else ""
    return ", ".join(f"{name} {d:.1e}" for d, name in apart[:5]) + more
