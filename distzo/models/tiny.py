"""Tiny model shapes built from configs (random init): the default run and the tests."""

from __future__ import annotations

import functools
from typing import Any

from transformers import OPTConfig


def tiny_opt_config(**overrides: Any) -> OPTConfig:
    """A 2-layer OPT of about 21k parameters; ``overrides`` change any config field."""
    fields: dict[str, Any] = dict(
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


def byte_tokenizer():
    """A byte-level tokenizer built in code (no download): one token per byte, plus
    ``</s>`` (bos/eos) and ``<pad>``; 258 tokens. Pairs with a random-init model whose
    vocabulary is at least that large, for text and prompt tasks offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<pad>": 0, "</s>": 1}
    vocab.update({ch: i + 2 for i, ch in enumerate(sorted(alphabet))})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="</s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.add_bos_token = True
    return tokenizer


@functools.cache
def shared_byte_tokenizer():
    """The byte tokenizer the runs of a process encode their text with, built once and
    shared (never modify it): a ``tokenizers`` tokenizer that has encoded text keeps native
    memory after it is dropped (about 5 MB per 2000 prompts), so a fresh one per run grew a
    notebook's process by 23 MB with each ``Trainer`` on a prompt task."""
    return byte_tokenizer()
