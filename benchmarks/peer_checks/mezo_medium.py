"""MeZO's RoBERTa step (``--mezo-medium PATH``): its ``medium_models`` code, the one behind
the paper's RoBERTa-large results, beside a ``ZOEngine`` with the ``Classification``
objective on the same prompts, z, lr, eps and weight decay.

What runs as written, compiled from the checkout's files: from ``src/trainer.py`` the
trainer's ``should_optim``, ``zo_forward``, ``efficient_perturb_parameters`` and
``get_num_samples``, and the ZO branch of its ``train()`` loop (the body of ``if
self.args.zero_order_optim:``, run as a function of the loop's ``model``, ``inputs``,
``step``, ``epoch`` and ``epoch_iterator``) under ``mezo.sh``'s flags (``--efficient_zero_order``,
no trainer optimizer, one z a step); from ``src/models.py`` ``model_for_prompting_forward``
(the logits at ``mask_pos``, the label words' columns, ``CrossEntropyLoss``) and the methods
of ``RobertaModelForPromptFinetuning`` but its ``__init__``.

Stood in: that ``__init__`` (its ``roberta`` and ``lm_head`` are a tiny float64
``RobertaForMaskedLM``'s, the decoder's bias its own bias as MeZO's ``RobertaLMHead`` has
it; no pooler, no classifier: see below), the Hugging Face ``Trainer``'s ``compute_loss``
(the model's first output), transformers 4's ``_tie_or_clone_weights`` (which its
``tie_emb`` calls: the decoder takes the embeddings' matrix) and the training arguments the
branch reads. MeZO's draws are distzo's z by parameter name (``harness.DistzoNoise``).

Differences by design, measured by this check:

* MeZO's class builds ``RobertaModel(config)`` with its pooler and a ``classifier``, which
  a prompt's loss never reads; MeZO's step trains every tensor that ``requires_grad``,
  so both walk at random. A masked LM has neither: left out here (they move no loss).
* MeZO's RoBERTa head is not tied to the word embeddings (its class has no output
  embeddings for ``tie_weights``; ``--tie_emb`` ties them): the decoder is a matrix of its
  own with its own z. The check runs both sides untied, MeZO's default;
  ``--medium-tie`` runs its ``tie_emb()`` beside distzo's tied RoBERTa (RoBERTa's own).
* MeZO's update decays every trained tensor (``param.data - lr * (projected_grad * z +
  weight_decay * param.data)``, since its commit 552cb1b; before it, none), biases and
  LayerNorms included; distzo (and MeZO's ``large_models``) only tensors of two
  dimensions or more. ``mezo.sh`` passes ``WD=0``: at ``--weight-decay 0`` the two are one
  step; above it the biases and LayerNorms part by ``lr wd theta`` a step, which the check
  prints apart from the rest.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import logging
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import RobertaConfig

from distzo import ZOConfig, ZOEngine
from distzo.models import model_from_config
from distzo.objectives import ChoiceEncoding, Classification, collate_choices

from .harness import (
    SEED_STRIDE,
    DistzoNoise,
    StepSeeds,
    agrees,
    engine_z,
    largest,
    verdict_line,
)

TRAINER = "medium_models/src/trainer.py"
MODELS = "medium_models/src/models.py"
TRAINER_METHODS = ("should_optim", "zo_forward", "efficient_perturb_parameters", "get_num_samples")
ZO_BRANCH = "self.args.zero_order_optim"  # the test of train()'s ZO branch
PROMPT_CLASS = "RobertaModelForPromptFinetuning"
VOCAB, PAD, MASK = 64, 1, 4  # RoBERTa pads with 1; a <mask> token of the tiny vocabulary
LABEL_WORDS = (10, 20)  # SST-2's "great" and "terrible" in the tiny vocabulary
ROWS = 8


def medium_checkout(path: Path) -> tuple[Path, Path]:
    """MeZO's medium trainer and models files in the checkout ``path``."""
    files = (path / TRAINER, path / MODELS)
    missing = [str(f.relative_to(path)) for f in files if not f.is_file()]
    if missing:
        raise SystemExit(
            f"--mezo-medium {path}: no {', '.join(missing)} there; give a checkout of MeZO"
        )
    return files


