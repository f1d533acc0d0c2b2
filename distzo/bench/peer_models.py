"""The model every peer of ``benchmarks/peers.py`` builds for a shape: ZO2's speed test's.

ZO2 times OPT (``test/mezo_sgd/hf_opt/test_speed.py``) and Qwen3 (``hf_qwen3``) on a
config of the shape's widths, every other field the config class's default, with
``tie_word_embeddings=False`` and ``max_position_embeddings`` = the sequence length; for
Qwen3 also ``max_window_layers`` = the layer count and ``use_sliding_window=False``.
The shapes are distzo's (``distzo.models.shapes``): every OPT shape and the Qwen3 sizes
ZO2's Qwen3 test names (0.6B to 32B).

Overrides, so a shape shrinks to a CPU's size: ``layers`` sets the layer count;
``hidden`` H sets the width, and with it OPT's ffn to 4 H and its heads to H / 64
(64-wide, OPT's own head width), Qwen3's ffn to 3 H (the ratio of 0.6B, 1.7B and 8B),
its heads to H / 128 at head_dim 128 (Qwen3's head width at every size) and its kv
heads to gcd(H / 128, the shape's kv heads), the most that still divides the heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from transformers import OPTConfig, PretrainedConfig, Qwen3Config

from distzo.models.shapes import OPT_SHAPES, OTHER_SHAPES

QWEN3 = sorted(n for n, s in OTHER_SHAPES.items() if s.cls is Qwen3Config)  # dense ones
PEER_SHAPES = tuple(sorted(OPT_SHAPES) + QWEN3)
HEAD_WIDTH = {"opt": 64, "qwen3": 128}  # the --hidden override's head width
FFN_RATIO = {"opt": 4, "qwen3": 3}  # the --hidden override's ffn / hidden


@dataclass(frozen=True)
class PeerDims:
    """The widths a peer builds: ``family`` is the config's model type."""

    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int


def family_of(shape: str) -> str:
    if shape in OPT_SHAPES:
        return "opt"
    if shape in QWEN3:
        return "qwen3"
    raise ValueError(f"--shape {shape}: the peers build {', '.join(PEER_SHAPES)}")


def check_hidden(shape: str, hidden: int) -> None:
    """A width the override can build: one line naming the multiple it needs."""
    family = family_of(shape)
    width = HEAD_WIDTH[family]
    if hidden < width or hidden % width:
        raise ValueError(
            f"--hidden {hidden} must be a multiple of {width} ({family}: {width}-wide heads)"
        )


def peer_dims(shape: str, layers: int | None = None, hidden: int | None = None) -> PeerDims:
    """The shape's widths with the protocol's overrides."""
    family = family_of(shape)
    if layers is not None and layers < 1:
        raise ValueError(f"--layers {layers} must be >= 1")
    if family == "opt":
        size, depth, heads, ffn = OPT_SHAPES[shape]
        dims = PeerDims(family, size, depth, heads, heads, size // heads, ffn, 50272)
    else:
        s = OTHER_SHAPES[shape]
        assert s.head_dim is not None
        dims = PeerDims(family, s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim, s.ffn, s.vocab)
    if hidden is not None:
        check_hidden(shape, hidden)
        width = HEAD_WIDTH[family]
        heads = hidden // width
        kv = heads if family == "opt" else math.gcd(heads, dims.kv_heads)
        dims = replace(
            dims,
            hidden=hidden,
            heads=heads,
            kv_heads=kv,
            head_dim=width,
            ffn=FFN_RATIO[family] * hidden,
        )
    return replace(dims, layers=layers or dims.layers)


def peer_config(shape: str, layers: int | None, hidden: int | None, seq: int) -> PretrainedConfig:
    """The config ZO2's speed test builds for ``shape`` at sequence length ``seq``."""
    d = peer_dims(shape, layers, hidden)
    if d.family == "opt":
        return OPTConfig(
            hidden_size=d.hidden,
            num_hidden_layers=d.layers,
            num_attention_heads=d.heads,
            ffn_dim=d.ffn,
            max_position_embeddings=seq,
            tie_word_embeddings=False,
        )
    return Qwen3Config(
        hidden_size=d.hidden,
        num_hidden_layers=d.layers,
        num_attention_heads=d.heads,
        num_key_value_heads=d.kv_heads,
        head_dim=d.head_dim,
        intermediate_size=d.ffn,
        vocab_size=d.vocab,
        max_window_layers=d.layers,
        use_sliding_window=False,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
    )
