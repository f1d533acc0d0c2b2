"""The Gemma family (Gemma, Gemma 2, Gemma 3 text): Llama's layout with three twists.

The embedding is scaled by the square root of the width inside the model's own embedding
module (whose forward the engine calls as it is), Gemma 2 and 3 soft-cap the logits
(``final_logit_softcapping``), and Gemma 3 keeps rotary frequencies of their own for its
sliding and full layers: each layer is called with its kind's tables, as the model's own
forward calls it.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import torch
from torch import nn

from distzo.models.family import BatchContext
from distzo.models.llama import LlamaFamily


def _check_logit_cap(cap: Any) -> None:
    """Refuse a logit cap (``tanh(logits / cap) * cap``) no forward computes: 0 or an
    infinite one makes every logit 0 or NaN, a loss the job then failed on only at the
    first evaluation, after the weights loaded, blaming them. (The attention's cap is the
    model's own attention's to apply, or ignore, as it does.)"""
    if cap is None or (isinstance(cap, (int, float)) and math.isfinite(cap) and cap != 0):
        return
    raise ValueError(
        f"this Gemma config sets final_logit_softcapping to {cap!r}, which makes every "
        "logit 0 or NaN; set it to a positive number, or to null for no cap"
    )


class GemmaFamily(LlamaFamily):
    model_types = ("gemma", "gemma2", "gemma3_text")

    @classmethod
    def check_config(cls, config: Any) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(
                "this Gemma config sets use_bidirectional_attention (an embedding model, "
                "not a causal LM); pick a causal Gemma model"
            )
        _check_logit_cap(getattr(config, "final_logit_softcapping", None))

    @functools.cached_property
    def _tables_by_kind(self) -> bool:
        """Whether the rotary module computes tables for a kind of layer (Gemma 3)."""
        return "layer_type" in inspect.signature(self._body.rotary_emb.forward).parameters

    def _position_tables(
        self,
        kinds: set[str],
        host_positions: torch.Tensor,
        position_ids: torch.Tensor,
        dtype: torch.dtype,
    ) -> Any:
        if not self._tables_by_kind:
            return super()._position_tables(kinds, host_positions, position_ids, dtype)
        return {
            kind: self._rotary_tables(host_positions, position_ids, dtype, layer_type=kind)
            for kind in kinds
        }

    def _layer_tables(self, block: nn.Module, ctx: BatchContext) -> Any:
        tables = ctx.extras["position_embeddings"]
        return tables[self._layer_type(block)] if isinstance(tables, dict) else tables

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().logits(hidden)
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap
