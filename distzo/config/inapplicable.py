"""Options given on the command line that the rest of the command makes meaningless
(``--beta2`` with ZO-SGD, ``--lora-r`` without LoRA): named in one warning line with what
each needs, rather than ignored silently, and then truly ignored (set back to their
defaults, so no later check refuses what the warning said it ignored). Not refused: a
sweep script passes one set of flags to every run, whichever optimizer or adapter it
picks."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from distzo.data.templates import GENERATION

# option -> (whether it applies to the resolved options, what it needs)
RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "beta1": (lambda j: j.optim.optimizer != "sgd", "--optimizer momentum or adam"),
    "beta2": (lambda j: j.optim.optimizer == "adam", "--optimizer adam"),
    "adam_eps": (lambda j: j.optim.optimizer == "adam", "--optimizer adam"),
    "momentum_window": (
        lambda j: (
            j.optim.optimizer == "momentum" and j.optim.optimizer_state not in ("stored", "lowrank")
        ),
        "--optimizer momentum with its state recomputed",
    ),
    "lora_r": (lambda j: j.peft.peft in ("lora", "lora-fa"), "--peft lora or lora-fa"),
    "lora_alpha": (lambda j: j.peft.peft in ("lora", "lora-fa"), "--peft lora or lora-fa"),
    "lora_targets": (lambda j: j.peft.peft in ("lora", "lora-fa"), "--peft lora or lora-fa"),
    "prefix_length": (lambda j: j.peft.peft == "prefix", "--peft prefix"),
    "prefix_init": (lambda j: j.peft.peft == "prefix", "--peft prefix"),
    "export_shard_size": (
        lambda j: j.peft.peft == "none" or j.peft.merge_adapter,
        "--peft none or --merge-adapter (an adapter exports as one file)",
    ),
    "num_slots": (lambda j: j.offload.mode != "resident", "--mode offload"),
    "transfer": (lambda j: j.offload.mode != "resident", "--mode offload"),
    "transfer_chunks": (  # pieces of a sliced rank's share; auto may resolve to sliced
        lambda j: j.offload.mode != "resident" and j.offload.transfer != "naive",
        "--mode offload and --transfer sliced or auto",
    ),
    "seq_len": (lambda j: j.data.task == "counting", "--task counting"),
    "export_best": (
        lambda j: j.data.num_dev is not None or j.data.dev_per_class is not None,
        "--num-dev or --dev-per-class",
    ),
    "train_set_seed": (
        lambda j: j.data.sampling.samples,
        "--num-train, --num-dev, --num-eval, --train-per-class or --num-demos",
    ),
    "demo_sets": (lambda j: j.data.num_demos is not None, "--num-demos"),
    "max_length": (lambda j: j.data.task != "counting", "a text or prompt --task"),
    "columns": (lambda j: j.data.task != "counting", "a text or prompt --task"),
    "max_new_tokens": (lambda j: j.data.task in GENERATION, "--task squad or drop"),
    "batch_queries": (  # full tuning refuses it at any count: it needs an adapter first
        lambda j: _queries(j) > 1 or j.peft.peft == "none",
        "several queries a step (--num-queries 2 or more)",
    ),
    "lozo_rank": (lambda j: _noise(j) == "lowrank", "--noise lowrank (--estimator lozo)"),
    "lozo_interval": (lambda j: _noise(j) == "lowrank", "--noise lowrank (--estimator lozo)"),
}


def _noise(job: Any) -> str | None:
    """The noise the run draws: the one given, else its estimator's own."""
    return _given_or_estimators(job, "noise", "default_noise")


def _queries(job: Any) -> int:
    """The queries a step draws: the number given, else its estimator's own (FZOO's 8)."""
    return _given_or_estimators(job, "num_queries", "default_queries") or 1


def _given_or_estimators(job: Any, option: str, default: str) -> Any:
    """``job.optim``'s ``option`` where given, else the estimator's ``default`` (as
    ``JobConfig.engine_config`` fills it in); an unknown estimator adds nothing."""
    from distzo.zo.estimators import ESTIMATORS, estimator_for

    given = getattr(job.optim, option)
    if given is not None or job.optim.estimator not in ESTIMATORS:
        return given
    return getattr(estimator_for(job.optim.estimator), default)


def inapplicable(job: Any, given: Iterable[str]) -> dict[str, str]:
    """Each option of ``given`` (names set on the command line) that ``job``, resolved from
    the defaults, the file and the flags, makes meaningless -> what it needs."""
    return {name: RULES[name][1] for name in given if name in RULES and not RULES[name][0](job)}


def ignored_warning(ignored: dict[str, str]) -> str:
    """The one warning line naming the options ``inapplicable`` found."""
    return "ignored: " + ", ".join(
        f"--{name.replace('_', '-')} (it applies only with {needs})"
        for name, needs in ignored.items()
    )
