"""MeZO's RoBERTa LoRA (``--mezo-medium PATH --peft lora``): its ``medium_models`` run
with ``--apply_lora --lora_r 8 --lora_alpha 16`` (its README's "MeZO (LoRA)" command)
beside distzo's ``--peft lora`` on the same tiny RoBERTa, steps as ``mezo_medium``'s.

What runs as written, from the checkout: the layers ``src/modeling_roberta.py``'s
``RobertaSelfAttention`` builds as ``lora.Linear(...)`` (the call itself, on loralib, which
MeZO imports: ``pip install loralib``), with the base's weight and bias loaded into them;
``run.py``'s rule of what trains under ``--apply_lora`` (the ``if model_args.apply_lora:``
that calls ``requires_grad_(False)``); the trainer's ZO branch and the prompt model, as
``mezo_medium`` runs them. ``A`` is drawn by each side (Kaiming-uniform, a = sqrt(5)), then
both start from distzo's; ``B`` is zero on both, the scaling alpha / r on both.

Differences by design, measured by this check (``--medium-lora-as mezo``, the default):

* run.py freezes only the ``roberta.*`` tensors that are not LoRA's: the prompt model's
  ``lm_head`` (its dense layer, LayerNorm, the untied decoder and bias) trains beside the
  adapters, with its own z. distzo's ``--peft lora`` trains the adapters alone.
* loralib's ``Linear`` merges ``B A`` into its weight when put in eval mode
  (``merge_weights=True``, its default, which MeZO keeps) and from then on computes with
  the merged weight alone. ``from_pretrained`` returns the model in eval mode and MeZO's
  ``zo_forward`` calls ``model.eval()`` at every forward, and nothing in its ZO loop calls
  ``model.train()``: the adapters are merged at init (``B`` = 0: no change) and their
  perturbations and updates never reach a loss. Its projected gradient is the head's;
  the adapters walk along it without moving the model. The check prints the change of
  MeZO's loss when its adapters move by ``eps z``, as its forward runs them (0) and
  unmerged.

``--medium-lora-as peft`` runs MeZO's code with the head frozen and loralib's merge off
(``merge_weights = False`` on each layer, as peft's LoRA computes ``W x + s B A x`` at
every forward): all the rest (which projections, r, alpha, init, the step) compares.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import math
import types
from pathlib import Path
from typing import Any

import torch

from distzo import ZOConfig, ZOEngine
from distzo.objectives import Classification

from .harness import largest, verdict_line
from .mezo_medium import (
    medium_checkout,
    medium_steps,
    mezo_inputs,
    prompt_batch,
    prompt_model_class,
    tiny_roberta,
)

MODELING = "medium_models/src/modeling_roberta.py"
RUN = "medium_models/run.py"
ATTENTION_CLASS = "RobertaSelfAttention"
LORA_R, LORA_ALPHA = 8, 16  # MeZO's README: --apply_lora --lora_r 8 --lora_alpha 16
LORA_SUFFIX = (".lora_A", ".lora_B")


def lora_checkout(path: Path) -> tuple[Path, Path]:
    """MeZO's medium modeling_roberta.py and run.py in the checkout ``path``."""
    files = (path / MODELING, path / RUN)
    missing = [str(f.relative_to(path)) for f in files if not f.is_file()]
    if missing:
        raise SystemExit(
            f"--mezo-medium {path} --peft lora: no {', '.join(missing)} there; "
            "give a checkout of MeZO"
        )
    return files


def loralib() -> Any:
    """loralib, the LoRA layers MeZO's modeling_roberta.py builds (``import loralib as lora``)."""
    try:
        return importlib.import_module("loralib")
    except ImportError:
        raise SystemExit(
            "--mezo-medium --peft lora runs MeZO's LoRA layers, loralib's Linear (its "
            "modeling_roberta.py imports loralib): pip install loralib"
        ) from None


