"""What the engine needs from a language model: resident embed/head, and a list of blocks.

An adapter wraps the model's *own* modules; it copies no modeling code. Per-batch
tensors that every block needs (the attention mask in the form the model's
attention implementation expects, position ids, rotary tables) are built once by
``context`` into a ``BatchContext`` the way the model itself builds them, from the
*host* copy of the padding mask: the model's mask builders decide whether a mask is
needed at all by reading the padding mask (``fast_all``), which on a device tensor
would make the host wait for the GPU before a step could queue its work.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask

from distzo.models.prefix import host_prefix_cache
from distzo.runtime.devices import to_device

# The keyword under which the installed transformers' layers and mask builders take a cache:
# 5.24 renamed ``past_key_values`` to ``cache`` (the old name still works there, with a
# FutureWarning on every run, until 5.40); the versions before know only the old name.
CACHE_KEYWORD = (
    "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
)


# What a family's models are, which decides the transformers class that loads them
# (``distzo.models.registry.auto_class``) and what they can be trained on: a causal LM predicts
# the next token (its logits at position t score token t + 1), a masked LM (RoBERTa) the
# token under a ``<mask>`` (its logits at the mask's own position score it).
CAUSAL, MASKED = "causal", "masked"


@dataclass
class BatchContext:
    attention_mask: Any  # whatever the model's mask builder returned (None, a tensor, a BlockMask)
    position_ids: torch.Tensor | None
    extras: dict[str, Any] = field(default_factory=dict)


class ModelFamily(ABC):
    """Splits a Hugging Face language model into embed -> blocks -> head."""

    model_types: ClassVar[tuple[str, ...]] = ()
    lm_kind: ClassVar[str] = CAUSAL  # CAUSAL or MASKED: the one marker every loader reads

    def __init__(self, model: nn.Module) -> None:
        # Typed Any: which submodules (``model.decoder``, ``transformer.h``, ``lm_head``) and
        # config fields a model has is its family's to know, and nn.Module.__getattr__ would
        # type every one of them ``Tensor | Module``.
        self.model: Any = model
        self.check_config(model.config)

    @classmethod
    def token_positions(cls, config: Any) -> int:
        """The positions a sequence's tokens may take: the model's position table less the
        rows it keeps before a first token (``reserved_positions``)."""
        return int(config.max_position_embeddings) - cls.reserved_positions(config)

    @classmethod
    def check_config(cls, config: Any) -> None:
        """Refuse, in one line, a config of the family's model types that is no model
        the adapter runs; the checks read the config alone, before any weights load."""
        return None  # every config of most families

    @classmethod
    def reserved_positions(cls, config: Any) -> int:
        """Rows of the model's position table that come before a sequence's first token
        (none for most: positions count from 0), which a sequence cannot take."""
        return 0

    @property
    def prefix_length(self) -> int:
        """Prefix tuning (``distzo.models.prefix``): how many virtual tokens every layer
        attends to before the batch's own (0: none, or a run capturing their init); the
        masks and positions are built for them as under peft."""
        prefix = getattr(self.blocks()[0], "prefix_tuning", None)
        return 0 if prefix is None or prefix.capture else prefix.length

    @abstractmethod
    def blocks(self) -> list[nn.Module]:
        """The streamed transformer layers, in execution order."""

    @abstractmethod
    def context(
        self,
        attention_mask: torch.Tensor | None,
        shape: tuple[int, int],
        device: torch.device,
        dtype: torch.dtype,
    ) -> BatchContext:
        """The per-batch tensors of a ``shape`` (rows, length) batch on ``device``, from
        the padding mask on the host (None: every position is real). No device reads."""

    @abstractmethod
    def embed(self, input_ids: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        """Token ids -> the first block's input."""

    @abstractmethod
    def block_forward(
        self, block: nn.Module, hidden: torch.Tensor, ctx: BatchContext
    ) -> torch.Tensor:
        """One layer, called exactly as the model's own forward calls it."""

    @abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last block's output -> vocabulary logits (final norm, projections, lm head)."""

    @abstractmethod
    def head_modules(self) -> list[nn.Module]:
        """Every module outside the blocks that ``logits`` reads (and only those): where
        none of their weights is tied to the embedding's, the embedding and the head can
        take turns in one scratch (``distzo.engine.resident_sides``)."""

    def block_cache(self, block: nn.Module, rows: int) -> Any:
        """What a block gets as its cache (``CACHE_KEYWORD``): its prefix as a one-layer
        cache, or None."""
        prefix = getattr(block, "prefix_tuning", None)
        return prefix.cache(rows) if prefix is not None else None

    def prefixed(self, attention_mask: torch.Tensor | None) -> tuple[int, torch.Tensor | None, Any]:
        """The prefix length (where the batch's positions start), the padding mask widened
        by the prefix (ones in front, as peft) and the host stand-in of peft's prefix cache
        for the mask builders; 0, the mask unchanged and None without a prefix."""
        length = self.prefix_length
        if not length:
            return 0, attention_mask, None
        if attention_mask is not None:
            ones = torch.ones(attention_mask.shape[0], length, dtype=attention_mask.dtype)
            attention_mask = torch.cat([ones, attention_mask], dim=1)
        return length, attention_mask, host_prefix_cache(length, len(self.blocks()))

    def loss(
        self, logits: torch.Tensor, labels: torch.Tensor, num_items: torch.Tensor | int | None
    ) -> torch.Tensor:
        """Next-token cross-entropy over labels != -100, as the model's own causal-LM loss.

        ``num_items`` turns the sum over label tokens into a mean over the *global*
        batch, so the ranks' losses add up to the global mean however the batch is split
        (the HF Trainer's device-invariant loss); None means this batch's own mean.
        Unlike transformers' loss, which casts logits to float32 (down-casting a float64
        model), this one computes in at least float32 and keeps float64 as float64: a ZO
        step differences two nearly equal losses, so their precision is the gradient's.
        """
        dtype = torch.promote_types(logits.dtype, torch.float32)
        shifted = logits[..., :-1, :].reshape(-1, logits.shape[-1]).to(dtype)
        targets = labels[..., 1:].reshape(-1).to(logits.device)
        if num_items is None:
            return nn.functional.cross_entropy(shifted, targets, ignore_index=-100)
        return (
            nn.functional.cross_entropy(shifted, targets, ignore_index=-100, reduction="sum")
            / num_items
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Blockwise forward with the parameters in place: the reference for equivalence tests."""
        dtype = self.model.get_input_embeddings().weight.dtype
        host_mask = attention_mask.cpu() if attention_mask is not None else None
        rows, length = input_ids.shape
        ctx = self.context(host_mask, (rows, length), input_ids.device, dtype)
        hidden = self.embed(input_ids, ctx)
        for block in self.blocks():
            hidden = self.block_forward(block, hidden, ctx)
        logits = self.logits(hidden)
        return logits, (self.loss(logits, labels, None) if labels is not None else None)


def host_built_mask(
    builder: Callable[..., Any],
    config: Any,
    attention_mask: torch.Tensor | None,
    shape: tuple[int, int],
    device: torch.device,
    dtype: torch.dtype,
    cache: Any = None,
    **kwargs: Any,
) -> Any:
    """The model's own mask builder run on the host (a stand-in ``inputs_embeds`` carries
    only shape and dtype; ``cache`` a prefix's length), its result moved to
    ``device``: None when the builder finds the mask unnecessary, a tensor (or a BlockMask)
    otherwise."""
    stand_in = torch.empty((*shape, 1), dtype=dtype)
    mask = builder(
        config=config,
        inputs_embeds=stand_in,
        attention_mask=attention_mask,
        **{CACHE_KEYWORD: cache},
        **kwargs,
    )
    if mask is None:
        return None
    if isinstance(mask, torch.Tensor):
        return to_device(mask, device)
    return mask.to(device)
