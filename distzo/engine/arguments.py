"""``ZOEngine``'s arguments (its constructor's, ``step``'s ``stop``) checked by type before
any work: a string where an object belongs (``objective="lm"``, ``family="opt"``) was
accepted and failed later, at the first step or deep in the build, with an attribute error
that named neither the argument nor what it takes."""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import PretrainedConfig

from distzo.config.engine_options import ZOConfig
from distzo.dist import ParallelContext
from distzo.models import ModelFamily
from distzo.models.family import MASKED
from distzo.runtime.argument_values import check_flag, type_and_repr

# What a WeightSource and an Objective are: protocols, so their methods are what is checked.
WEIGHT_SOURCE_METHODS = ("tensor", "tensor_range")
OBJECTIVE_METHODS = ("num_items", "prepare", "losses")


def _has_methods(value: object, names: tuple[str, ...]) -> bool:
    return all(callable(getattr(value, name, None)) for name in names)


def _refused(argument: str, value: object, takes: str, how: str) -> TypeError:
    """What the argument takes, what it got, then how to make one."""
    return TypeError(f"{argument} must be {takes}, got {type_and_repr(value)}: {how}")


def check_engine_arguments(
    model: Any, config: Any, family: Any, parallel: Any, weights: Any, objective: Any
) -> None:
    """Each argument of ``ZOEngine`` of the type it takes (None: the default), else a
    one-line TypeError naming the argument, the type and how to make one."""
    if not (
        isinstance(model, nn.Module)
        and isinstance(getattr(model, "config", None), PretrainedConfig)
    ):
        raise _refused(
            "model",
            model,
            "a transformers causal or masked LM (or a peft model of one)",
            "load_model(name_or_path) or model_from_config(config)",
        )
    if not isinstance(config, ZOConfig):  # a dict was "object has no attribute 'validate'"
        raise _refused("config", config, "a ZOConfig", "ZOEngine(model, ZOConfig(lr=..., ...))")
    if family is not None and not isinstance(family, ModelFamily):
        raise _refused(
            "family",
            family,
            "a ModelFamily",
            "omit it: the default, family_for(model), is the model's own",
        )
    if parallel is not None and not isinstance(parallel, ParallelContext):
        raise _refused(
            "parallel",
            parallel,
            "a distzo.dist.ParallelContext",
            "a torchrun job's (docs/python-api.md builds one), or None for one process",
        )
    if weights is not None and not _has_methods(weights, WEIGHT_SOURCE_METHODS):
        raise _refused(
            "weights",
            weights,
            "a WeightSource",
            "open_checkpoint(path) or RandomWeights(seed) (distzo.models.weights), or None",
        )
    if objective is not None and not _has_methods(objective, OBJECTIVE_METHODS):
        raise _refused(
            "objective",
            objective,
            "an Objective",
            "one from distzo.objectives (LanguageModeling(), Classification(), Accuracy(), "
            "F1(decode, answers)), or None for LanguageModeling()",
        )


def check_stop(stop: object) -> None:
    """``step``'s vote rides on the all-reduce as ``float(stop)``: ``"yes"`` failed there
    ("could not convert string to float"), and 0.5 would be half a vote."""
    check_flag(
        stop, "stop", "this rank's vote to stop after this step (a preemption notice it caught)"
    )


def check_objective_fits(family: ModelFamily, objective: object, defaulted: bool) -> None:
    """A masked LM (``MASKED``: RoBERTa) has no next token, so an objective that reads one
    (``predicts_next_token``: LanguageModeling, F1's greedy decoding) would train on the
    logits of the wrong position; refused in one line before anything is built."""
    if family.lm_kind != MASKED or not getattr(objective, "predicts_next_token", False):
        return
    name = type(objective).__name__ + (" (the default objective)" if defaulted else "")
    model_type = getattr(family.model.config, "model_type", type(family.model).__name__)
    raise ValueError(
        f"objective {name} reads a causal LM's next token, and model type {model_type!r} is "
        "a masked LM; give objective=Classification() or Accuracy() on choice batches "
        "whose score_position is each candidate's <mask> position"
    )
