"""Tiny models and batches the tests build: the same weights for the same seed."""

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    GemmaConfig,
    GPT2Config,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    OlmoeConfig,
    Phi3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    RobertaConfig,
    SiglipVisionConfig,
    XLMRobertaConfig,
)

from distzo.adapters.peft_adapters import AdapterSpec, attach_adapter
from distzo.models import model_from_config
from distzo.models.registry import auto_class
from distzo.models.tiny import tiny_opt_config


def tiny_opt(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A tiny random-init OPT, the same weights for the same seed."""
    torch.manual_seed(seed)
    return model_from_config(tiny_opt_config(**overrides), dtype=dtype)


# Few parameters: the step length is eps * |z| ~ eps * sqrt(#params), and the central
# difference's curvature error grows with its square. GELU, not OPT's ReLU: a central
# difference across a ReLU kink is not the derivative, and with thousands of
# pre-activations some always lie within eps of a kink.
FLOAT64_TINY = dict(
    dtype=torch.float64,
    num_hidden_layers=2,
    hidden_size=16,
    ffn_dim=32,
    num_attention_heads=2,
    word_embed_proj_dim=8,
    max_position_embeddings=16,
    activation_function="gelu",
)


def random_batch(
    vocab_size: int, batch: int = 4, seq: int = 12, seed: int = 0, pad: str | None = None
):
    """Token ids (avoiding the pad id 0) with an attention mask; ``pad`` left/right pads some
    rows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    if pad is not None:
        for row, n in enumerate([0, 3, 5, 1][:batch]):
            if n:
                if pad == "left":
                    mask[row, :n] = 0
                else:
                    mask[row, seq - n :] = 0
        ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# The tiny shape of the Llama-layout families' tests (each adds its layers and twists)
COMMON: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
)
# the tiny shape of the encoders (RoBERTa, XLM-RoBERTa)
ENCODER: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    max_position_embeddings=40,
    pad_token_id=0,
)
# a 3-layer Llama of that shape
LLAMA: dict[str, Any] = dict(COMMON, num_hidden_layers=3)


def base_model(family, seed=0, dtype=torch.float32, **overrides):
    if family == "opt":
        return tiny_opt(seed=seed, dtype=dtype, num_hidden_layers=3, **overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(**{**LLAMA, **overrides}), dtype=dtype)


def adapted(family, method="lora", seed=0, dtype=torch.float32, **overrides):
    return attach_adapter(
        base_model(family, seed, dtype, **overrides), AdapterSpec(method, r=4, alpha=8), seed=5
    )


# Gemma 2 and 3: a window shorter than the sequence, and their soft-capped head
GEMMA: dict[str, Any] = dict(
    head_dim=8, sliding_window=4, query_pre_attn_scalar=8, final_logit_softcapping=2.0, **COMMON
)

# the routed experts of a mixture (Qwen3-MoE, Qwen2-MoE): narrower than the dense MLP
MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


