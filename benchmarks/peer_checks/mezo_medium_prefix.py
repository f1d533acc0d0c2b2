"""MeZO's RoBERTa prefix (``--mezo-medium PATH --peft prefix``): its ``medium_models`` run
with ``--prefix_tuning --num_prefix 5 --no_reparam --prefix_init_by_real_act`` (its README's
"MeZO (prefix)" command) beside distzo's ``--peft prefix`` on the same tiny RoBERTa, steps
as ``mezo_medium``'s.

What runs as written, from the checkout: ``src/prefix.py``'s ``PrefixTuning`` (as run.py
calls it) with its ``attn_forward_hook`` on every ``*.attention`` and its ``find_module``;
the prompt model and the trainer's ZO branch, as ``mezo_medium`` runs them. The prefix's
random tokens are distzo's, served to MeZO's ``torch.randint``; both sides take their init
from the keys and values the model computes for them.

Stood in: MeZO's prefix code is written for its own copy of transformers 4.28's RoBERTa
(``src/modeling_roberta.py``); here it runs on transformers 5's, with 4.28's interface put
back where MeZO's code reads it: ``model.roberta(..., use_cache=True).past_key_values``
(MeZO's copy commented out the ``is_decoder`` gate, so its encoder returns each layer's keys
and values: transformers 5's drops ``use_cache`` for an encoder), that cache indexed as a
tuple, the ``past_key_value`` tuple its hook hands the attention (a one-layer cache here),
the 4-D additive mask its hook widens with zeros (``mezo_adapters.legacy_opt_attention``),
and the ``.cuda()``, ``.device`` and ``.dtype`` of its ``PreTrainedModel`` (the model stays
on the host).

Differences by design, measured by this check (``--prefix-positions mezo``, the default):
MeZO's hook adds the prefix inside the attention, so the embeddings never see a cache and
the batch's positions start at ``padding_idx + 1`` as without a prefix; peft's and
distzo's start after it (docs/peft.md). ``--prefix-positions peft`` shifts MeZO's by the
prefix to compare all the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from distzo import ZOConfig, ZOEngine
from distzo.models.roberta import cache_length_keyword
from distzo.objectives import Classification

from .harness import largest, verdict_line
from .mezo_adapters import (
    PrefixTokens,
    legacy_attention,
    legacy_cache_indexing,
    legacy_opt_attention,
    mezo_adapter_code,
)
from .mezo_medium import (
    medium_checkout,
    medium_steps,
    mezo_inputs,
    prompt_batch,
    prompt_model_class,
    tiny_roberta,
)

PREFIX = "medium_models/src/prefix.py"
PREFIX_TOKENS = 5  # MeZO's README: --num_prefix 5
KINDS = ("prefix_keys", "prefix_values")


def prefix_checkout(path: Path) -> Path:
    """MeZO's medium prefix.py in the checkout ``path``."""
    source = path / PREFIX
    if not source.is_file():
        raise SystemExit(
            f"--mezo-medium {path} --peft prefix: no {PREFIX} there; give a checkout of MeZO"
        )
    return source


@contextlib.contextmanager
def encoder_key_values(roberta: Any) -> Iterator[None]:
    """``roberta(..., use_cache=True)`` as MeZO's modeling_roberta.py copy answers it for an
    encoder: each layer's keys and values, as ``past_key_values``. transformers 5's
    RobertaModel sets ``use_cache`` False unless ``is_decoder``: inside, its encoder keeps
    a cache for such a call."""
    forward, encoder_forward = roberta.forward, roberta.encoder.forward

    def forward_with_cache(*args: Any, use_cache: bool | None = None, **kwargs: Any) -> Any:
        if not use_cache:
            return forward(*args, **kwargs)
        cache = DynamicCache()
        roberta.encoder.forward = lambda *a, **kw: encoder_forward(
            *a, **{**kw, "cache": cache, "use_cache": True}
        )
        try:
            output = forward(*args, **kwargs)
        finally:
            del roberta.encoder.forward
        return types.SimpleNamespace(
            last_hidden_state=output.last_hidden_state, past_key_values=cache
        )

    roberta.forward = forward_with_cache
    try:
        yield
    finally:
        del roberta.forward


def host_prompt_model(models_source: Path, masked_lm: Any) -> Any:
    """MeZO's prompt model of ``masked_lm``, answering what prefix.py asks of its
    ``PreTrainedModel``: ``.cuda()`` (it stays on the host), ``.device`` and ``.dtype``."""
    prompt_class = prompt_model_class(models_source)

    class HostPromptModel(prompt_class):  # type: ignore[misc, valid-type]
        def cuda(self, *args: Any, **kwargs: Any) -> Any:
            return self

        @property
        def device(self) -> torch.device:
            return next(self.parameters()).device

        @property
        def dtype(self) -> torch.dtype:
            return next(self.parameters()).dtype

    return HostPromptModel(masked_lm)


