"""``datasets``' refusals of an ``hf:`` spec, said as the spec to write: a dataset of
several configs read with none named (``hf:nyu-mll/glue:sst2``, the split left out, reads
``sst2`` as the split), a config or split it lacks, a folder ``save_to_disk`` wrote. Their
first line alone ("Config name is missing.") named neither the configs nor the fix."""

from __future__ import annotations

import ast
import re

from distzo.data.hub_spec import hub_spec

# datasets' messages (datasets.builder, datasets.arrow_reader, datasets.load), each with
# the names it lists
_NO_CONFIG = re.compile(
    r"Config name is missing\.\s*Please pick one among the available configs: (\[.*?\])"
)
_UNKNOWN_CONFIG = re.compile(r"BuilderConfig '.*?' not found\. Available: (\[.*?\])")
_UNKNOWN_SPLIT = re.compile(r'Unknown split ".*?"\. Should be one of (\[.*?\])')
_SAVED_TO_DISK = "saved using `save_to_disk`"


def not_loaded(source: str, spec: tuple[str, str | None, str], err: BaseException) -> ValueError:
    """One line for ``hf:`` source ``source`` (``spec``: its path, config and split) that
    ``datasets`` could not load with ``err``: the spec to write where ``err`` says what the
    dataset has, else its first line."""
    message = str(err)
    path, config, split = spec
    if type(err).__name__ == "RevisionNotFoundError":  # huggingface_hub's, for an @REVISION
        revision = hub_spec(source).revision
        return ValueError(
            f"{source}: {path} has no revision {revision!r} (a tag, branch or commit of its "
            f"repository); name one it has, or leave @{revision} out to read its main"
        )
    if _SAVED_TO_DISK in message:
        return ValueError(
            f"{source}: {path} is a folder Dataset.save_to_disk wrote, which is read as no "
            "dataset; write its rows to a file (Dataset.to_parquet('train.parquet')) and give "
            "that file"
        )
    configs = _names(_NO_CONFIG, message)
    if configs and split in configs:
        return ValueError(
            f"{source}: {split} is a config of {path} and the spec names no split; write "
            f"hf:{path}:{split}:SPLIT, e.g. hf:{path}:{split}:train"
        )
    if configs:
        return ValueError(
            f"{source}: {path} has configs {', '.join(configs)} and the spec names none; "
            f"write hf:{path}:CONFIG:SPLIT, e.g. hf:{path}:{configs[0]}:{split}"
        )
    configs = _names(_UNKNOWN_CONFIG, message)
    if configs:
        return ValueError(
            f"{source}: {path} has no config {config!r}; its configs are "
            f"{', '.join(configs)}: write e.g. hf:{path}:{configs[0]}:{split}"
        )
    splits = _names(_UNKNOWN_SPLIT, message)
    if splits:
        named = f"{config}:" if config else ""
        return ValueError(
            f"{source}: {path} has no split {split!r}; its splits are {', '.join(splits)}: "
            f"write e.g. hf:{path}:{named}{splits[0]}"
        )
    return ValueError(
        f"{source}: cannot load from the hub ({message.splitlines()[0]}); use a local file"
    )


def _names(pattern: re.Pattern[str], message: str) -> list[str]:
    """The names ``message`` lists where ``pattern`` matches it (none: no match)."""
    found = pattern.search(message)
    if found is None:
        return []
    try:
        names = ast.literal_eval(found.group(1))
    except (ValueError, SyntaxError):
        return []
    return [str(name) for name in names] if isinstance(names, list) else []
