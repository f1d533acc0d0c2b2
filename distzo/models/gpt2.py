"""GPT-2: learned positions, LayerNorm, Conv1D projections, head tied to the embeddings."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask

from distzo.models.family import BatchContext, ModelFamily, host_built_mask
from distzo.runtime.devices import to_device


class GPT2Family(ModelFamily):
    model_types = ("gpt2",)

    @property
    def _body(self) -> Any:
        return self.model.transformer

    def blocks(self) -> list[nn.Module]:
        return list(self._body.h)

    def context(
        self,
        attention_mask: torch.Tensor | None,
        shape: tuple[int, int],
        device: torch.device,
        dtype: torch.dtype,
    ) -> BatchContext:
        # As GPT2Model.forward without a cache or token types: positions 0..L-1 and the
        # model's own causal mask (built on the host); a prefix shifts and widens them (peft).
        start, attention_mask, past = self.prefixed(attention_mask)
        host_positions = torch.arange(start, start + shape[1]).unsqueeze(0)
        mask = host_built_mask(
            create_causal_mask,
            self.model.config,
            attention_mask,
            shape,
            device,
            dtype,
            past,
            position_ids=host_positions,
        )
        return BatchContext(mask, to_device(host_positions, device))

    def embed(self, input_ids: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        body = self._body
        hidden = body.wte(input_ids) + body.wpe(ctx.position_ids)
        return body.drop(hidden)  # the model's embedding dropout (a no-op in eval mode)

    def block_forward(
        self, block: nn.Module, hidden: torch.Tensor, ctx: BatchContext
    ) -> torch.Tensor:
        return block(
            hidden,
            self.block_cache(block, hidden.shape[0]),
            ctx.attention_mask,
            None,
            use_cache=False,
            position_ids=ctx.position_ids,
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self._body.ln_f(hidden))

    def head_modules(self) -> list[nn.Module]:
        return [self._body.ln_f, self.model.lm_head]
