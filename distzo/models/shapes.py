"""Named model shapes for random init without a checkpoint (``--model-config``).

The OPT sizes of the ZO2 paper's Table 4 and a few Llama/Qwen shapes, with the
published widths, depths, heads and vocabularies; ``layers`` shortens the stack so a
machine without the memory (or the weights) can still build and step the shape.
"""

from __future__ import annotations

from transformers import LlamaConfig, OPTConfig, PretrainedConfig, Qwen2Config

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
# name: (config class, hidden, layers, heads, kv heads, ffn, vocab, tied)
OTHER_SHAPES = {
    "llama-2-7b": (LlamaConfig, 4096, 32, 32, 32, 11008, 32000, False),
    "llama-2-13b": (LlamaConfig, 5120, 40, 40, 40, 13824, 32000, False),
    "llama-3-8b": (LlamaConfig, 4096, 32, 32, 8, 14336, 128256, False),
    "llama-2-70b": (LlamaConfig, 8192, 80, 64, 8, 28672, 32000, False),
    "qwen2.5-7b": (Qwen2Config, 3584, 28, 28, 4, 18944, 152064, False),
    "qwen2.5-0.5b": (Qwen2Config, 896, 24, 14, 2, 4864, 151936, True),
    "smollm2-135m": (LlamaConfig, 576, 30, 9, 3, 1536, 49152, True),
}
SHAPES = sorted(OPT_SHAPES) + sorted(OTHER_SHAPES)


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
        cls, hidden, depth, heads, kv, ffn, vocab, tied = OTHER_SHAPES[name]
        return cls(
            hidden_size=hidden,
            num_hidden_layers=layers or depth,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            intermediate_size=ffn,
            vocab_size=vocab,
            tie_word_embeddings=tied,
            max_position_embeddings=4096,
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
