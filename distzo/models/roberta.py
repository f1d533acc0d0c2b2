"""RoBERTa and XLM-RoBERTa as masked LMs (``...ForMaskedLM``): MeZO's and LOZO's encoders.

An encoder attends both ways, so its mask is the model's own bidirectional one, and it
predicts the token under a ``<mask>`` from the hidden state at that very position: a
batch scores a candidate at the mask's position, not at the one before it as for a
causal LM. Its positions come from the token ids (counted from ``padding_idx + 1``, pad
tokens kept at ``padding_idx``), which the model's own embeddings module computes; the
head's decoder is tied to the word embeddings, so the resident bucket stays one side.

A prefix (peft's prefix tuning) is what peft makes of it on ``RobertaModel``: each layer's
self-attention takes its prefix keys and values as a cache and puts its own after them, the
padding mask is widened by ones in front (every token sees the prefix), and the embeddings
count the positions from after it, as they do after any cache.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from transformers.masking_utils import create_bidirectional_mask

from distzo.models.family import (
    CACHE_KEYWORD,
    MASKED,
    BatchContext,
    ModelFamily,
    host_built_mask,
)


class RobertaFamily(ModelFamily):
    model_types = ("roberta", "xlm-roberta")
    lm_kind = MASKED

    @classmethod
    def check_config(cls, config: Any) -> None:
        # RobertaModel builds a causal mask for a decoder config: another model than the
        # encoder the masked-LM head was trained on, and one the adapter does not run
        if getattr(config, "is_decoder", False):
            raise ValueError(
                f"this {config.model_type} config sets is_decoder (a causal decoder, not "
                "the masked LM distzo loads it as); set is_decoder to false in its config.json"
            )

    @classmethod
    def reserved_positions(cls, config: Any) -> int:
        # positions count from padding_idx + 1 (padding_idx is the pad id): RoBERTa's 514
        # rows hold 512 tokens
        return int(config.pad_token_id) + 1

    @property
    def _body(self) -> Any:
        return self.model.roberta

    def blocks(self) -> list[nn.Module]:
        return list(self._body.encoder.layer)

    def context(
        self,
        attention_mask: torch.Tensor | None,
        shape: tuple[int, int],
        device: torch.device,
        dtype: torch.dtype,
    ) -> BatchContext:
        # As RobertaModel.forward for an encoder: the bidirectional mask of the padding
        # (None where nothing is padded and the attention needs none), widened by a
        # prefix as peft widens it; positions are the embeddings' own, from the ids.
        _, attention_mask, _ = self.prefixed(attention_mask)
        mask = host_built_mask(
            create_bidirectional_mask, self.model.config, attention_mask, shape, device, dtype
        )
        return BatchContext(mask, None)

    def embed(self, input_ids: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        embeddings = self._body.embeddings
        if not self.prefix_length:
            return embeddings(input_ids=input_ids)
        # positions after the prefix, as the model counts them after a cache of its length
        return embeddings(
            input_ids=input_ids, **{cache_length_keyword(embeddings): self.prefix_length}
        )

    def block_forward(
        self, block: nn.Module, hidden: torch.Tensor, ctx: BatchContext
    ) -> torch.Tensor:
        cache = self.block_cache(block, hidden.shape[0])
        if cache is None:
            return block(hidden, ctx.attention_mask)
        return block(hidden, ctx.attention_mask, **{CACHE_KEYWORD: cache})

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden)

    def head_modules(self) -> list[nn.Module]:
        return [self.model.lm_head]

    def loss(
        self, logits: torch.Tensor, labels: torch.Tensor, num_items: torch.Tensor | int | None
    ) -> torch.Tensor:
        """The masked-LM loss, as the model's own: cross-entropy of each labelled
        position's own logits (no shift), in at least float32."""
        dtype = torch.promote_types(logits.dtype, torch.float32)
        flat = logits.reshape(-1, logits.shape[-1]).to(dtype)
        targets = labels.reshape(-1).to(logits.device)
        if num_items is None:
            return nn.functional.cross_entropy(flat, targets, ignore_index=-100)
        summed = nn.functional.cross_entropy(flat, targets, ignore_index=-100, reduction="sum")
        return summed / num_items


def cache_length_keyword(embeddings: nn.Module) -> str:
    """The keyword by which the embeddings take a cache's length: transformers 5.24 renamed
    ``past_key_values_length`` to ``cache_length``."""
    parameters = inspect.signature(embeddings.forward).parameters
    return "cache_length" if "cache_length" in parameters else "past_key_values_length"
