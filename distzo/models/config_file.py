"""A model folder's config.json, read and checked before anything is built from it.

A downloaded or handed-over folder may hold a config.json that is not a config (``null``,
a list), one whose fields have the wrong type (``"num_hidden_layers": "12"``), sizes no
model has (0 layers, a vocabulary of 0), or sizes no machine holds (10**6 layers): each
is one line naming the option and the file, before the skeleton is built. A skeleton of
10**6 layers built for an hour and took all the host's memory before any memory check
could run; here its size is counted from two models of one and two layers on the meta
device (no memory, milliseconds), whatever the family.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig
from transformers.utils import CONFIG_NAME

from distzo.models.hub import unwritable_cache
from distzo.models.hub_reads import bounded_reads, hub_answers, is_repo_id, repo_answers
from distzo.runtime import json_text

JSON_KINDS = {list: "an array", str: "a string", type(None): "null", bool: "a boolean"}
FIX = "is its config.json damaged? download or copy the model again"


def read_config(
    name: str | Path, option: str = "--model", revision: str | None = None
) -> PretrainedConfig:
    """The config of model ``name`` (a folder or a hub name, at commit ``revision``: a
    resumed run's, whose weights it describes; None: ``main``); a config.json that is not
    a JSON object, or whose fields have the wrong type, is one line naming it. ``option``:
    what the error calls the model (replay's ``--base``)."""
    path = Path(name)
    if (path / CONFIG_NAME).is_file():
        _check_object(path / CONFIG_NAME, option)
    from huggingface_hub.errors import StrictDataclassError

    # a hub name where the hub does not answer, or stalls on it: the cache's (transformers
    # would wait on the hub without a time limit); where it answers, each read bounded
    cached = not path.exists() and not (
        hub_answers() and repo_answers(str(name), revision=revision)
    )
    at = {"revision": revision} if revision is not None and not path.exists() else {}
    try:
        with bounded_reads():
            return AutoConfig.from_pretrained(name, local_files_only=cached, **at)
    except StrictDataclassError as err:  # a field of the wrong type: its own line says which
        reason = str(err).strip().splitlines()[-1].strip().removeprefix("TypeError: ")
        raise ValueError(f"{option} {name}: its {CONFIG_NAME}: {reason}; {FIX}") from None
    # a missing path, a malformed name, no hub access; a config.json nested past the
    # recursion limit of transformers' json.load
    except (OSError, ValueError, RecursionError) as err:
        reason = unwritable_cache(err, str(name)) or str(err).splitlines()[0]
        if not path.exists() and not is_repo_id(str(name)):  # transformers': "Repo id must use..."
            reason = "no such folder, nor a hub name (org/name); give the model's folder"
        elif cached and isinstance(err, OSError) and not unwritable_cache(err, str(name)):
            pinned = "" if revision is None else f" --revision {revision}"
            # transformers' line says what failed; the user needs what to do about it
            reason = (
                "the hub is out of reach (HF_HUB_OFFLINE=1, or no answer) and the Hugging Face "
                f"cache holds no copy of it; download it where the hub answers (hf download "
                f"{name}{pinned}) or give {option} a local folder"
            )
        raise ValueError(f"cannot load {option} {str(name)!r}: {reason}") from None


def config_text(config: PretrainedConfig) -> str:
    """``config`` whole as JSON text, which ``config_from_text`` reads back as it was: how
    a config one rank read is told to the others (no pickle)."""
    return config.to_json_string(use_diff=False)


def config_from_text(text: str) -> PretrainedConfig:
    """The config ``config_text`` wrote, of its own class (a multimodal one with its
    sub-configs)."""
    data = json_text.loads(text)
    return CONFIG_MAPPING[data["model_type"]].from_dict(data)


def _check_object(file: Path, option: str) -> None:
    """``file`` is a JSON object (transformers takes ``null`` into a TypeError traceback
    and a list or a string for a config without a ``model_type``)."""
    try:
        data = json_text.loads(file.read_text())
    except OSError as err:
        raise ValueError(f"{option}: cannot read {file} ({err.strerror}); {FIX}") from None
    except ValueError as err:  # not UTF-8, not JSON, nested too deeply
        raise ValueError(f"{option}: {file} is not JSON ({err}); {FIX}") from None
    if not isinstance(data, dict):
        kind = JSON_KINDS.get(type(data), "a number")
        raise ValueError(f"{option}: {file} holds {kind}, not a model's config (an object); {FIX}")


@dataclass(frozen=True)
class ModelSize:
    """What a model of a config holds: its parameters (tied ones once) and its modules
    (each a Python object of some kilobytes in the skeleton, whatever its width)."""

    parameters: int
    modules: int


# Up to this many layers a model is counted whole, built on meta (a tenth of a second at
# OPT-175B's 96): a mixture's layers differ (Qwen-MoE's ``decoder_sparse_step`` and
# ``mlp_only_layers`` make some dense). Past it (no released model has as many), from
# models of one and two layers, so that a damaged config of a million layers is counted
# in a second, not built for an hour.
COUNTED_WHOLE = 512


def model_size(config: PretrainedConfig, where: str) -> ModelSize:
    """The size of a model of ``config``: its skeleton built on the meta device, or past
    ``COUNTED_WHOLE`` layers, counted from models of one and two layers as if all its
    layers were alike. Sizes that build no model (a layer count under 1, a vocabulary of 0,
    a width its heads do not divide) are one line naming ``where`` (the option and its
    model)."""
    layers = config.num_hidden_layers
    if layers < 1:
        raise ValueError(
            f"{where}: its {CONFIG_NAME} gives num_hidden_layers {layers}; a model has one "
            f"layer at least; {FIX}"
        )
    if layers <= COUNTED_WHOLE:
        return _meta_size(config, layers, where)
    one, two = (_meta_size(config, count, where) for count in (1, 2))
    return ModelSize(
        one.parameters + (layers - 1) * (two.parameters - one.parameters),
        one.modules + (layers - 1) * (two.modules - one.modules),
    )


def _meta_size(config: PretrainedConfig, layers: int, where: str) -> ModelSize:
    """The size of ``config``'s model cut to ``layers`` layers, built on meta."""
    cut = copy.deepcopy(config)
    cut.num_hidden_layers = layers
    if getattr(cut, "layer_types", None):  # one attention kind a layer (Qwen): as many
        cut.layer_types = [cut.layer_types[min(i, len(cut.layer_types) - 1)] for i in range(layers)]
    from distzo.models.registry import auto_class

    loader = auto_class(cut.model_type)
    try:
        with torch.device("meta"):
            model = loader.from_config(cut)
    except (RuntimeError, ValueError, IndexError, AssertionError, TypeError) as err:
        raise ValueError(
            f"{where}: its {CONFIG_NAME}'s sizes build no model "
            f"({str(err).strip().splitlines()[0]}); {FIX}"
        ) from None
    model.tie_weights()
    parameters = sum(p.numel() for p in model.parameters())
    return ModelSize(parameters, sum(1 for _ in model.modules()))
