"""GPT-2: learned positions, LayerNorm, Conv1D projections, head tied to the embeddings."""

from __future__ import annotations

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask

from distzo.models.adapter import BatchContext, BlockAdapter


class GPT2Adapter(BlockAdapter):
    model_types = ("gpt2",)

    @property
    def _body(self) -> nn.Module:
        return self.model.transformer

    def blocks(self) -> list[nn.Module]:
        return list(self._body.h)

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, BatchContext]:
        # As GPT2Model.forward without a cache or token types: positions 0..L-1, the
        # model's own causal mask, and its embedding dropout (a no-op in eval mode).
        body = self._body
        inputs_embeds = body.wte(input_ids)
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        hidden = inputs_embeds + body.wpe(position_ids)
        mask = create_causal_mask(
            config=self.model.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
            past_key_values=None, position_ids=position_ids,
        )
        return body.drop(hidden), BatchContext(mask, position_ids)

    def block_forward(self, block: nn.Module, hidden: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        return block(hidden, None, ctx.attention_mask, None, use_cache=False, position_ids=ctx.position_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self._body.ln_f(hidden))
