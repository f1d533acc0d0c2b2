"""Named model shapes for random init without a checkpoint (``--model-config``).

The OPT sizes of the ZO2 paper's Table 4, a few Llama/Qwen2 shapes, the Qwen3 sizes
of ZO2's Qwen3 speed test and three mixtures of experts (Qwen3-30B-A3B, Qwen3-235B-A22B,
Mixtral 8x7B) and RoBERTa's masked LMs (their memory plan: a shape has no tokenizer with a
``<mask>``), with the published widths, depths, heads, head widths, vocabularies, head
ties and experts; ``layers`` shortens the stack so a machine without the
memory (or the weights) can still build and step the shape.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from transformers import (
    LlamaConfig,
    MixtralConfig,
    OPTConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
    RobertaConfig,
)

# name: (hidden, layers, heads, ffn) for OPT (vocab 50272, 2048 positions)
OPT_SHAPES = {
    "opt-125m": (768, 12, 12, 3072),
    "opt-350m": (1024, 24, 16, 4096),
    "opt-1.3b": (2048, 24, 32, 8192),
    "opt-2.7b": (2560, 32, 32, 10240),
    "opt-6.7b": (4096, 32, 32, 16384),
    "opt-13b": (5120, 40, 40, 20480),
    "opt-30b": (7168, 48, 56, 28672),
    "opt-66b": (9216, 64, 72, 36864),
    "opt-175b": (12288, 96, 96, 49152),
}


class Experts(NamedTuple):
    """A mixture's routed experts: how many a layer, how many a token, each one's width."""

    number: int
    per_token: int
    ffn: int


class Shape(NamedTuple):
    """A rotary-family shape; ``head_dim`` None: hidden / heads (the config's default);
    ``experts``: a mixture's, in place of the dense MLP of ``ffn`` (None: dense)."""

    cls: type[PretrainedConfig]
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    head_dim: int | None = None
    experts: Experts | None = None


OTHER_SHAPES = {
    "llama-2-7b": Shape(LlamaConfig, 4096, 32, 32, 32, 11008, 32000, False),
    "llama-2-13b": Shape(LlamaConfig, 5120, 40, 40, 40, 13824, 32000, False),
    "llama-3-8b": Shape(LlamaConfig, 4096, 32, 32, 8, 14336, 128256, False),
    "llama-2-70b": Shape(LlamaConfig, 8192, 80, 64, 8, 28672, 32000, False),
    "qwen2.5-7b": Shape(Qwen2Config, 3584, 28, 28, 4, 18944, 152064, False),
    "qwen2.5-0.5b": Shape(Qwen2Config, 896, 24, 14, 2, 4864, 151936, True),
    "smollm2-135m": Shape(LlamaConfig, 576, 30, 9, 3, 1536, 49152, True),
    # Qwen3: 128-wide heads at every size (so hidden / heads is not the head width of
    # 0.6B, 4B and 32B); the three smallest tie the head to the embedding.
    "qwen3-0.6b": Shape(Qwen3Config, 1024, 28, 16, 8, 3072, 151936, True, 128),
    "qwen3-1.7b": Shape(Qwen3Config, 2048, 28, 16, 8, 6144, 151936, True, 128),
    "qwen3-4b": Shape(Qwen3Config, 2560, 36, 32, 8, 9728, 151936, True, 128),
    "qwen3-8b": Shape(Qwen3Config, 4096, 36, 32, 8, 12288, 151936, False, 128),
    "qwen3-14b": Shape(Qwen3Config, 5120, 40, 40, 8, 17408, 151936, False, 128),
    "qwen3-32b": Shape(Qwen3Config, 5120, 64, 64, 8, 25600, 151936, False, 128),
    # mixtures of experts: every layer sparse (30.5 B, 235 B and 46.7 B parameters)
    "qwen3-30b-a3b": Shape(
        Qwen3MoeConfig, 2048, 48, 32, 4, 6144, 151936, False, 128, Experts(128, 8, 768)
    ),
    "qwen3-235b-a22b": Shape(
        Qwen3MoeConfig, 4096, 94, 64, 4, 12288, 151936, False, 128, Experts(128, 8, 1536)
    ),
    "mixtral-8x7b": Shape(
        MixtralConfig, 4096, 32, 32, 8, 14336, 32000, False, None, Experts(8, 2, 14336)
    ),
}
# The config fields a mixture's experts set, by config class.
EXPERT_FIELDS = {
    Qwen3MoeConfig: ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
    MixtralConfig: ("num_local_experts", "num_experts_per_tok", "intermediate_size"),
}
# RoBERTa's masked LMs (MeZO's and LOZO's encoders): name: (hidden, layers, heads, ffn),
# with RoBERTa's vocabulary of 50265, one token type and 514 positions (pad id 1: 512 usable);
# the masked-LM head's decoder is tied to the word embeddings.
ENCODER_SHAPES = {
    "roberta-base": (768, 12, 12, 3072),
    "roberta-large": (1024, 24, 16, 4096),
}
SHAPES = sorted(OPT_SHAPES) + sorted(OTHER_SHAPES) + sorted(ENCODER_SHAPES)


def shape_config(name: str, layers: int | None = None) -> PretrainedConfig:
    if layers is not None and layers < 1:
        raise ValueError(f"--model-layers must be >= 1, got {layers}")
    if name in OPT_SHAPES:
        hidden, depth, heads, ffn = OPT_SHAPES[name]
        return OPTConfig(
            hidden_size=hidden,
            num_hidden_layers=layers or depth,
            num_attention_heads=heads,
            ffn_dim=ffn,
            word_embed_proj_dim=hidden if name != "opt-350m" else 512,
            vocab_size=50272,
            max_position_embeddings=2048,
            do_layer_norm_before=name != "opt-350m",
        )
    if name in OTHER_SHAPES:
        shape = OTHER_SHAPES[name]
        fields: dict[str, Any] = {
            "hidden_size": shape.hidden,
            "num_hidden_layers": layers or shape.layers,
            "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads,
            "intermediate_size": shape.ffn,
            "vocab_size": shape.vocab,
            "tie_word_embeddings": shape.tied,
            "max_position_embeddings": 4096,
        }
        if shape.head_dim is not None:
            fields["head_dim"] = shape.head_dim
        if shape.experts is not None:
            fields.update(zip(EXPERT_FIELDS[shape.cls], shape.experts, strict=True))
        return shape.cls(**fields)
    if name in ENCODER_SHAPES:
        hidden, depth, heads, ffn = ENCODER_SHAPES[name]
        return RobertaConfig(
            hidden_size=hidden,
            num_hidden_layers=layers or depth,
            num_attention_heads=heads,
            intermediate_size=ffn,
            vocab_size=50265,
            max_position_embeddings=514,
            type_vocab_size=1,
            layer_norm_eps=1e-5,
        )
    raise ValueError(f"unknown --model-config {name!r}; choose one of {', '.join(SHAPES)}")


# The config fields that fix a model's parameter shapes across families (transformers maps
# GPT-2's n_embd/n_layer/n_head onto these names; a family without one records None).
SIGNATURE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "ffn_dim",
)


def signature(config: PretrainedConfig) -> dict[str, object]:
    """What a seed log records of its model, so that a replay can refuse another base: the
    model type and the sizes its updates were drawn for (z is drawn per parameter shape)."""
    return {
        "model_type": config.model_type,
        **{name: getattr(config, name, None) for name in SIGNATURE_FIELDS},
    }


def check_signature(recorded: dict[str, object], config: PretrainedConfig, base: str) -> None:
    """Refuse a base whose type or sizes differ from those the log recorded (logs from before
    the record: not checked)."""
    ours = signature(config)
    for name, value in recorded.items():
        if name in ours and ours[name] != value:
            what = "model type" if name == "model_type" else name
            raise ValueError(
                f"--base {base} has {what} {ours[name]}, the log's run trained {what} {value}; "
                "replay onto the base the run started from"
            )
