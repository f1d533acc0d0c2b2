"""A tiny RoBERTa tokenizer and model, built offline, for MeZO's masked-LM prompts.

The tokenizer is a byte-level BPE trained in code on the words of MeZO's templates and
label words (each, a space before it, one token, as in roberta-large's vocabulary), with
RoBERTa's special tokens, wrapped as transformers' RobertaTokenizer.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import RobertaConfig, RobertaForMaskedLM, RobertaTokenizer

from distzo.data.masked_prompts import MASKED_PROMPTS

SPECIAL = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # roberta's ids 0..3, <mask> after them
WORDS = tuple(
    sorted({w for p in MASKED_PROMPTS.values() for w in p.words} | {"It", "was", "This", "is"})
)
SENTENCES = [
    "a gripping, funny film.",
    "The plot is dull and slow",
    "What city hosts the games?",
    "Cats purr when they are happy.",
    "A cat is an animal.",
]


@functools.cache
def _vocab_and_merges(words: tuple[str, ...]) -> tuple[dict[str, int], list[tuple[str, ...]]]:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=520,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [" ".join(" " + w for w in words)] * 50 + SENTENCES * 5
    core.train_from_iterator(corpus, trainer)
    saved: dict = json.loads(core.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in saved["merges"]]
    return saved["vocab"], merges


def roberta_tokenizer(words: tuple[str, ...] = WORDS) -> RobertaTokenizer:
    """RoBERTa's tokenizer class over the tiny vocabulary, each of ``words`` (a space
    before it) one token: <s> ... </s> around a text."""
    vocab, merges = _vocab_and_merges(words)
    # transformers annotates merges as strings; its BPE takes (left, right) pairs
    return RobertaTokenizer(vocab=dict(vocab), merges=list(merges))  # type: ignore[arg-type]


def tiny_roberta_config(tokenizer: RobertaTokenizer) -> RobertaConfig:
    """A 2-layer RoBERTa of ``tokenizer``'s vocabulary, 130 position rows (128 tokens)."""
    return RobertaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        max_position_embeddings=130,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def save_tiny_roberta(folder: Path, seed: int = 0) -> Path:
    """A random 2-layer RobertaForMaskedLM of the tiny vocabulary and its tokenizer."""
    import torch

    tokenizer = roberta_tokenizer()
    config = tiny_roberta_config(tokenizer)
    torch.manual_seed(seed)
    RobertaForMaskedLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