def lora_layer_calls(source: Path) -> dict[str, ast.Call]:
    """The ``self.<name> = lora.Linear(...)`` calls of MeZO's ``RobertaSelfAttention``, by
    the projection they build (``query``, ``value``)."""
    tree = ast.parse(source.read_text(), filename=str(source))
    calls = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == ATTENTION_CLASS:
            for assign in ast.walk(node):
                if (
                    isinstance(assign, ast.Assign)
                    and isinstance(assign.value, ast.Call)
                    and ast.unparse(assign.value.func) == "lora.Linear"
                ):
                    target = assign.targets[0]
                    if isinstance(target, ast.Attribute):
                        calls[target.attr] = assign.value
    if not calls:
        raise SystemExit(f"{source}: {ATTENTION_CLASS} builds no lora.Linear; is it MeZO's?")
    return calls


def freezing_rule(source: Path) -> Any:
    """run.py's ``if model_args.apply_lora:`` that freezes what LoRA does not train, as a
    function of ``model`` and ``model_args``."""
    tree = ast.parse(source.read_text(), filename=str(source))
    rules = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.If)
        and ast.unparse(node.test) == "model_args.apply_lora"
        and "requires_grad_(False)" in ast.unparse(node)
    ]
    if len(rules) != 1:
        raise SystemExit(f"{source}: no single `if model_args.apply_lora:` freezing the model")
    function = ast.parse("def freeze(model, model_args):\n    pass\n").body[0]
    assert isinstance(function, ast.FunctionDef)
    function.body = rules[0].body
    namespace: dict[str, Any] = {}
    module = ast.Module(body=[ast.fix_missing_locations(function)], type_ignores=[])
    exec(compile(module, str(source), "exec"), namespace)
    return namespace["freeze"]


def mezo_lora_model(checkout: Path, seed: int, as_peft: bool) -> Any:
    """MeZO's prompt model of the tiny RoBERTa, its attention's LoRA layers built by
    MeZO's own calls and loaded with the base's weights (as ``from_pretrained``), run.py's
    rule applied; left in eval mode, as ``from_pretrained`` leaves it. ``as_peft``: the head
    frozen and loralib's merge off."""
    modeling, run = lora_checkout(checkout)
    calls, freeze = lora_layer_calls(modeling), freezing_rule(run)
    model = prompt_model_class(checkout / "medium_models/src/models.py")(
        tiny_roberta(seed, tied=False)
    )
    config = types.SimpleNamespace(
        hidden_size=model.config.hidden_size, lora_r=LORA_R, lora_alpha=LORA_ALPHA
    )
    namespace = {"lora": loralib(), "config": config}
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # loralib's layer in the model's dtype
    try:
        for layer in model.roberta.encoder.layer:
            attention = layer.attention.self
            for name, call in calls.items():
                base = getattr(attention, name)
                adapted = eval(
                    compile(ast.Expression(call), str(modeling), "eval"),
                    namespace | {"self": attention},
                )
                adapted.load_state_dict(base.state_dict(), strict=False)
                adapted.merge_weights = adapted.merge_weights and not as_peft
                setattr(attention, name, adapted)
    finally:
        torch.set_default_dtype(default_dtype)
    freeze(model, types.SimpleNamespace(apply_lora=True))
    if as_peft:  # distzo's: the adapters alone
        for name, param in model.named_parameters():
            param.requires_grad_(name.endswith(LORA_SUFFIX))
    return model.eval()


