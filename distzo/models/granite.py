"""The Granite family: Llama's layout with multipliers. The embedding's output is scaled
(``embedding_multiplier``) and the logits divided (``logits_scaling``) outside the layers,
so here; the residual and attention multipliers live inside the model's own layers."""

from __future__ import annotations

import torch

from distzo.models.family import BatchContext
from distzo.models.llama import LlamaFamily


class GraniteFamily(LlamaFamily):
    model_types = ("granite",)

    def embed(self, input_ids: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        return super().embed(input_ids, ctx) * self._body.embedding_multiplier

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().logits(hidden) / self.model.config.logits_scaling