def class_defining(tree: ast.Module, method: str, source: Path) -> ast.ClassDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(
            isinstance(f, ast.FunctionDef) and f.name == method for f in node.body
        ):
            return node
    raise SystemExit(f"{source}: no class defines {method}; is it MeZO's {TRAINER}?")


def zo_branch(train: ast.FunctionDef, source: Path) -> ast.FunctionDef:
    """``train()``'s ZO branch as a function of the loop variables it reads, returning
    its two losses and ``projected_grad``."""
    branches = [
        node
        for node in ast.walk(train)
        if isinstance(node, ast.If) and ast.unparse(node.test) == ZO_BRANCH
    ]
    if len(branches) != 1:
        raise SystemExit(f"{source}: train() has no single `if {ZO_BRANCH}:` branch")
    function = ast.parse(
        "def zo_train_step(self, model, inputs, step, epoch, epoch_iterator):\n"
        "    return loss1, loss2, projected_grad\n"
    ).body[0]
    assert isinstance(function, ast.FunctionDef)
    function.body = branches[0].body + function.body
    return ast.fix_missing_locations(function)


def medium_trainer_code(source: Path, namespace: dict[str, Any]) -> dict[str, Callable[..., Any]]:
    """MeZO's ZO methods and the ZO branch of ``train()``, compiled with ``namespace``."""
    tree = ast.parse(source.read_text(), filename=str(source))
    node = class_defining(tree, "efficient_perturb_parameters", source)
    defs = {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}
    missing = [name for name in (*TRAINER_METHODS, "train") if name not in defs]
    if missing:
        raise SystemExit(f"{source}: class {node.name} has no {', '.join(missing)}")
    body: list[ast.stmt] = [defs[name] for name in TRAINER_METHODS]
    body.append(zo_branch(defs["train"], source))
    exec(compile(ast.Module(body=body, type_ignores=[]), str(source), "exec"), namespace)
    return {name: namespace[name] for name in (*TRAINER_METHODS, "zo_train_step")}


def prompt_model_class(source: Path) -> type:
    """MeZO's ``RobertaModelForPromptFinetuning`` with its own methods and forward
    (``model_for_prompting_forward``), its ``__init__`` stood in (``PromptModelStandIn``)."""
    tree = ast.parse(source.read_text(), filename=str(source))
    forward = [
        n
        for n in tree.body
        if isinstance(n, ast.FunctionDef) and n.name == "model_for_prompting_forward"
    ]
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == PROMPT_CLASS]
    if not forward or not classes:
        raise SystemExit(
            f"{source}: no model_for_prompting_forward or {PROMPT_CLASS}; is it MeZO's {MODELS}?"
        )
    methods = [f for f in classes[0].body if isinstance(f, ast.FunctionDef)]
    methods = [f for f in methods if f.name != "__init__"]
    namespace: dict[str, Any] = {"torch": torch, "nn": torch.nn, "F": torch.nn.functional}
    module = ast.Module(body=[*forward, *methods], type_ignores=[])
    exec(compile(module, str(source), "exec"), namespace)
    return type(PROMPT_CLASS, (PromptModelStandIn,), {f.name: namespace[f.name] for f in methods})


class PromptModelStandIn(torch.nn.Module):
    """What MeZO's ``RobertaModelForPromptFinetuning.__init__`` and run.py set, around a
    masked LM's own ``roberta`` and ``lm_head``: prompt-based, label words given."""

    def __init__(self, masked_lm: Any) -> None:
        super().__init__()
        self.config = masked_lm.config
        self.config.num_labels = len(LABEL_WORDS)
        self.num_labels, self.model_type = len(LABEL_WORDS), "roberta"
        self.roberta, self.lm_head = masked_lm.roberta, masked_lm.lm_head
        self.label_word_list = torch.tensor(LABEL_WORDS).long()  # as run.py sets it
        self.model_args = types.SimpleNamespace(use_task_word=False, l2_loss=False, sfc=False)
        self.return_full_softmax = None
        self.lb, self.ub = 0.0, 1.0

    def _tie_or_clone_weights(self, output: torch.nn.Module, input: torch.nn.Module) -> None:
        output.weight = input.weight  # transformers 4's, for a model not on TorchScript


