"""OPT (facebook/opt-*): learned positions, optional project_in/out, tied head."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask

from distzo.models.family import CACHE_KEYWORD, BatchContext, ModelFamily, host_built_mask
from distzo.runtime.devices import to_device


class OPTFamily(ModelFamily):
    model_types = ("opt",)

    @property
    def _decoder(self) -> Any:
        return self.model.model.decoder

    def blocks(self) -> list[nn.Module]:
        return list(self._decoder.layers)

    def context(
        self,
        attention_mask: torch.Tensor | None,
        shape: tuple[int, int],
        device: torch.device,
        dtype: torch.dtype,
    ) -> BatchContext:
        # Mirrors OPTDecoder.forward without a cache: positions come from the dense mask
        # (so left padding works), while the mask handed to the layers stays None when the
        # batch is unpadded, exactly as the model passes it. A prefix widens the mask (peft)
        # and the positions count it, then drop its own (as the model with a cache).
        start, attention_mask, past = self.prefixed(attention_mask)
        position_mask = (
            attention_mask
            if attention_mask is not None
            else torch.ones(shape[0], start + shape[1], dtype=torch.long)
        )
        position_ids = (torch.cumsum(position_mask, dim=1) * position_mask - 1).long()[:, start:]
        causal_mask = host_built_mask(
            create_causal_mask, self._decoder.config, attention_mask, shape, device, dtype, past
        )
        return BatchContext(causal_mask, to_device(position_ids, device))

    def embed(self, input_ids: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        decoder = self._decoder
        inputs_embeds = decoder.embed_tokens(input_ids)
        # the ids given: no mask read
        pos_embeds = decoder.embed_positions(None, 0, position_ids=ctx.position_ids)
        if decoder.project_in is not None:
            inputs_embeds = decoder.project_in(inputs_embeds)
        return inputs_embeds + pos_embeds

    def block_forward(
        self, block: nn.Module, hidden: torch.Tensor, ctx: BatchContext
    ) -> torch.Tensor:
        return block(
            hidden,
            attention_mask=ctx.attention_mask,
            position_ids=ctx.position_ids,
            **{CACHE_KEYWORD: self.block_cache(block, hidden.shape[0])},
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        decoder = self._decoder
        if decoder.final_layer_norm is not None:
            hidden = decoder.final_layer_norm(hidden)
        if decoder.project_out is not None:
            hidden = decoder.project_out(hidden)
        return self.model.lm_head(hidden)

    def head_modules(self) -> list[nn.Module]:
        decoder = self._decoder
        extra = [decoder.final_layer_norm, decoder.project_out]
        return [m for m in extra if m is not None] + [self.model.lm_head]
