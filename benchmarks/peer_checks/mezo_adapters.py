"""MeZO's adapters (``--mezo PATH --peft lora|prefix``) as its ``run.py`` applies them, by
its own ``large_models/lora.py`` (``LoRA``: r 8, alpha 16) and ``prefix.py``
(``PrefixTuning``: 5 tokens, no reparameterisation, init by real activations), compiled
from the checkout, on one tiny float64 OPT; distzo's ``--peft`` on another from the same
base.

It prints the adapters' and logits' differences at init (LoRA's random ``A`` is drawn
apart, both within Kaiming's bound, then both start from distzo's; the prefix's tokens are
distzo's, served to MeZO's ``torch.randint``), then MeZO's steps beside the engine's, z
served by parameter name (a block's ``key_values`` is MeZO's ``prefix_keys`` and
``prefix_values``). MeZO's prefix code is written for transformers 4.28's OPT attention;
it runs as written, with 4.28's interface stood in: its cache indexed as a tuple, its
``past_key_value`` handed to the attention as a cache, an attention given a 4-D additive
mask and a softmax in float64. MeZO's batch keeps positions 0.. beside the prefix, peft's
and distzo's start after it (docs/peft.md): ``--prefix-positions peft`` shifts MeZO's by
the prefix to compare all the rest.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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

# MeZO's LoRA and prefix (large_models/lora.py, prefix.py): what each file defines that
# run.py's ``LoRA(model, r, alpha, float16)`` / ``PrefixTuning(model, num_prefix, ...)`` run
MEZO_ADAPTERS = {
    "lora": ("large_models/lora.py", ("find_module", "LoRALinear", "LoRA")),
    "prefix": (
        "large_models/prefix.py",
        ("find_module", "attn_forward_hook", "prepare_inputs_for_generation", "PrefixTuning"),
    ),
    # its medium_models' (RoBERTa), which mezo_medium_prefix runs
    "medium_prefix": (
        "medium_models/src/prefix.py",
        ("find_module", "attn_forward_hook", "PrefixTuning"),
    ),
}


PREFIXED_LENGTH = 11
PADDED = 3
LEGACY_ATTENTION = "mezo_legacy"


class HostTensor(torch.Tensor):
    """MeZO moves its prefix-init tokens with ``.cuda()``: here they stay on the host."""

    def cuda(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)


class PrefixTokens:
    """Stands in for ``torch`` in MeZO's prefix.py: its ``randint`` (the random tokens whose
    activations become the prefix) returns ``tokens``, the ones distzo drew; all else is
    torch's."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def randint(self, low: int, high: int, size: tuple[int, ...], **options: Any) -> torch.Tensor:
        if tuple(size) != tuple(self.tokens.shape) or int(self.tokens.max()) >= high:
            raise RuntimeError(f"MeZO drew {tuple(size)} tokens below {high}: not distzo's")
        return self.tokens.clone().as_subclass(HostTensor)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def mezo_adapter_code(checkout: Path, method: str, namespace: dict[str, Any]) -> Any:
    """MeZO's ``LoRA`` or ``PrefixTuning`` class, compiled with what it uses from its own
    file in ``checkout`` (its module-level logging set-up is left out)."""
    relative, names = MEZO_ADAPTERS[method]
    source = checkout / relative
    if not source.is_file():
        raise SystemExit(f"--mezo {checkout}: no {relative} there; give a checkout of MeZO")
    tree = ast.parse(source.read_text(), filename=str(source))
    body: list[ast.stmt] = [
        n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name in names
    ]
    missing = sorted(
        set(names) - {n.name for n in body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
    )
    if missing:
        raise SystemExit(f"{source}: no {', '.join(missing)}; is it MeZO's {relative}?")
    exec(compile(ast.Module(body=body, type_ignores=[]), str(source), "exec"), namespace)
    return namespace[names[-1]]


@contextlib.contextmanager
def legacy_cache_indexing() -> Iterator[None]:
    """transformers 4.28's cache (MeZO's) was a tuple of (keys, values) per layer: MeZO's
    prefix init indexes it so; inside, transformers 5's ``DynamicCache`` answers alike."""
    from transformers import DynamicCache

    def legacy(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return cache.layers[layer].keys, cache.layers[layer].values

    cache_class: Any = DynamicCache  # given a method it does not declare, for a while
    own = cache_class.__dict__.get("__getitem__")
    cache_class.__getitem__ = legacy
    try:
        yield
    finally:
        if own is None:
            del cache_class.__getitem__
        else:
            cache_class.__getitem__ = own


def legacy_attention(forward: Callable[..., Any], layer: int) -> Callable[..., Any]:
    """An OPT attention's forward taking transformers 4.28's ``past_key_value`` tuple, which
    MeZO's ``attn_forward_hook`` passes: its keys and values go before the layer's own, as
    4.28's ``torch.cat([past_key_value[0], key_states], dim=2)``; the 4-D additive mask
    MeZO widened goes as it is (to ``legacy_opt_attention``)."""
    from transformers import DynamicCache

    def forward_with_tuple(*args: Any, **kwargs: Any) -> Any:
        keys, values = kwargs.pop("past_key_value")
        cache = DynamicCache()
        cache.update(keys, values, layer)
        return forward(*args, **{**kwargs, "cache": cache})

    return forward_with_tuple


def legacy_opt_attention() -> str:
    """The name of an attention that gets transformers 4.28's mask, 4-D and additive, which
    MeZO's hook widens with zeros, and takes its softmax in the model's dtype, as 4.28's
    OPT did for all but fp16 (transformers 5's ``eager`` takes it in float32: 3e-9 in a
    float64 check)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(LEGACY_ATTENTION, sdpa_attention_forward)
    AttentionMaskInterface.register(LEGACY_ATTENTION, eager_mask)
    return LEGACY_ATTENTION


def mezo_adapted(checkout: Path, method: str, model: Any, tokens: torch.Tensor | None) -> None:
    """``model`` adapted by MeZO's own code as run.py calls it (its defaults: r 8, alpha 16;
    5 prefix tokens, no reparameterisation, init by real activations of ``tokens``). Its
    LoRA layers are built in the model's dtype, as its ``float16`` branch does for fp16."""
    namespace: dict[str, Any] = {
        "torch": torch if tokens is None else PrefixTokens(tokens),
        "nn": torch.nn,
        "F": torch.nn.functional,
        "math": math,
        "logger": logging.getLogger("mezo"),
    }
    adapter = mezo_adapter_code(checkout, method, namespace)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(model.dtype)
    try:
        if method == "lora":
            adapter(model, r=8, alpha=16, float16=False)
            return
        assert tokens is not None  # a prefix's init tokens
        model.set_attn_implementation(legacy_opt_attention())
        with legacy_cache_indexing():
            adapter(model, num_prefix=tokens.shape[1], reparam=False, init_by_real_act=True)
    finally:
        torch.set_default_dtype(default_dtype)
    for i, layer in enumerate(model.model.decoder.layers):
        attention = layer.self_attn
        attention.original_forward = legacy_attention(attention.original_forward, i)


def shift_positions(model: Any, length: int) -> None:
    """peft's positions on MeZO's prefixed OPT: the batch's tokens at ``length`` onwards,
    after the prefix (MeZO's own keep them at 0 onwards, as without a prefix)."""
    positions = model.model.decoder.embed_positions
    unshifted = positions.forward

    def shifted(mask: torch.Tensor, cache_length: int = 0, position_ids: Any = None) -> Any:
        if position_ids is None:  # OPT's own rule: the count of real tokens before each
            position_ids = (torch.cumsum(mask, dim=1) * mask - 1).long()[:, cache_length:]
        return unshifted(mask, cache_length, position_ids=position_ids + length)

    positions.forward = shifted


def distzo_name(mezo_name: str) -> tuple[str, int | None]:
    """Where distzo keeps MeZO's adapter tensor ``mezo_name``: the peft LoRA weight, or a
    block's prefix (its keys, 0, or values, 1, of ``(tokens, 2, heads, head_dim)``)."""
    for part in ("lora_A", "lora_B"):
        if mezo_name.endswith("." + part):
            return f"{mezo_name}.default.weight", None
    layer, kind = mezo_name.rsplit(".self_attn.", 1)
    return f"{layer}.prefix_tuning.key_values", ("prefix_keys", "prefix_values").index(kind)


def as_mezos(ours: dict[str, torch.Tensor], mezo_names: list[str]) -> dict[str, torch.Tensor]:
    """distzo's tensors (values or z) by name in MeZO's layout."""
    out = {}
    for name in mezo_names:
        key, half = distzo_name(name)
        value = ours[key] if half is None else ours[key][:, half]
        out[name] = value.reshape(len(value), -1).contiguous() if half is not None else value
    return out


def prefix_tokens(model: Any) -> torch.Tensor | None:
    """The random tokens distzo's prefix is initialised from (None: no prefix to init)."""
    first = getattr(model.get_base_model().model.decoder.layers[0], "prefix_tuning", None)
    return None if first is None else first.init_tokens.clone()


def prefixed_batch(step: int) -> dict[str, torch.Tensor]:
    """``batch_of(step)`` cut to leave the tiny OPT's 16 positions room for a 5-token prefix,
    its second row padded on the left by ``PADDED`` positions: the prefix widens a mask
    that hides keys its real tokens would see (a right pad is never seen, being later).
    The loss leaves out the pads and the first real token, which only a pad's logits
    predict (each side gives a pad its own position)."""
    batch = {key: value[:, :PREFIXED_LENGTH].clone() for key, value in batch_of(step).items()}
    batch["attention_mask"][1, :PADDED] = 0
    batch["labels"][1, : PADDED + 1] = -100
    return batch


def compare_mezo_adapter(checkout: Path, source: Path, args: argparse.Namespace) -> bool:
    """MeZO's LoRA or prefix on one tiny float64 OPT and distzo's ``--peft`` on another from
    the same base: the logits at init (LoRA's ``A`` is distzo's, drawn alike; the prefix
    each side's own init from distzo's tokens), then ``args.steps`` MeZO steps against the
    engine's, z served by parameter name; True if all agree."""
    from distzo.adapters.peft_adapters import AdapterSpec, attach_adapter

    config = ZOConfig(eps=args.eps, lr=args.lr, weight_decay=args.weight_decay, seed=args.seed)
    ours = attach_adapter(tiny_model("opt", args.seed), AdapterSpec(args.peft), args.seed)
    tokens = prefix_tokens(ours) if args.peft == "prefix" else None
    engine = ZOEngine(ours, dataclasses.replace(config, device="cpu"))
    model = tiny_model("opt", args.seed).eval()  # as MeZO's run.py loads it
    mezo_adapted(checkout, args.peft, model, tokens)
    if tokens is not None and args.prefix_positions == "peft":
        shift_positions(model, tokens.shape[1])
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    start = as_mezos(engine.named_parameters(), names)
    drawn_apart = [n for n in names if n.endswith(".lora_A")]  # each side's random draw
    init_gap = largest([start[n] - params[n].detach() for n in names if n not in drawn_apart])
    a_bounds = [
        largest([t[n].detach() for n in drawn_apart] or [torch.zeros(1)]) for t in (params, start)
    ]
    with torch.no_grad():
        if args.peft == "lora":  # A is random on both sides: distzo's, so the steps compare
            for name in names:
                params[name].copy_(start[name])
        probe = prefixed_batch(args.steps)
        logits = engine.forward(probe)[0]
        theirs = model(probe["input_ids"], attention_mask=probe["attention_mask"]).logits
        real = probe["attention_mask"].bool()  # a pad's own logits are read by no loss
        logit_gap = largest([logits[real] - theirs[real]])
    at_init = init_gap <= args.rtol * largest(list(start.values())) and logit_gap <= (
        args.rtol * largest([logits])
    )
    where = f", positions {args.prefix_positions}'s" if tokens is not None else ""
    print(f"mezo {args.peft} ({checkout}): opt, {len(names)} tensors{where}")
    print(f"at init: d(adapter) {init_gap:.3e}, d(logits) {logit_gap:.3e}")
    if drawn_apart:  # Kaiming-uniform with a = sqrt(5) on both sides: bound 1 / sqrt(fan_in)
        bound = 1 / math.sqrt(params[drawn_apart[0]].shape[1])
        print(f"A drawn apart, max |A| {a_bounds[0]:.3f} / {a_bounds[1]:.3f} (bound {bound:.3f})")
        print("then both start from distzo's A")
    return mezo_adapter_steps(source, args, engine, model, names) and at_init


def mezo_adapter_steps(
    source: Path, args: argparse.Namespace, engine: ZOEngine, model: Any, names: list[str]
) -> bool:
    """``args.steps`` steps of MeZO's trainer on its adapted ``model`` and of ``engine``,
    MeZO's z distzo's of the same tensor; print each; True if all agree."""
    z_of = engine_z(engine)
    seeds = StepSeeds()
    noise = DistzoNoise(lambda t, j: as_mezos(z_of(t, j), names), names, False)
    namespace = {"torch": noise, "np": seeds, "logger": logging.getLogger("mezo")}
    trainer = peer_trainer(peer_methods(source, namespace), args, 1)
    params = dict(model.named_parameters())
    print("step  loss distzo / peer        |g|        d(g)       |step| max  d(theta) max")
    agree = True
    for t in range(args.steps):
        batch = prefixed_batch(t)
        before = as_mezos(engine.named_parameters(), names)
        seeds.start(t)
        peer_loss = float(trainer.zo_step(model, batch))
        trainer.zo_update(model)
        result = engine.step(batch)
        after = as_mezos(engine.named_parameters(), names)
        g = abs(result.projected_grads[0])
        dg = abs(result.projected_grads[0] - trainer.projected_grad)
        step = largest([after[n] - before[n] for n in names])
        dtheta = largest([after[n] - params[n].detach() for n in names])
        print(
            f"{t:>4}  {result.loss_plus:.10f} / {peer_loss:.10f}  {g:9.3e}  {dg:9.3e}  "
            f"{step:10.3e}  {dtheta:10.3e}"
        )
        weights = (step, dtheta, largest([params[n].detach() for n in names]))
        losses = (*result.losses, result.loss_plus, result.loss_minus)
        agree &= agrees(args.rtol, t, result.loss_plus, peer_loss, (g, dg), weights, losses)
    label = f"mezo {args.peft}"
    print(verdict_line(label, agree, args.rtol))
    return agree