def tiny_roberta(seed: int, tied: bool) -> Any:
    """A float64 RoBERTa masked LM of a few thousand parameters, its decoder's bias the
    head's own (MeZO's ``RobertaLMHead``; transformers 5 splits them when untied)."""
    config = RobertaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_hidden_layers=2,
        max_position_embeddings=40,
        pad_token_id=PAD,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model: Any = model_from_config(config, dtype=torch.float64).eval()  # a RobertaForMaskedLM
    model.lm_head.decoder.bias = model.lm_head.bias
    if not tied:  # as MeZO loads a checkpoint: the decoder a copy of the embeddings
        with torch.no_grad():
            model.lm_head.decoder.weight.copy_(model.roberta.embeddings.word_embeddings.weight)
    return model


def prompt_batch(step: int) -> dict[str, torch.Tensor]:
    """``ROWS`` prompts with one ``<mask>`` each, of several lengths (right-padded), both
    label words scored at the mask's own position, as MeZO's RoBERTa prompts."""
    g = torch.Generator().manual_seed(step)
    encodings = []
    for e in range(ROWS):
        length = int(torch.randint(6, 13, (1,), generator=g))
        at = int(torch.randint(1, length - 1, (1,), generator=g))
        ids = torch.randint(5, VOCAB, (length,), generator=g).tolist()
        ids[0], ids[-1], ids[at] = 0, 2, MASK  # <s> ... <mask> ... </s>
        scored = tuple((0, at, word, i) for i, word in enumerate(LABEL_WORDS))
        encodings.append(ChoiceEncoding((tuple(ids),), scored, label=e % 2))
    return collate_choices(encodings, pad_id=PAD)


def mezo_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same prompts as MeZO's dataset gives them: one row each, ``mask_pos``, the
    label's index among the label words."""
    return {
        "input_ids": batch["input_ids"][:, 0],
        "attention_mask": batch["attention_mask"][:, 0],
        "mask_pos": batch["score_position"][:, :1],  # one row: the flat index is the position
        "labels": batch["label"],
    }


def medium_trainer(
    methods: dict[str, Callable[..., Any]], model: Any, args: argparse.Namespace
) -> Any:
    """The least of MeZO's ``Trainer`` its ZO branch reads, under mezo.sh's flags."""
    trainer = types.SimpleNamespace(
        args=types.SimpleNamespace(
            zero_order_optim=True,
            efficient_zero_order=True,
            zero_order_use_trainer_optim=False,
            zo_by_layer=False,
            zo_variant=None,
            layer_wise_optim=False,
            optimize_acc=False,
            zero_order_sample_scheduler=None,
            zero_order_clip_grad=False,
            scale_lr_with_samples=False,
            gradient_accumulation_steps=1,
            n_gpu=1,
            learning_rate=args.lr,
            weight_decay=args.weight_decay,
            zero_order_eps=args.eps,
            logging_steps=0,
            logging_first_step=False,
        ),
        state=types.SimpleNamespace(global_step=0, zo_forward_step=0),
        model=model,
    )
    trainer._prepare_inputs = lambda inputs: inputs
    trainer.compute_loss_context_manager = contextlib.nullcontext
    trainer.compute_loss = lambda model, inputs: model(**inputs)[0]  # Trainer's, no smoothing
    for name, method in methods.items():
        setattr(trainer, name, types.MethodType(method, trainer))
    return trainer


