"""The Llama family (Llama, Qwen2, Qwen3, Mistral, Phi-3, OLMo 2): rotary positions,
RMSNorm, tied or untied head, full or sliding-window attention. Gemma and Granite are this
layout with a few twists of their own (``distzo.models.gemma``, ``distzo.models.granite``)."""

from __future__ import annotations

import copy
import functools
from typing import Any, ClassVar

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from distzo.models.family import CACHE_KEYWORD, BatchContext, ModelFamily, host_built_mask
from distzo.runtime.devices import to_device

# Rotary types whose frequencies depend on the longest position (transformers'
# dynamic_rope_update): they read it on the host.
DATA_DEPENDENT_ROPE = {"dynamic", "longrope"}

# Families whose every layer uses the sliding window a config sets (their attention reads
# ``config.sliding_window``); the others name a kind per layer or attend in full.
WINDOW_ON_EVERY_LAYER = {"mistral", "phi3", "mixtral", "qwen3_moe"}


class LlamaFamily(ModelFamily):
    model_types: ClassVar[tuple[str, ...]] = ("llama", "qwen2", "qwen3", "mistral", "phi3", "olmo2")

    @property
    def _body(self) -> Any:
        return self.model.model

    def blocks(self) -> list[nn.Module]:
        return list(self._body.layers[: self.model.config.num_hidden_layers])

    def _layer_type(self, block: nn.Module) -> str:
        """Which mask a layer uses: Qwen2/3 and Gemma 2/3 name it per layer; Mistral and
        Phi-3 one for all, sliding where their config sets a window; Llama always full (its
        attention ignores a ``sliding_window`` a converted config may carry)."""
        config = self.model.config
        layer_types = getattr(config, "layer_types", None)
        if layer_types:
            attention: Any = block.self_attn  # the model's own attention class
            return layer_types[attention.layer_idx]
        windowed = config.model_type in WINDOW_ON_EVERY_LAYER
        window = getattr(config, "sliding_window", None)
        return "sliding_attention" if windowed and window is not None else "full_attention"

    def context(
        self,
        attention_mask: torch.Tensor | None,
        shape: tuple[int, int],
        device: torch.device,
        dtype: torch.dtype,
    ) -> BatchContext:
        # As the model's own forward without a cache: positions 0..L-1 (the family does not
        # shift them for left padding), masks from the model's own builders (on the host),
        # one of each kind its layers use, and the rotary tables computed once by its
        # rotary module (which reads only the dtype and device of its first argument).
        # A prefix shifts the positions by its length and widens the masks, as under peft.
        start, attention_mask, past = self.prefixed(attention_mask)
        host_positions = torch.arange(start, start + shape[1]).unsqueeze(0)
        builders = {
            "full_attention": create_causal_mask,
            "sliding_attention": create_sliding_window_causal_mask,
        }
        kinds = {self._layer_type(block) for block in self.blocks()}
        masks = {
            kind: host_built_mask(
                builders[kind],
                self.model.config,
                attention_mask,
                shape,
                device,
                dtype,
                past,
                position_ids=host_positions,
            )
            for kind in kinds
        }
        position_ids = to_device(host_positions, device)
        position_embeddings = self._position_tables(kinds, host_positions, position_ids, dtype)
        return BatchContext(masks, position_ids, {"position_embeddings": position_embeddings})

    def _position_tables(
        self,
        kinds: set[str],
        host_positions: torch.Tensor,
        position_ids: torch.Tensor,
        dtype: torch.dtype,
    ) -> Any:
        """What the layers (of ``kinds``) get as ``position_embeddings``: one pair of rotary
        tables for all."""
        return self._rotary_tables(host_positions, position_ids, dtype)

    def _layer_tables(self, block: nn.Module, ctx: BatchContext) -> Any:
        """The rotary tables ``block`` is called with."""
        return ctx.extras["position_embeddings"]

    def _rotary_tables(
        self,
        host_positions: torch.Tensor,
        position_ids: torch.Tensor,
        dtype: torch.dtype,
        **layer_type: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) by the model's rotary module (``layer_type``: the kind of layer they
        are for, where the module keeps frequencies for each). The ``dynamic`` and
        ``longrope`` types first read ``max(position_ids)`` as a Python value to pick their
        frequencies: on the device that is a host sync per batch, so those run on a host
        copy of the module from the host positions, and only the tables travel."""
        rotary = self._body.rotary_emb
        kinds = (
            rotary.rope_type.values() if isinstance(rotary.rope_type, dict) else [rotary.rope_type]
        )
        device = position_ids.device
        if not DATA_DEPENDENT_ROPE.intersection(kinds) or device.type == "cpu":
            empty = torch.empty(0, dtype=dtype, device=device)
            return rotary(empty, position_ids=position_ids, **layer_type)
        empty = torch.empty(0, dtype=dtype)
        cos, sin = self._host_rotary(empty, position_ids=host_positions, **layer_type)
        return to_device(cos, device), to_device(sin, device)

    @functools.cached_property
    def _host_rotary(self) -> nn.Module:
        """The rotary module's host copy (made once: its buffers are small)."""
        return copy.deepcopy(self._body.rotary_emb).to("cpu")

    def embed(self, input_ids: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        return self._body.embed_tokens(input_ids)

    def block_forward(
        self, block: nn.Module, hidden: torch.Tensor, ctx: BatchContext
    ) -> torch.Tensor:
        return block(
            hidden,
            attention_mask=ctx.attention_mask[self._layer_type(block)],
            position_ids=ctx.position_ids,
            position_embeddings=self._layer_tables(block, ctx),
            **{CACHE_KEYWORD: self.block_cache(block, hidden.shape[0])},
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self._body.norm(hidden))

    def head_modules(self) -> list[nn.Module]:
        return [self._body.norm, self.model.lm_head]