def mezo_prefixed(checkout: Path, seed: int, tokens: torch.Tensor) -> Any:
    """MeZO's prompt model of the tiny RoBERTa, prefixed by its own ``PrefixTuning`` as
    run.py calls it under its README's flags, its random tokens ``tokens``."""
    _, models_source = medium_checkout(checkout)
    masked_lm = tiny_roberta(seed, tied=False)
    masked_lm.set_attn_implementation(legacy_opt_attention())
    model = host_prompt_model(models_source, masked_lm)
    namespace: dict[str, Any] = {
        "torch": PrefixTokens(tokens),
        "nn": torch.nn,
        "logger": logging.getLogger("mezo"),
    }
    adapter = mezo_adapter_code(checkout, "medium_prefix", namespace)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(model.dtype)
    try:
        with legacy_cache_indexing(), encoder_key_values(model.roberta):
            with torch.random.fork_rng(devices=[]):  # its randn, replaced by the init
                adapter(model, num_prefix=PREFIX_TOKENS, reparam=False, init_by_real_act=True)
    finally:
        torch.set_default_dtype(default_dtype)
    for i, layer in enumerate(model.roberta.encoder.layer):
        layer.attention.original_forward = legacy_attention(layer.attention.original_forward, i)
    return model.eval()


def shift_positions(embeddings: Any, length: int) -> None:
    """peft's positions on MeZO's prefixed RoBERTa: counted from ``padding_idx + 1 +
    length``, as the embeddings count them after a cache of the prefix's length."""
    unshifted = embeddings.forward
    keyword = cache_length_keyword(embeddings)

    def shifted(*args: Any, **kwargs: Any) -> Any:
        return unshifted(*args, **{**kwargs, keyword: length})

    embeddings.forward = shifted


def as_mezos(ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """distzo's block prefixes (``(tokens, 2, heads, head_dim)``) by MeZO's names, each of
    its keys and values ``(tokens, hidden)``, heads first along ``hidden``."""
    out = {}
    for name, value in ours.items():
        if name.endswith(".prefix_tuning.key_values"):
            layer = name.removesuffix(".prefix_tuning.key_values").split("roberta.", 1)[1]
            for half, kind in enumerate(KINDS):
                out[f"roberta.{layer}.attention.{kind}"] = value[:, half].reshape(len(value), -1)
    return out


def init_tokens(peft_model: Any) -> torch.Tensor:
    """The random tokens whose keys and values distzo's prefix starts from."""
    first = peft_model.get_base_model().roberta.encoder.layer[0].prefix_tuning
    if first.init_tokens is None:
        raise RuntimeError("distzo's prefix has no init tokens: not its real-activation init")
    return first.init_tokens.clone()


def logits_at_init(engine: ZOEngine, model: Any) -> tuple[float, float]:
    """The largest difference of the two masked LMs' logits at the real tokens of a batch,
    and the largest of distzo's there."""
    inputs = mezo_inputs(prompt_batch(0))
    batch = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    with torch.no_grad():
        ours = engine.forward(batch)[0]
        hidden = model.roberta(inputs["input_ids"], attention_mask=inputs["attention_mask"])[0]
        theirs = model.lm_head(hidden)
    real = inputs["attention_mask"].bool()  # a pad's own logits are read by no loss
    return largest([ours[real] - theirs[real]]), largest([ours[real]])


def compare_mezo_medium_prefix(checkout: Path, args: argparse.Namespace) -> bool:
    """MeZO's medium prefix and distzo's ``--peft prefix`` on one tiny RoBERTa: the prefix
    and logits at init, then ``args.steps`` steps of each, z served by name; True if all
    agree."""
    from distzo.adapters.peft_adapters import AdapterSpec, attach_adapter

    trainer_source, _ = medium_checkout(checkout)
    spec = AdapterSpec("prefix", prefix_length=PREFIX_TOKENS)
    ours = attach_adapter(tiny_roberta(args.seed, tied=False), spec, args.seed)
    config = ZOConfig(
        eps=args.eps, lr=args.lr, weight_decay=args.weight_decay, seed=args.seed, device="cpu"
    )
    tokens = init_tokens(ours)  # before the engine computes the init from them
    engine = ZOEngine(ours, config, objective=Classification())
    model = mezo_prefixed(checkout, args.seed, tokens)
    if args.prefix_positions == "peft":
        shift_positions(model.roberta.embeddings, PREFIX_TOKENS)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    start = as_mezos(engine.named_parameters())
    same = sorted(names) == sorted(start)
    print(
        f"mezo medium prefix ({checkout}, positions {args.prefix_positions}'s): roberta, "
        f"{len(names)} tensors trained; distzo {len(start)}"
    )
    init_gap = math.inf
    if same:
        init_gap = largest([start[n] - params[n].detach() for n in names])
    else:
        apart = ", ".join(sorted(set(names) ^ set(start)))
        print(f"MeZO trains other tensors than distzo: {apart}")
    logit_gap, logit_scale = logits_at_init(engine, model)
    print(f"at init: d(prefix) {init_gap:.3e}, d(logits) {logit_gap:.3e}")
    at_init = init_gap <= args.rtol * largest(list(start.values()))
    at_init = at_init and logit_gap <= args.rtol * logit_scale
    agree = same and medium_steps(trainer_source, args, engine, model, names, as_mezos)
    agree = agree and at_init
    print(verdict_line("mezo medium prefix", agree, args.rtol))
    return agree