def as_mezos(ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """distzo's (peft's) LoRA tensors by MeZO's (loralib's) names."""
    return {
        name.removesuffix(".default.weight"): value
        for name, value in ours.items()
        if name.endswith((".lora_A.default.weight", ".lora_B.default.weight"))
    }


def loss_with_adapters_moved(model: Any, names: list[str], eps: float) -> tuple[float, float]:
    """The change of MeZO's loss when its adapters move by ``eps`` z at init: as its
    forward computes it (loralib's layers as MeZO leaves them, merged in eval mode) and
    unmerged (``W x + s B A x``, exact while ``B A`` is 0, as at init)."""
    inputs = mezo_inputs(prompt_batch(0))
    params = dict(model.named_parameters())
    g = torch.Generator().manual_seed(0)
    z = {n: torch.randn(params[n].shape, generator=g, dtype=params[n].dtype) for n in names}
    layers = [m for m in model.modules() if hasattr(m, "merged")]
    merged = [m.merged for m in layers]
    with torch.no_grad():
        before = float(model(**inputs)[0])
        for n in names:
            params[n].add_(eps * z[n])
        as_left = float(model(**inputs)[0])
        for m in layers:
            m.merged = False
        unmerged = float(model(**inputs)[0])
        for m, was in zip(layers, merged, strict=True):
            m.merged = was
        for n in names:
            params[n].sub_(eps * z[n])
    return abs(as_left - before), abs(unmerged - before)


def compare_mezo_medium_lora(checkout: Path, args: argparse.Namespace) -> bool:
    """MeZO's medium LoRA and distzo's ``--peft lora`` on one tiny RoBERTa: the adapters
    at init, then ``args.steps`` steps of each, z served by name; True if all agree."""
    from distzo.adapters.peft_adapters import AdapterSpec, attach_adapter

    trainer_source, _ = medium_checkout(checkout)
    spec = AdapterSpec("lora", r=LORA_R, alpha=float(LORA_ALPHA))
    ours = attach_adapter(tiny_roberta(args.seed, tied=False), spec, args.seed)
    config = ZOConfig(
        eps=args.eps, lr=args.lr, weight_decay=args.weight_decay, seed=args.seed, device="cpu"
    )
    engine = ZOEngine(ours, config, objective=Classification())
    model = mezo_lora_model(checkout, args.seed, args.medium_lora_as == "peft")
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    start = as_mezos(engine.named_parameters())
    adapters = [n for n in names if n.endswith(LORA_SUFFIX)]
    projections = sorted({n.rsplit(".", 2)[-2] for n in adapters})
    print(
        f"mezo medium lora ({checkout}, as {args.medium_lora_as}): roberta, {len(names)} "
        f"tensors trained, {len(adapters)} LoRA's on {', '.join(projections)}; distzo "
        f"{len(start)}"
    )
    drawn_apart = [n for n in adapters if n.endswith(".lora_A")]
    same_layers = sorted(adapters) == sorted(start)
    init_gap = 0.0
    if same_layers:
        init_gap = largest(
            [start[n] - params[n].detach() for n in adapters if n not in drawn_apart]
        )
        a_max = [largest([t[n].detach() for n in drawn_apart]) for t in (params, start)]
        bound = 1 / math.sqrt(params[drawn_apart[0]].shape[1])
        print(
            f"at init: d(B) {init_gap:.3e}; A drawn apart, max |A| {a_max[0]:.3f} / "
            f"{a_max[1]:.3f} (bound {bound:.3f}), then both start from distzo's A"
        )
        with torch.no_grad():
            for n in drawn_apart:
                params[n].copy_(start[n])
    else:
        print(f"MeZO's LoRA tensors are not distzo's: {len(adapters)} / {len(start)}")
    as_left, unmerged = loss_with_adapters_moved(model, adapters, args.eps)
    print(
        f"MeZO's loss, its adapters moved by eps z: d(loss) {as_left:.3e} as its forward "
        f"runs them, {unmerged:.3e} unmerged"
    )
    head = [n for n in names if n not in start]
    if head:
        print(f"MeZO trains {len(head)} tensors distzo's --peft lora does not: {', '.join(head)}")
    agree = medium_steps(trainer_source, args, engine, model, names, as_mezos)
    agree = agree and same_layers and init_gap == 0 and not head
    print(verdict_line("mezo medium lora", agree, args.rtol))
    return agree