def compare_mezo_medium(checkout: Path, args: argparse.Namespace) -> bool:
    """``args.steps`` steps of MeZO's medium trainer on its prompt model and of a
    ``ZOEngine`` (Classification) on an identical RoBERTa; print each; True if all agree."""
    trainer_source, models_source = medium_checkout(checkout)
    tied = args.medium_tie
    config = ZOConfig(
        eps=args.eps, lr=args.lr, weight_decay=args.weight_decay, seed=args.seed, device="cpu"
    )
    engine = ZOEngine(tiny_roberta(args.seed, tied), config, objective=Classification())
    # MeZO's class is untied, its decoder loaded as a copy; --tie_emb ties it afterwards
    model = prompt_model_class(models_source)(tiny_roberta(args.seed, tied=False))
    if tied:
        model.tie_emb()
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    print(
        f"mezo medium ({checkout}): roberta, {len(names)} tensors, "
        f"{'tied (tie_emb)' if tied else 'untied'}, wd = {args.weight_decay}"
    )
    # z is served by name: a head MeZO keeps apart would get the embeddings' z here, where
    # its own draws give it another; so the tensors each side draws for must be as many
    drawn = sum(len(layout.entries) for layout in [engine.resident_layout, *engine.block_layouts])
    if len(names) != drawn:
        print(f"MeZO draws z for {len(names)} tensors, distzo for {drawn}: another model")
    agree = medium_steps(trainer_source, args, engine, model, names) and len(names) == drawn
    print(verdict_line("mezo medium", agree, args.rtol))
    return agree


def medium_steps(
    source: Path,
    args: argparse.Namespace,
    engine: ZOEngine,
    model: Any,
    names: list[str],
    as_mezos: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = dict,
) -> bool:
    """``args.steps`` runs of MeZO's ZO branch on ``model`` and steps of ``engine``, MeZO's
    z distzo's of the same tensor (``as_mezos``: distzo's tensors by MeZO's names), a tensor
    only MeZO trains its own z; print each, and at a weight decay the tensors distzo
    exempts from it apart; True if all agree."""
    z_of = engine_z(engine)
    shared = [n for n in names if n in as_mezos(engine.named_parameters())]
    params = dict(model.named_parameters())

    def mezos_z(step: int, query: int) -> dict[str, torch.Tensor]:
        own = torch.Generator().manual_seed(step * SEED_STRIDE + query + 1)
        z = {
            n: torch.randn(params[n].shape, generator=own, dtype=params[n].dtype)
            for n in names
            if n not in shared
        }
        return {**z, **as_mezos(z_of(step, query))}

    seeds = StepSeeds()
    namespace = {
        "torch": DistzoNoise(mezos_z, names, False),
        "np": seeds,
        "nn": torch.nn,
        "F": torch.nn.functional,
        "logger": logging.getLogger("mezo"),
    }
    trainer = medium_trainer(medium_trainer_code(source, namespace), model, args)
    exempt = [n for n in shared if params[n].dim() < 2]  # decayed by MeZO, not by distzo
    print("step  loss distzo / peer        |g|        d(g)       |step| max  d(theta) max")
    agree, exempt_gap, gaps = True, 0.0, {}
    for t in range(args.steps):
        batch = prompt_batch(t)
        before = {n: p.clone() for n, p in as_mezos(engine.named_parameters()).items()}
        seeds.start(t)
        loss1, _, projected_grad = trainer.zo_train_step(model, mezo_inputs(batch), t, 0, [batch])
        result = engine.step(batch)
        after = as_mezos(engine.named_parameters())
        g = abs(result.projected_grads[0])
        dg = abs(result.projected_grads[0] - float(projected_grad))
        step = largest([after[n] - before[n] for n in shared])
        gaps = {n: largest([after[n] - params[n].detach()]) for n in shared}
        dtheta = max(gaps.values())
        exempt_gap = max([exempt_gap] + [gaps[n] for n in exempt])
        print(
            f"{t:>4}  {result.loss_plus:.10f} / {float(loss1):.10f}  {g:9.3e}  {dg:9.3e}  "
            f"{step:10.3e}  {dtheta:10.3e}"
        )
        weights = (step, dtheta, largest([params[n].detach() for n in shared]))
        losses = (*result.losses, result.loss_plus, result.loss_minus)
        agree &= agrees(args.rtol, t, result.loss_plus, float(loss1), (g, dg), weights, losses)
    if args.weight_decay and exempt:
        rest = max(gaps[n] for n in shared if n not in exempt)
        print(
            f"d(theta) in the {len(exempt)} tensors distzo exempts from decay (biases, "
            f"LayerNorms): {exempt_gap:.3e}; in the rest: {rest:.3e}"
        )
    return agree
