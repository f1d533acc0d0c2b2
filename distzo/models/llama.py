"""The Llama family (Llama, Qwen2, Qwen3, Mistral): rotary positions, RMSNorm, tied or
untied head, full or sliding-window attention."""

from __future__ import annotations

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from distzo.models.adapter import BatchContext, BlockAdapter


class LlamaFamilyAdapter(BlockAdapter):
    model_types = ("llama", "qwen2", "qwen3", "mistral")

    @property
    def _body(self) -> nn.Module:
        return self.model.model

    def blocks(self) -> list[nn.Module]:
        return list(self._body.layers[: self.model.config.num_hidden_layers])

    def _layer_type(self, block: nn.Module) -> str:
        """Which mask a layer uses: Qwen2/3 name it per layer; Mistral one for all."""
        config = self.model.config
        layer_types = getattr(config, "layer_types", None)
        if layer_types:
            return layer_types[block.self_attn.layer_idx]
        return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, BatchContext]:
        # As the model's own forward without a cache: positions 0..L-1 (the family does not
        # shift them for left padding), masks from the model's own builders, one of each kind
        # its layers use, and the rotary tables computed once by its rotary module.
        body = self._body
        inputs_embeds = body.embed_tokens(input_ids)
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        mask_kwargs = dict(
            config=self.model.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
            past_key_values=None, position_ids=position_ids,
        )
        builders = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        kinds = {self._layer_type(block) for block in self.blocks()}
        masks = {kind: builders[kind](**mask_kwargs) for kind in kinds}
        position_embeddings = body.rotary_emb(inputs_embeds, position_ids=position_ids)
        return inputs_embeds, BatchContext(masks, position_ids, {"position_embeddings": position_embeddings})

    def block_forward(self, block: nn.Module, hidden: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        return block(
            hidden,
            attention_mask=ctx.attention_mask[self._layer_type(block)],
            position_ids=ctx.position_ids,
            position_embeddings=ctx.extras["position_embeddings"],
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self._body.norm(hidden))