CONFIGS = {
    "llama": lambda: LlamaConfig(num_hidden_layers=3, **COMMON),
    "llama_tied": lambda: LlamaConfig(num_hidden_layers=2, tie_word_embeddings=True, **COMMON),
    "qwen2": lambda: Qwen2Config(num_hidden_layers=3, **COMMON),
    # sliding-window layers from layer 1 on, with a window shorter than the sequence
    "qwen2_sliding": lambda: Qwen2Config(
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
        **COMMON,
    ),
    "qwen3": lambda: Qwen3Config(num_hidden_layers=3, head_dim=8, **COMMON),
    "mistral": lambda: MistralConfig(num_hidden_layers=3, sliding_window=4, **COMMON),
    # Mistral 7B v0.2 and later: no window (``"sliding_window": null``), full attention
    "mistral_no_window": lambda: MistralConfig(num_hidden_layers=2, sliding_window=None, **COMMON),
    # a window a converted config carries, which Llama's attention ignores
    "llama_window_field": lambda: LlamaConfig(
        num_hidden_layers=2, **{**COMMON, "sliding_window": 4}
    ),
    # opt-350m's shape: embeddings narrower than the blocks (project_in/out), the layer norm
    # after each sublayer and so no final one, an untied head
    "opt_projected": lambda: tiny_opt_config(
        word_embed_proj_dim=16, do_layer_norm_before=False, tie_word_embeddings=False
    ),
    "gpt2": lambda: GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=4, n_positions=64),
    "phi3": lambda: Phi3Config(num_hidden_layers=2, sliding_window=4, **COMMON),
    "olmo2": lambda: Olmo2Config(num_hidden_layers=2, **COMMON),
    "gemma": lambda: GemmaConfig(num_hidden_layers=2, head_dim=8, **COMMON),
    # soft caps small enough to bend the logits and scores of a random model
    "gemma2": lambda: Gemma2Config(num_hidden_layers=3, attn_logit_softcapping=3.0, **GEMMA),
    # sliding and full layers, each kind with its own rotary base
    "gemma3": lambda: Gemma3TextConfig(
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        **GEMMA,
    ),
    # mixtures of experts: 4 experts, 2 a token
    "qwen3_moe": lambda: Qwen3MoeConfig(num_hidden_layers=2, **MOE, **COMMON),
    # a dense MLP on every other layer (decoder_sparse_step) and a window on every layer
    "qwen3_moe_sparse_step": lambda: Qwen3MoeConfig(
        num_hidden_layers=3,
        decoder_sparse_step=2,
        use_sliding_window=True,
        sliding_window=4,
        **MOE,
        **COMMON,
    ),
    # a shared expert beside the routed ones, its output gated
    "qwen2_moe": lambda: Qwen2MoeConfig(
        num_hidden_layers=2, shared_expert_intermediate_size=24, **MOE, **COMMON
    ),
    "mixtral": lambda: MixtralConfig(
        num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=4, **COMMON
    ),
    "olmoe": lambda: OlmoeConfig(
        num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, **COMMON
    ),
    "granite": lambda: GraniteConfig(
        num_hidden_layers=2,
        embedding_multiplier=3.0,
        logits_scaling=4.0,
        residual_multiplier=0.5,
        attention_multiplier=0.3,
        **COMMON,
    ),
    # encoders, as masked LMs: positions from the ids (pad 0 here, as random_batch pads)
    "roberta": lambda: RobertaConfig(num_hidden_layers=2, **ENCODER),
    "xlm_roberta": lambda: XLMRobertaConfig(num_hidden_layers=2, **ENCODER),
}


def build(name, seed=0, dtype=torch.float32):
    """``CONFIGS[name]``'s model as distzo loads it (a causal LM, or an encoder's masked LM)."""
    config = CONFIGS[name]()
    torch.manual_seed(seed)
    return auto_class(config.model_type).from_config(config, dtype=dtype).eval()


def save_multimodal(folder: Path, layout: str = "legacy") -> Path:
    """A random tiny Gemma 3 multimodal checkpoint, its text model soft-capped (which the
    multimodal class ignores): ``legacy`` as save_pretrained writes it (transformers 4.x
    keys, ``language_model.model.*``), ``current`` under the 5.x module names, ``untied``
    as ``legacy`` with a head of its own (the text config still says tied)."""
    vision = SiglipVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=7,
    )
    config = Gemma3Config(
        text_config=CONFIGS["gemma3"]().to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        image_token_index=63,
        boi_token_index=61,
        eoi_token_index=62,
        tie_word_embeddings=layout != "untied",
    )
    torch.manual_seed(0)
    model: Any = Gemma3ForConditionalGeneration(config)
    model = model.to(torch.bfloat16)
    model.save_pretrained(folder)
    if layout == "current":
        file = folder / "model.safetensors"
        with safe_open(str(file), "pt") as handle:
            keys = list(handle.keys())
        state = model.state_dict()
        # the module names; the tied head is the embedding, as transformers saves it
        save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}, file)
        assert set(keys) != set(state) - {"lm_head.weight"}  # the layouts differ
    return folder
