"""Prefix tuning, one block at a time: each streamed layer carries its own share of peft's prefix.

peft's prefix tuning keeps one table of shape ``(virtual tokens, layers * 2 * kv_dim)`` and
hands the model a ``DynamicCache`` holding every layer's prefix keys and values, with the
attention mask widened by the prefix and the positions shifted by its length. A block
streamed alone needs only its own rows of that table, so distzo gives every block a
``BlockPrefix`` (the table's columns of that layer, ``(tokens, 2, kv_heads, head_dim)``):
it is one more parameter of the block, perturbed and updated with the block like any
other, and becomes a one-layer ``DynamicCache`` each time the block runs.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin


class BlockPrefix(nn.Module):
    """The prefix keys and values of one attention layer (``layer_idx``, as the layer's
    attention indexes its cache). ``stacked`` (``(passes, tokens, 2, heads, head_dim)``)
    gives each pass slice of a batched forward its own perturbed prefix; ``capture`` makes
    the next run record the keys and values the layer computes instead of adding a prefix
    (distzo's real-activation init, as MeZO's ``prefix_init_by_real_act``)."""

    stacked: torch.Tensor | None = None

    def __init__(self, key_values: torch.Tensor, layer_idx: int) -> None:
        super().__init__()
        self.key_values = nn.Parameter(key_values)
        self.layer_idx = layer_idx
        self.capture = False
        self.captured: DynamicCache | None = None
        self.init_tokens: torch.Tensor | None = None  # token ids whose activations become the init

    @property
    def length(self) -> int:
        return self.key_values.shape[0]

    def cache(self, rows: int) -> DynamicCache:
        """A cache whose layer ``layer_idx`` holds the prefix for a batch of ``rows`` rows;
        the layer's attention appends its own keys and values to it (as peft's cache)."""
        cache = DynamicCache()
        if self.capture:
            self.captured = cache
            return cache
        stacked = self.stacked
        if stacked is None:  # (tokens, 2, heads, dim) -> 2 x (rows, heads, tokens, dim)
            kv = self.key_values.permute(1, 2, 0, 3).unsqueeze(1).expand(-1, rows, -1, -1, -1)
        else:  # pass k's prefix for its rows [k b, (k + 1) b)
            kv = stacked.permute(2, 0, 3, 1, 4).repeat_interleave(rows // stacked.shape[0], dim=1)
        cache.update(kv[0], kv[1], self.layer_idx)
        return cache

    def take_captured(self) -> torch.Tensor:
        """The keys and values the layer computed in a capture run, as ``key_values``
        (batch row 0)."""
        layer = self.captured.layers[self.layer_idx] if self.captured is not None else None
        if not isinstance(layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
            raise RuntimeError(f"layer {self.layer_idx}: no capture run recorded its activations")
        self.captured, self.capture = None, False
        return torch.stack([layer.keys[0], layer.values[0]]).permute(2, 0, 1, 3)


def host_prefix_cache(length: int, num_layers: int) -> DynamicCache:
    """A stand-in for peft's prefix cache that carries only its length, for the model's mask
    builders on the host (they read the cache's length and layer kinds, never its values)."""
    stand_in = torch.zeros(1, 1, length, 1)
    return DynamicCache([(stand_in, stand_in)] * num_layers)
