"""The named shapes have the published sizes: each config built on the meta device, its
parameters counted, against the figures of the model cards."""

import pytest
import torch
from transformers import Qwen3Config

from distzo.models.shapes import OTHER_SHAPES, shape_config
from distzo.models.weights import skeleton

# Qwen3's model cards: "Number of Parameters" and "(Non-Embedding)", in billions, as printed.
QWEN3_PUBLISHED = {
    "qwen3-0.6b": ("0.6", "0.44"),
    "qwen3-1.7b": ("1.7", "1.4"),
    "qwen3-4b": ("4.0", "3.6"),
    "qwen3-8b": ("8.2", "6.95"),
    "qwen3-14b": ("14.8", "13.2"),
    "qwen3-32b": ("32.8", "31.2"),
}


def rounded_as(count: int, published: str) -> str:
    """``count`` in billions with as many decimals as the published figure prints."""
    decimals = len(published.partition(".")[2])
    return f"{count / 1e9:.{decimals}f}"


@pytest.mark.parametrize("name", sorted(QWEN3_PUBLISHED))
def test_qwen3_shapes_have_the_published_parameter_counts(name):
    model = skeleton(shape_config(name), torch.float32)
    assert model.config.model_type == "qwen3"
    params = dict(model.named_parameters())  # a tied head is one parameter, counted once
    total = sum(p.numel() for p in params.values())
    embedding = sum(p.numel() for key, p in params.items() if "embed" in key or "lm_head" in key)
    published_total, published_body = QWEN3_PUBLISHED[name]
    assert rounded_as(total, published_total) == published_total
    assert rounded_as(total - embedding, published_body) == published_body


def test_qwen3_shapes_are_the_released_configs():
    """128-wide heads at every size, 8 kv heads, the head tied up to 4B."""
    for name in QWEN3_PUBLISHED:
        config = shape_config(name)
        assert config.head_dim == 128 and config.num_key_value_heads == 8, name
        attention = dict(skeleton(config, torch.float32).named_parameters())
        q = attention["model.layers.0.self_attn.q_proj.weight"]
        assert tuple(q.shape) == (config.num_attention_heads * 128, config.hidden_size), name
        assert config.tie_word_embeddings == (name in {"qwen3-0.6b", "qwen3-1.7b", "qwen3-4b"})
    dense = {n for n, s in OTHER_SHAPES.items() if s.cls is Qwen3Config}  # not the mixtures
    assert set(QWEN3_PUBLISHED) == dense


def test_layers_shorten_a_qwen3_shape():
    full, short = shape_config("qwen3-8b"), shape_config("qwen3-8b", layers=2)
    assert short.num_hidden_layers == 2 and full.num_hidden_layers == 36
    assert short.head_dim == full.head_dim == 128


def test_opt_350m_is_the_released_config():
    """Unlike every other OPT size, 350m embeds in 512 and projects to its 1024 width (and
    normalises after attention, not before), as facebook/opt-350m's config.json says."""
    config = shape_config("opt-350m")
    assert (config.word_embed_proj_dim, config.do_layer_norm_before) == (512, False)
    params = dict(skeleton(config, torch.float32).named_parameters())
    assert tuple(params["model.decoder.embed_tokens.weight"].shape) == (50272, 512)
    assert tuple(params["model.decoder.project_in.weight"].shape) == (1024, 512)
    assert shape_config("opt-1.3b").word_embed_proj_dim == 2048


def test_roberta_shapes_count_the_tied_decoder_once():
    """MeZO's RoBERTa-large: 355 M parameters, its masked-LM head's decoder the word
    embeddings (counted twice: 406.9 M); 514 positions, of which 512 hold tokens."""
    for name, millions in (("roberta-base", "124.70"), ("roberta-large", "355.41")):
        model = skeleton(shape_config(name), torch.float32)
        params = dict(model.named_parameters())  # a tied head is one parameter, counted once
        assert f"{sum(p.numel() for p in params.values()) / 1e6:.2f}" == millions, name
        decoder = model.get_output_embeddings().weight
        assert decoder is model.get_input_embeddings().weight, name
        assert (model.config.model_type, model.config.max_position_embeddings) == (
            "roberta",
            514,
        )
    assert shape_config("roberta-large", layers=2).num_hidden_layers == 2
