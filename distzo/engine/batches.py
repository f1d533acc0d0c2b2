"""What the engine reads of a batch: its token counts, whether it fits the model, and its
tensors on the device."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from distzo.config.field_types import whole_number

# the dtypes an embedding looks token ids up with
ID_DTYPES = (torch.int64, torch.int32)


def count_tokens(batch: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """(input tokens, label tokens) of a batch, counted where it lies (no device sync for
    a batch on the host). Labels default as in a plain causal LM: every real token.

    The label count of the *global* batch is what each rank passes as ``num_items`` so
    that its loss is a share of the global mean.
    """
    input_ids, mask, labels = batch["input_ids"], batch.get("attention_mask"), batch.get("labels")
    tokens = int(mask.sum()) if mask is not None else input_ids.numel()
    if labels is not None:
        return tokens, int((labels[..., 1:] != -100).sum())
    return tokens, int(mask[..., 1:].sum()) if mask is not None else input_ids[..., 1:].numel()


def global_items(
    objective: Any, batch: Mapping[str, torch.Tensor], num_items: int | None, dp: int
) -> int:
    """What a step's losses are divided by: ``num_items`` as given, else this batch's count
    (``objective.num_items``), which is the global batch's only without data parallelism.
    Under ``dp`` ranks each share divided by its own count would add up to ``dp`` times
    the mean in the all-reduce, a silently larger loss and ``g``, so the count must be
    given."""
    if num_items is not None:
        # a float (a count divided by dp) or a bool scaled the loss and g without a word
        count = whole_number(num_items)
        if count is None or count < 0:  # a negative one said "the batch has nothing to train on"
            raise ValueError(
                f"num_items must be a whole count of label tokens or examples, got "
                f"{num_items!r}; pass the global batch's count, an int >= 0"
            )
        return count
    if dp > 1:
        raise ValueError(
            f"step: under data parallelism (dp {dp}) each rank holds a share of the "
            "batch; pass num_items, the global batch's count (label tokens or examples: "
            "engine.objective.num_items(global_batch))"
        )
    return objective.num_items(batch)


def check_mapping(batch: object) -> None:
    """Refuse a batch that is not a mapping of tensors (a bare ``input_ids`` tensor failed
    deep in torch's ``Tensor.__contains__``)."""
    if not isinstance(batch, Mapping):
        raise ValueError(
            f"a batch is a mapping of tensors, {{'input_ids': ids, ...}}; got a "
            f"{type(batch).__name__}: pass {{'input_ids': ...}}"
        )


def check_batch(
    batch: Mapping[str, torch.Tensor],
    limit: int | None,
    prefix: int,
    vocab: int | None = None,
    dims: int = 2,
    reserved: int = 0,
) -> None:
    """Refuse a batch without token ids, with sequences longer than the model's ``limit``
    of positions once the ``reserved`` rows before a first token (RoBERTa's) and a
    ``prefix``-token prefix take the first ones, or (ids on the host:
    no device read) with ids outside a ``vocab``-row embedding, which a lookup in
    vocabulary slices would not catch: caught here, before any block has been updated.
    ``dims``: the objective's ``input_ids`` dimensions (2, batch x sequence; a choice
    objective's 3, examples x candidate rows x sequence), which its mask and labels share."""
    if "input_ids" not in batch:
        raise ValueError("a batch needs 'input_ids' (and optionally 'attention_mask', 'labels')")
    ids = batch["input_ids"]
    # an embedding looks up int64 or int32 ids only: another dtype (uint8, bool) would fail
    # inside the pass, where the engine counts it as a half-applied update
    if not isinstance(ids, torch.Tensor) or ids.dim() != dims or ids.dtype not in ID_DTYPES:
        described = f"{ids.dim()}-D {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids)
        layout = "batch x sequence" if dims == 2 else "examples x candidates x sequence"
        raise ValueError(
            f"input_ids must be a {dims}-D tensor of int64 or int32 token ids ({layout}), "
            f"got {described}"
        )
    for name in ("attention_mask", "labels"):
        other = batch.get(name)
        if other is not None and (not isinstance(other, torch.Tensor) or other.shape != ids.shape):
            shape = tuple(other.shape) if isinstance(other, torch.Tensor) else type(other)
            hint = (  # the same positions for either kind of model: no shift by the caller
                "; labels are token ids at input_ids' own positions (-100 where no loss is "
                "taken): a causal LM's loss shifts them itself, a masked LM's reads each "
                "where it stands"
                if name == "labels"
                else ""
            )
            raise ValueError(
                f"{name} must have input_ids' shape {tuple(ids.shape)}, got {shape}{hint}"
            )
    if vocab is not None and ids.device.type == "cpu" and ids.numel():
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise ValueError(
                f"token id {bad} is outside the model's vocabulary of {vocab}; "
                "tokenize with the model's own tokenizer"
            )
    length = ids.shape[-1]
    if limit is not None and length + prefix + reserved > limit:
        after = f" after a {prefix}-token prefix" if prefix else ""
        less = f" less the {reserved} it keeps before a first token" if reserved else ""
        raise ValueError(
            f"sequences of {length} tokens{after} exceed the model's "
            f"max_position_embeddings {limit}{less}; truncate them"
        )


def on_device(
    batch: Mapping[str, torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """input_ids, attention_mask and labels (None if absent) on the device, copied without
    making the host wait."""

    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return t.to(device, non_blocking=True) if t is not None else None

    return (
        batch["input_ids"].to(device, non_blocking=True),
        move(batch.get("attention_mask")),
        move(batch.get("labels")),
    )
