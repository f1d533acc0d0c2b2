"""Where a model's weights come from when it is never materialised whole.

The model is built as a skeleton (parameters on the meta device, small buffers such as
rotary tables real), and the engine asks a ``WeightSource`` for each bucket's tensors,
one bucket at a time, straight into the host copies: the peak is the resident part plus
one block, never the model twice.

* ``SafetensorsWeights``: a Hugging Face directory with ``model.safetensors`` or
  sharded ``model-XXXXX-of-YYYYY.safetensors`` + ``model.safetensors.index.json``;
  tensors are read one at a time (memory-mapped).
* ``TorchBinWeights``: ``pytorch_model.bin`` (or sharded ``.bin`` + index), loaded with
  ``torch.load(weights_only=True, mmap=True)``: no unpickling of code, but a shard's
  tensors are mapped at once, so it is the slower, more memory-hungry path; one shard
  is mapped at a time.
* ``RandomWeights``: random init without a checkpoint (benchmarks, memory checks),
  each tensor seeded by its name, so every rank draws the same weights.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import zipfile
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from types import MappingProxyType, SimpleNamespace
from typing import Any, Protocol

import torch
from torch import nn
from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel
from transformers.utils import GENERATION_CONFIG_NAME

from distzo.models.converted_keys import Converted, key_conversions
from distzo.runtime import json_text
from distzo.runtime.file_state import file_state


class WeightSource(Protocol):
    def tensor(
        self, names: tuple[str, ...], shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor: ...

    def tensor_range(
        self,
        names: tuple[str, ...],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        start: int,
        stop: int,
    ) -> torch.Tensor:
        """Elements [start, stop) of the flattened tensor (a sliced rank's own piece)."""
        ...


# What a model reads from its source: each distinct parameter's names (a tied weight's
# aliases together, as the engine's buckets name it) and shape.
Expected = Sequence[tuple[tuple[str, ...], tuple[int, ...]]]
# Of a checkpoint's tensors that no parameter takes, those that are not the model's
# (``unexpected_keys``): what a checkpoint of a larger model holds beyond its config.json.
Unexpected = Callable[[set[str]], set[str]]
# Reads a checkpoint file's tensors' names and shapes (no data).
Header = Callable[[Path], dict[str, tuple[int, ...]]]


def parameter_names(model: nn.Module) -> dict[int, tuple[str, ...]]:
    """Every name of each parameter, by ``id``: a tied weight is one entry with all its
    names (the embedding's first, as ``named_parameters`` meets it)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {k: tuple(v) for k, v in names.items()}


def expected_tensors(model: nn.Module) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    """Each distinct parameter of ``model`` (a skeleton) as its source is asked for it."""
    names = parameter_names(model)
    unique = {id(p): p for p in model.parameters()}
    return [(names[key], tuple(p.shape)) for key, p in unique.items()]


def check_weights(weights: WeightSource | None, model: nn.Module) -> None:
    """Refuse a source whose tensors are not ``model``'s, before any is read: a checkpoint
    tells from its files' headers (``HeaderChecked.check_shapes``: a safetensors header, a
    ``.bin``'s pickle, mapped without its data); random weights are checked as each
    tensor is drawn. A checkpoint of another model than its config.json's (an edited or swapped
    config, a shard of another model) then fails in a second, not after the memory plan
    and every block but the last were read (minutes for a large model); so does one that
    holds more than the model takes (more layers than config.json's), which would
    otherwise train the model config.json describes and drop the rest without a word."""
    convert = getattr(weights, "convert_keys", None)
    if convert is not None:
        convert(model)  # a mixture's experts stored one a key (the Python API's source)
    check = getattr(weights, "check_shapes", None)
    if check is not None:
        check(expected_tensors(model), functools.partial(unexpected_keys, model))


def unexpected_keys(model: nn.Module, names: set[str]) -> set[str]:
    """Those of ``names`` (a checkpoint's tensors that no parameter of ``model`` takes)
    that a transformers load reports as unexpected: not a persistent buffer of the model
    (under its name or a base model's, as ``_pick`` reads), nor a key the model's class
    ignores, by transformers' own rule (``_keys_to_ignore_on_load_unexpected``, such as
    GPT-2's ``attn.bias``, and the ``rotary_emb.inv_freq`` of old Llama checkpoints), nor
    a tensor of a part the model's class leaves out (``left_out``)."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    buffers = set(model.state_dict()) - params
    buffers = {form for name in buffers for form in _forms(name)}
    info = SimpleNamespace(missing_keys=set(), unexpected_keys=names - buffers)
    adjust = getattr(model, "_adjust_missing_and_unexpected_keys", None)
    if adjust is not None:  # a transformers model: its class's patterns, filtered in place
        adjust(info)
    return {name for name in info.unexpected_keys if not left_out(model, name)}


def left_out(model: nn.Module, name: str) -> bool:
    """Whether checkpoint tensor ``name`` belongs to a part that ``model``'s class sets to
    None: ``RobertaForMaskedLM`` builds its body without the pooler (``roberta.pooler``),
    which a checkpoint of the pretrained encoder holds. The head never reads it, so
    training and the export are the same without it (transformers 4 ignored the pooler by
    pattern; 5 loads the model and reports the keys); a checkpoint of more layers than
    config.json's is refused still, as its layers are parts the model has no place for."""
    for root in (model, getattr(model, "base_model", None)):  # its name, or a base model's
        held: Any = root
        for part in name.split(".")[:-1]:
            if held is None or not hasattr(held, part):
                break
            held = getattr(held, part)
            if held is None:
                return True
    return False


def _flat_range(full: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return full.reshape(-1)[start:stop]


def skeleton(config: PretrainedConfig, dtype: torch.dtype) -> nn.Module:
    """The model with its parameters on the meta device (no memory) and buffers real.

    Each parameter is reserved on the host (never touched) before it moves to the meta
    device, so a config.json whose sizes the host cannot even reserve (a vocabulary of
    2^40), or no tensor has (negative, overflowing), fails here: one line naming the
    config, not the allocator's traceback."""
    from accelerate import init_empty_weights

    from distzo.models.registry import auto_class

    loader = auto_class(config.model_type)
    try:
        with init_empty_weights(include_buffers=False):
            model = loader.from_config(config, dtype=dtype)
    except (RuntimeError, AssertionError) as err:  # torch's allocator or size checks
        where = getattr(config, "name_or_path", "") or config.model_type
        raise ValueError(
            f"{where}: its config's sizes make a tensor no host can hold "
            f"({str(err).splitlines()[0]}); is its config.json damaged?"
        ) from None
    model.tie_weights()  # the meta registration leaves tied heads as separate parameters
    return model


def with_generation_config(model: nn.Module, source: Path) -> nn.Module:
    """``model`` (a skeleton of ``source``'s config) with ``source``'s own generation config,
    where it has one: a skeleton derives one from config.json, which loses the sampling
    settings and a list of end-of-sequence tokens (Llama 3's ``<|eot_id|>``), and the
    export writes what the model holds."""
    if isinstance(model, PreTrainedModel) and (Path(source) / GENERATION_CONFIG_NAME).is_file():
        model.generation_config = GenerationConfig.from_pretrained(source)
    return model


def declared_stop_ids(model: nn.Module, special: Collection[int] = ()) -> tuple[int, ...]:
    """The end-of-sequence tokens ``model``'s generation config lists (where ``generate``
    stops). Where that config was derived from config.json, only those of them that are
    ``special`` tokens of the tokenizer: a checkpoint without generation_config.json stops
    ``generate`` at its config.json's list (Gemma 3's ``<eos>`` and ``<end_of_turn>``), but
    an architecture's default ``eos_token_id`` read through another tokenizer (a random-init
    shape's) is a plain character there, where no answer should end."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return ()
    eos = config.eos_token_id
    listed = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
    if getattr(config, "_from_model_config", False):
        return tuple(token for token in listed if token in special)
    return listed


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of ``tokenizer``'s special tokens, its added ones included (an instruct
    model's end-of-turn token), or none without a tokenizer."""
    if tokenizer is None:
        return frozenset()
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return frozenset(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}


def _pick(names: tuple[str, ...], available) -> str:
    """The alias under which a (possibly tied) parameter was saved: by its own name, or as
    a base model saved it (without the ``model.`` or ``transformer.`` prefix, as
    ``facebook/opt-*`` and ``openai-community/gpt2`` ship theirs; transformers strips the
    prefix when it loads them too)."""
    for keys in zip(*map(_forms, names), strict=True):  # own names first, then unprefixed
        for key in keys:
            if key in available:
                return key
    aliases = f" (nor its aliases {list(names[1:])})" if len(names) > 1 else ""
    raise ValueError(f"the checkpoint has no tensor for {names[0]}{aliases}")


_FIX = "the weights and config.json are of different models; download or copy the model again"
# The dtypes a safetensors header names, as torch's (the floating ones a checkpoint holds).
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _forms(name: str) -> tuple[str, str]:
    """The keys a checkpoint may hold a parameter under (``_pick``): its name, or a base
    model's (without the ``model.`` or ``transformer.`` prefix)."""
    return name, name.partition(".")[2]


def _natural(name: str) -> list[Any]:
    """A sort key that puts layer 2 before layer 10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _check(name: str, got: tuple[int, ...], shape: tuple[int, ...], file: Path) -> None:
    """A tensor of ``file`` has the shape the model (built from config.json) expects: one
    that disagrees means the weights and the config are of different models."""
    if tuple(got) != tuple(shape):
        raise ValueError(
            f"{file}: checkpoint tensor {name} has shape {tuple(got)}, the model expects "
            f"{tuple(shape)} from {file.parent / 'config.json'}: {_FIX}"
        )


def check_may_read(path: Path) -> None:
    """A weights file this user may not read is one line saying so: safetensors called it
    missing ("No such file or directory", a traceback) and torch a damaged archive. A model
    a colleague saved often holds one: safetensors writes its files private to their owner,
    whatever the umask."""
    if not os.access(path, os.R_OK) and path.exists():
        raise ValueError(
            f"{path}: no permission to read it; its owner can share it (chmod a+r), or copy "
            "the model to a folder you may read"
        )


@contextlib.contextmanager
def safetensors_file(path: Path) -> Iterator[Any]:
    """``safe_open`` with safetensors' own error (a garbage or truncated file: its header
    does not cover the file) as one line naming the file, rather than a traceback; so too
    a file this user may not read (``check_may_read``)."""
    from safetensors import SafetensorError, safe_open

    check_may_read(path)
    try:
        handle = safe_open(str(path), "pt")
    except SafetensorError as err:
        raise ValueError(
            f"{path}: not a readable safetensors file ({err}); download or export it again"
        ) from None
    with handle:
        yield handle


def safetensors_header(path: Path) -> Mapping[str, tuple[int, ...]]:
    """The tensors of a safetensors file and their shapes, from its header (no data), read
    once per state of the file in a process: a job checks a checkpoint when it starts (each
    file opens), builds the model (the shapes are config.json's) and builds the engine
    (the same, with an adapter), and each of those read every shard's header again. A
    damaged file is ``safetensors_file``'s one line."""
    return _once_per_state(_safetensors_header, path)


def _safetensors_header(path: Path) -> dict[str, tuple[int, ...]]:
    with safetensors_file(path) as handle:
        return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}


def _once_per_state(read: Header, path: Path) -> Mapping[str, tuple[int, ...]]:
    """``read(path)``, read once per state of the file (device, inode, size, mtime): a
    file rewritten in place, even under its inode, is read again."""
    return _cached(read, str(path), *file_state(path.stat()))


@functools.lru_cache(maxsize=4096)  # files: a 405B model has 191; a header is kilobytes
def _cached(read: Header, path: str, *state: int) -> Mapping[str, tuple[int, ...]]:
    """``_once_per_state`` for the file in ``state``."""
    return MappingProxyType(read(Path(path)))


def torch_bin_file(path: Path) -> dict[str, torch.Tensor]:
    """A ``pytorch_model.bin`` (shard) as ``torch.load(weights_only=True, mmap=True)`` maps
    it: no unpickling of code, the tensors mapped, not read. A garbage or truncated file
    (not the zip archive torch.save writes, or one whose records do not hold together) is
    one line naming the file, rather than torch's traceback or an OSError that would read
    as a failed write; so too a file this user may not read (``check_may_read``)."""
    check_may_read(path)
    if not zipfile.is_zipfile(path):  # torch.load would say "mmap can only be used ..."
        reason = "not the zip archive torch.save writes: damaged, truncated, or pre-1.6 torch"
    else:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as err:  # miniz, pickle or weights-only errors: damage, whichever
            text = str(err) or type(err).__name__
            code = re.search(r"Unsupported global: GLOBAL (\S+)", text)
            reason = (
                f"it pickles code, {code.group(1)}, which weights-only loading never runs"
                if code
                else text.splitlines()[0].split(". ")[0]
            )
    raise ValueError(
        f"{path}: not a readable PyTorch weights file ({reason}); download or export it again"
    )


def torch_bin_header(path: Path) -> Mapping[str, tuple[int, ...]]:
    """The tensors of a ``.bin`` file and their shapes, from its mapping (``torch_bin_file``:
    the pickle read, no tensor data), once per state of the file in a process, as
    ``safetensors_header``."""
    return _once_per_state(_bin_header, path)


def _bin_header(path: Path) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in torch_bin_file(path).items()}


def weight_map(index: Path) -> dict[str, str]:
    """A sharded model's index: each tensor's file. A torn or foreign index (not JSON, no
    ``weight_map`` of names to files) is one line naming it, not a bare JSON error or a
    ``KeyError`` traceback."""
    fix = "download or copy the model again"
    try:
        data = json_text.loads(index.read_text())
    except OSError as err:  # a folder of that name, a file it may not read
        raise ValueError(f"{index}: cannot read it ({err.strerror}); {fix}") from None
    except ValueError as err:  # not UTF-8, not JSON
        raise ValueError(f"{index}: not a model index (not JSON: {err}); {fix}") from None
    found = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(found, dict) or not all(isinstance(f, str) for f in found.values()):
        raise ValueError(f"{index}: holds no weight_map of tensor names to files; {fix}")
    outside = next((file for file in found.values() if _outside(file)), None)
    if outside is not None:  # an index someone handed the user, reading a file elsewhere
        raise ValueError(
            f"{index}: names {outside!r}, a file outside the model's folder (an index "
            f"names its folder's own shards); {fix}"
        )
    return found


def _outside(file: str) -> bool:
    """Whether a shard name an index gives leads out of the index's folder (absolute, or
    through ``..``); the files themselves may be links (the hub cache's are)."""
    path = PurePosixPath(file.replace("\\", "/"))
    return path.is_absolute() or ".." in path.parts


def _weight_files(directory: Path, index: str, single: str) -> list[str] | None:
    """The files of a model's weights in one format: those its index names, or the single
    file (None: the directory has neither). A file the index names that is not there is
    one line (an interrupted download), not a traceback or a "damaged" file."""
    if (directory / index).exists():
        files = sorted(set(weight_map(directory / index).values()))
        missing = [file for file in files if not (directory / file).is_file()]
        if missing:
            raise ValueError(
                f"{directory}: {index} names {missing[0]}"
                f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}, which is "
                "missing; download or copy the model again"
            )
        return files
    return [single] if (directory / single).exists() else None


def check_readable(directory: Path) -> None:
    """Every weights file of a local model opens, in the format ``open_checkpoint`` picks
    (a safetensors header checked against the file's size, a ``.bin`` mapped by
    ``torch.load``): damage stops a job before it builds anything, with the file named."""
    files = _weight_files(directory, "model.safetensors.index.json", "model.safetensors")
    if files is not None:
        for file in files:
            safetensors_header(directory / file)  # kept: the later checks read no header
        return
    for file in _weight_files(directory, "pytorch_model.bin.index.json", "pytorch_model.bin") or ():
        torch_bin_header(directory / file)  # none: open_checkpoint says so


class HeaderChecked(ABC):
    """A checkpoint whose tensors' names and shapes are known before any is read (a
    safetensors header, a ``.bin``'s pickle): ``check_shapes`` against the model's."""

    index_name: str  # the sharded form's index
    single_name: str  # the one file of the unsharded form

    def __init__(self, directory: Path) -> None:
        index = directory / self.index_name
        if index.exists():
            names = weight_map(index)
        else:
            single = directory / self.single_name
            names = dict.fromkeys(self._header(single), single.name)
        self.directory = directory
        self.files = dict(names)  # every key's file, as stored
        self.weight_map = names  # every tensor's file
        # a parameter's key in the files where it differs from its name (``language_model``)
        self.stored: dict[str, str] = {}
        self.left_alone: frozenset[str] = frozenset()  # the files' keys no parameter reads
        # parameters built from several stored tensors (a mixture's experts, one a key)
        self.converted: dict[str, Converted] = {}
        # the converted parameter whose ranges are being read, by (name, dtype)
        self._built: tuple[tuple[str, torch.dtype], torch.Tensor] | None = None

    def convert_keys(self, model: nn.Module) -> None:
        """Read ``model``'s parameters that transformers loads from keys of other names, or
        builds from several (``distzo.models.converted_keys``: the experts of a mixture,
        stored one expert a key), as it loads them; the other keys as they are."""
        if not isinstance(model, PreTrainedModel):
            return
        found = key_conversions(model, self.weight_map)
        parts = found.part_keys()
        for name, key in found.renamed.items():
            self.weight_map[name] = self.weight_map.pop(key)
        for name, converted in found.converted.items():
            self.weight_map[name] = self.files[converted.keys()[0]]
        self.weight_map = {k: f for k, f in self.weight_map.items() if k not in parts}
        self.stored.update(found.renamed)
        self.converted.update(found.converted)
        self.left_alone = self.left_alone | parts

    def _converted(
        self, name: str, shape: tuple[int, ...], read: Callable[[str], torch.Tensor]
    ) -> torch.Tensor:
        """Converted parameter ``name`` built from its stored tensors (each ``read(key)``:
        its data, or a meta tensor of its header's shape), checked against ``shape``."""
        converted = self.converted[name]
        keys = converted.keys()
        file = self.directory / self.files[keys[0]]
        try:
            value = converted.build(read)
        except RuntimeError as err:  # a missing expert, experts of different shapes
            counts = " and ".join(f"{len(k)} {p}" for p, k in converted.parts.items())
            raise ValueError(
                f"{file}: {name} is built from its tensors {counts}, which do not fit "
                f"together ({str(err).splitlines()[0]}): {_FIX}"
            ) from None
        what = f"{name} (built from {len(keys)} tensors: {keys[0]}, ...)"
        _check(what, tuple(value.shape), shape, file)
        return value

    def tensor_range(
        self,
        names: tuple[str, ...],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        start: int,
        stop: int,
    ) -> torch.Tensor:
        """Elements [start, stop) of the parameter ``names`` name, flattened: a converted
        one's from its build (all its tensors: the experts are stacked first), kept for
        its next range; any other's as the format reads a range, the build let go."""
        name = _pick(names, self.weight_map)
        if name in self.converted:
            return self._converted_range(names, shape, dtype, start, stop)
        self._built = None
        return self._stored_range(name, shape, dtype, start, stop)

    @abstractmethod
    def _stored_range(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, start: int, stop: int
    ) -> torch.Tensor:
        """Elements [start, stop) of parameter ``name`` as stored under its key."""

    def _converted_range(
        self,
        names: tuple[str, ...],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        start: int,
        stop: int,
    ) -> torch.Tensor:
        """Elements [start, stop) of a converted parameter, built once for the ranges a rank
        reads of it in turn (a sliced rank reads its pieces a chunk at a time: built anew
        for each, a layer's experts were read from disk as many times), and let go once its
        last element is read, or another parameter's."""
        if self._built is None or self._built[0] != (names[0], dtype):
            self._built = None  # built anew: the previous one goes first
            built = self._converted(_pick(names, self.weight_map), shape, self.stored_tensor)
            self._built = ((names[0], dtype), built.to(dtype))
        full = self._built[1]
        if stop >= full.numel():
            self._built = None
        return _flat_range(full, start, stop)

    def _header_meta(self, key: str) -> torch.Tensor:
        """A meta tensor of the shape stored under ``key``, from its file's header."""
        path = self.directory / self.files[key]
        header = self._header(path)
        if key not in header:
            raise ValueError(
                f"{path}: holds no tensor {key}, which {self.index_name} places there; "
                "download or copy the model again"
            )
        return torch.empty(header[key], device="meta")

    def language_model(self, stored: Mapping[str, str], left_alone: set[str]) -> None:
        """Read the text model of a multimodal checkpoint (``distzo.models.multimodal``):
        each of its parameters under the key ``stored`` gives, and the keys ``left_alone``
        (the vision tower, the projector) neither read nor counted as unexpected."""
        renamed = {key: name for name, key in stored.items()}
        self.weight_map = {
            renamed.get(key, key): file
            for key, file in self.weight_map.items()
            if key not in left_alone
        }
        self.stored, self.left_alone = dict(stored), frozenset(left_alone)

    def _key(self, name: str) -> str:
        """The key under which parameter ``name`` is stored."""
        return self.stored.get(name, name)

    @abstractmethod
    def _header(self, path: Path) -> Mapping[str, tuple[int, ...]]:
        """The names and shapes of the tensors of one of the checkpoint's files."""

    @abstractmethod
    def stored_tensor(self, key: str) -> torch.Tensor:
        """The tensor stored under ``key``, in its own dtype (what an export copies as it is:
        a multimodal checkpoint's vision tower)."""

    def stored_meta(self, key: str) -> torch.Tensor:
        """A meta tensor of the shape and dtype stored under ``key``: what an export plans
        its shards by, the data left unread where the format allows."""
        return torch.empty_like(self.stored_tensor(key), device="meta")

    def check_stored(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """The tensors stored under ``shapes``' keys, which no parameter reads (a multimodal
        checkpoint's vision tower, which its export copies), are where the index places
        them, with those shapes, from their files' headers: else the export would fail, or
        write a model transformers refuses to load, after the training."""
        by_file: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
        for key, shape in shapes.items():
            by_file.setdefault(self.files[key], []).append((key, shape))
        for file, wanted in by_file.items():
            self._check_file(self.directory / file, wanted)

    def check_shapes(self, expected: Expected, unexpected: Unexpected | None = None) -> None:
        """Every tensor ``expected`` names is in a file, with the shape expected, through
        the names ``tensor`` resolves (aliases, tied heads, a base model's unprefixed keys);
        the first tensor that disagrees or is missing is named, with its file. Then the
        tensors none of those names takes, where ``unexpected`` keeps any (a checkpoint of
        more layers than config.json's), are refused. Each header is read once a process
        (names and shapes, no data)."""
        by_file: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
        for names, shape in expected:
            name = self._held(names)
            if name in self.converted:
                self._converted(name, shape, self._header_meta)
                continue
            by_file.setdefault(self.weight_map[name], []).append((name, shape))
        held = dict(self.weight_map)  # each tensor's file: the index's, and the headers'
        renamed = {key: name for name, key in self.stored.items()}
        for file, wanted in by_file.items():
            header = self._check_file(self.directory / file, wanted)
            held.update(
                (renamed.get(key, key), file) for key in header if key not in self.left_alone
            )
        if unexpected is not None:
            self._check_nothing_more(held, expected, unexpected)

    def _check_file(
        self, path: Path, wanted: list[tuple[str, tuple[int, ...]]]
    ) -> Mapping[str, tuple[int, ...]]:
        """The tensors ``wanted`` of one file, checked against its header (returned)."""
        header = self._header(path)
        for name, shape in wanted:
            key = self._key(name)
            if key not in header:  # an index that places it in a shard without it
                raise ValueError(
                    f"{path}: holds no tensor {key}, which {self.index_name} "
                    "places there; download or copy the model again"
                )
            _check(key, header[key], shape, path)
        return header

    def _check_nothing_more(
        self, held: dict[str, str], expected: Expected, unexpected: Unexpected
    ) -> None:
        """Refuse the checkpoint's tensors (``held``: name -> file) that no parameter takes
        and ``unexpected`` keeps, naming a few, their count and the fix: a model built from
        config.json would train without them, and its export would lack them."""
        taken = {form for names, _ in expected for name in names for form in _forms(name)}
        extra = sorted(unexpected({name for name in held if name not in taken}), key=_natural)
        if not extra:
            return
        shown = ", ".join(extra[:3]) + (f" and {len(extra) - 3} more" if len(extra) > 3 else "")
        raise ValueError(
            f"{self.directory / held[extra[0]]}: holds {len(extra)} tensor"
            f"{'s' if len(extra) > 1 else ''} the model built from "
            f"{self.directory / 'config.json'} has no place for ({shown}), which training "
            "would drop: the weights are of a larger model than config.json describes (more "
            "layers?); give the folder the config.json of the model the weights are"
        )

    def _held(self, names: tuple[str, ...]) -> str:
        """``_pick``, its error naming the folder, the config.json and the fix."""
        try:
            return _pick(names, self.weight_map)
        except ValueError as err:
            raise ValueError(
                f"{self.directory}: {err}, which the model built from "
                f"{self.directory / 'config.json'} has: {_FIX}"
            ) from None


class SafetensorsWeights(HeaderChecked):
    index_name = "model.safetensors.index.json"
    single_name = "model.safetensors"

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self._open = safetensors_file

    def _header(self, path: Path) -> Mapping[str, tuple[int, ...]]:
        return safetensors_header(path)

    def tensor(self, names, shape, dtype):
        # One mapping per tensor, closed at once: pages read from a file mapping that stays
        # open count as this process's memory, which would add up to the whole checkpoint.
        name = _pick(names, self.weight_map)
        if name in self.converted:
            return self._converted(name, shape, self.stored_tensor).to(dtype=dtype, copy=True)
        file, key = self.directory / self.weight_map[name], self._key(name)
        with self._open(file) as handle:
            value = handle.get_tensor(key)
            _check(key, tuple(value.shape), shape, file)
            return value.to(dtype=dtype, copy=True)

    def stored_tensor(self, key: str) -> torch.Tensor:
        with self._open(self.directory / self.files[key]) as handle:
            return handle.get_tensor(key)

    def stored_meta(self, key: str) -> torch.Tensor:
        """From the file's header alone (a dtype safetensors names that torch lacks: read)."""
        with self._open(self.directory / self.files[key]) as handle:
            piece = handle.get_slice(key)
            dtype = SAFETENSORS_DTYPES.get(piece.get_dtype())
            if dtype is not None:
                return torch.empty(piece.get_shape(), dtype=dtype, device="meta")
        return super().stored_meta(key)

    def _stored_range(self, name, shape, dtype, start, stop):
        """Reads only the rows that hold elements [start, stop)."""
        row = 1
        for size in shape[1:]:
            row *= size
        first, last = start // row, -(-stop // row)
        file, key = self.directory / self.weight_map[name], self._key(name)
        with self._open(file) as handle:
            piece = handle.get_slice(key)
            _check(key, tuple(piece.get_shape()), shape, file)
            rows = piece[first:last].reshape(-1)
            return rows[start - first * row : stop - first * row].to(dtype=dtype, copy=True)


class TorchBinWeights(HeaderChecked):
    index_name = "pytorch_model.bin.index.json"
    single_name = "pytorch_model.bin"

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self._open: tuple[str, dict[str, torch.Tensor]] | None = None  # the one mapped shard

    def _header(self, path: Path) -> Mapping[str, tuple[int, ...]]:
        return torch_bin_header(path)

    def _shard(self, file: str) -> dict[str, torch.Tensor]:
        """``file`` mapped, and the shard mapped before released: buckets are read in the
        checkpoint's order, so one shard at a time, never the whole checkpoint, stays
        mapped (its pages counted against the host's memory while read)."""
        if self._open is None or self._open[0] != file:
            self._open = None
            self._open = (file, torch_bin_file(self.directory / file))
        return self._open[1]

    def tensor(self, names, shape, dtype):
        name = _pick(names, self.weight_map)
        if name in self.converted:
            return self._converted(name, shape, self.stored_tensor).to(dtype)
        file, key = self.weight_map[name], self._key(name)
        state = self._shard(file)
        _check(key, tuple(state[key].shape), shape, self.directory / file)
        return state[key].to(dtype)

    def stored_tensor(self, key: str) -> torch.Tensor:
        return self._shard(self.files[key])[key].clone()

    def _stored_range(self, name, shape, dtype, start, stop):
        """Only [start, stop) converted: a rank reads a tensor in chunks, and converting it
        whole for each (fp16 weights into float32 masters) cost a float32 copy of the
        tensor per chunk, as many times over as it has chunks."""
        file, key = self.weight_map[name], self._key(name)
        stored = self._shard(file)[key]
        _check(key, tuple(stored.shape), shape, self.directory / file)
        return _flat_range(stored, start, stop).to(dtype)


DEVICE_DRAW_CHUNK = 1 << 24  # Gaussians a device draws at a time: 64 MB of float32 staging


class RandomWeights:
    """Matrices ~ N(0, std), biases 0, norm scales 1 (the usual initialisation).

    ``draw_dtype``: the dtype the Gaussians are drawn in, then rounded to the tensor's
    (default: the tensor's own, which a recorded run's replay relies on). Drawing fp16 or
    bf16 Gaussians on the host goes through torch's scalar path, in 16-bit arithmetic;
    float32 takes the vectorised one (a benchmark's model, whose values do not matter,
    builds faster: with OPT-1.3B's masters in fp16, a benchmark's engine took 74 s to build
    on an H100 machine's host; in float32, 22 s).

    ``draw_device``: draw there instead, ``DEVICE_DRAW_CHUNK`` at a time with that device's
    generator, each chunk rounded there (other values than the host's draw, for a
    benchmark). The host's generator draws ~2e8 float32 Gaussians a second on one thread:
    OPT-30B's 30e9 would be 2.5 minutes of every build; a GPU draws them in well under a
    second. A range read (``tensor_range``) keeps the tensor on the device while its
    ranges are read, so that only those cross to the host, into the reader's reused
    buffer: drawn into a fresh host tensor, every element cost the host a new page as
    well as the copy. ``tensor`` returns it on the host."""

    def __init__(
        self,
        seed: int,
        std: float = 0.02,
        draw_dtype: torch.dtype | None = None,
        draw_device: torch.device | str | None = None,
    ) -> None:
        self.seed, self.std, self.draw_dtype = seed, std, draw_dtype
        self.draw_device = None if draw_device is None else torch.device(draw_device)
        # the tensor whose ranges are being read, by (name, dtype)
        self._last: tuple[tuple[str, torch.dtype], torch.Tensor] | None = None

    def tensor(self, names, shape, dtype):
        return self._drawn(names, shape, dtype).cpu()

    def _drawn(self, names, shape, dtype) -> torch.Tensor:
        """The tensor, where it is drawn (the draw device, or the host)."""
        name = names[0]
        if len(shape) < 2:
            return (torch.zeros if name.endswith("bias") else torch.ones)(shape, dtype=dtype)
        seed = self.seed * 1_000_003 + zlib.crc32(name.encode())
        if self.draw_device is not None:
            return self._drawn_on_device(seed, shape, dtype)
        generator = torch.Generator().manual_seed(seed)
        drawn = torch.empty(shape, dtype=self.draw_dtype or dtype)
        return drawn.normal_(0.0, self.std, generator=generator).to(dtype)

    def _drawn_on_device(self, seed: int, shape, dtype: torch.dtype) -> torch.Tensor:
        assert self.draw_device is not None
        out = torch.empty(shape, dtype=dtype, device=self.draw_device)
        flat = out.view(-1)
        generator = torch.Generator(self.draw_device).manual_seed(seed)
        size = min(DEVICE_DRAW_CHUNK, flat.numel())
        staging = torch.empty(size, dtype=self.draw_dtype or dtype, device=self.draw_device)
        for lo in range(0, flat.numel(), size):
            chunk = staging[: min(size, flat.numel() - lo)]
            chunk.normal_(0.0, self.std, generator=generator)
            flat[lo : lo + chunk.numel()].copy_(chunk)
        return out

    def tensor_range(self, names, shape, dtype, start, stop):
        # drawn whole (the same on every rank), kept while its ranges are read in turn, and
        # let go once its last element is read (nothing stays on a draw device)
        if self._last is None or self._last[0] != (names[0], dtype):
            self._last = None  # drawn anew: the previous one goes first
            self._last = ((names[0], dtype), self._drawn(names, shape, dtype))
        full = self._last[1]
        if stop >= full.numel():
            self._last = None
        return _flat_range(full, start, stop)


def check_float_weights(quantization: Any, name: str) -> None:
    """Refuse a quantized checkpoint (FP8, GPTQ, AWQ, bitsandbytes) in one line: its tensors
    are codes that only their scales turn into weights, which a streamed read does not
    apply (an FP8 model trained on its raw codes, without a word). ``quantization``: the
    config's ``quantization_config``, a dict or transformers' object, or None."""
    if quantization is None:
        return
    method = (
        quantization.get("quant_method")
        if isinstance(quantization, dict)
        else getattr(quantization, "quant_method", None)
    )
    raise ValueError(
        f"{name}: its weights are quantized ({method or 'quantization_config'}); distzo trains "
        "float weights: give a float16, bfloat16 or float32 checkpoint of the model"
    )


def open_checkpoint(directory: str | Path) -> WeightSource:
    """The weight source of a local Hugging Face directory (safetensors preferred); a
    quantized one refused (``check_float_weights``)."""
    directory = Path(directory)
    if (directory / "config.json").is_file():
        config = json_text.loads((directory / "config.json").read_text())
        check_float_weights(config.get("quantization_config"), str(directory))
    if (directory / "model.safetensors").exists() or (
        directory / "model.safetensors.index.json"
    ).exists():
        return SafetensorsWeights(directory)
    if (directory / "pytorch_model.bin").exists() or (
        directory / "pytorch_model.bin.index.json"
    ).exists():
        return TorchBinWeights(directory)
    raise ValueError(
        f"{directory} holds no model.safetensors(.index.json) or pytorch_model.bin(.index.json)"
    )
