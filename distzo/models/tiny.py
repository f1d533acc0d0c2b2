"""Tiny model shapes built from configs (random init): the default run and the tests."""

from __future__ import annotations

from transformers import OPTConfig


def tiny_opt_config(**overrides) -> OPTConfig:
    """A 2-layer OPT of about 21k parameters; ``overrides`` change any config field."""
    fields = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        ffn_dim=64,
        num_attention_heads=4,
        max_position_embeddings=64,
        word_embed_proj_dim=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    fields.update(overrides)
    return OPTConfig(**fields)
