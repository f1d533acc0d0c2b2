"""Rotary types whose frequencies depend on the longest position (``dynamic``,
``longrope``) read it as a Python value: computed on the device that is a host sync per
batch, so the Llama family builds their tables on the host and moves only the tables.
A "meta" device stands in for a GPU: any read of a value it holds fails there."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from distzo import family_for
from tests.helpers.models import COMMON

DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}


def tiny_llama(rope_parameters: dict | None) -> torch.nn.Module:
    torch.manual_seed(0)
    options: dict[str, Any] = {**COMMON, "max_position_embeddings": 16}
    if rope_parameters is not None:
        options["rope_parameters"] = rope_parameters
    return AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=2, **options)).eval()


@pytest.mark.parametrize("length", [8, 40])  # within, then past the trained length (growth)
def test_dynamic_rope_tables_come_from_host_positions(length):
    model = tiny_llama(DYNAMIC)
    family = family_for(model)
    mask = torch.ones(2, length, dtype=torch.long)
    on_device = family.context(mask, (2, length), torch.device("meta"), torch.float32)
    cos, sin = on_device.extras["position_embeddings"]
    assert cos.device.type == "meta" and cos.shape == (1, length, 8) and sin.shape == cos.shape
    # the host copy computes what the model's own module computes for those positions
    expected = model.model.rotary_emb(torch.empty(0), torch.arange(length).unsqueeze(0))
    host = family._host_rotary(torch.empty(0), position_ids=torch.arange(length).unsqueeze(0))
    assert all(torch.equal(a, b) for a, b in zip(host, expected))


def test_default_rope_stays_on_the_device():
    family = family_for(tiny_llama(None))
    on_device = family.context(None, (2, 8), torch.device("meta"), torch.float32)
    assert on_device.extras["position_embeddings"][0].device.type == "meta"
    assert "_host_rotary" not in vars(family)  # no host copy was made


def test_gemma_3_s_dynamic_tables_come_from_the_host_for_each_kind_of_layer():
    """Gemma 3 keeps rotary frequencies for each kind of layer (sliding, full): a dynamic
    type on the device builds each kind's tables on the host copy, asked for that kind."""
    from tests.helpers.models import CONFIGS

    config = CONFIGS["gemma3"]()
    config.max_position_embeddings = 16
    config.rope_parameters = {
        "full_attention": DYNAMIC,
        "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
    }
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    family = family_for(model)
    tables = family.context(None, (2, 40), torch.device("meta"), torch.float32).extras
    positions = torch.arange(40).unsqueeze(0)
    for kind in ("full_attention", "sliding_attention"):
        cos, sin = tables["position_embeddings"][kind]
        assert cos.device.type == "meta" and cos.shape == (1, 40, 8) == sin.shape
        expected = model.model.rotary_emb(torch.empty(0), positions, layer_type=kind)
        host = family._host_rotary(torch.empty(0), position_ids=positions, layer_type=kind)
        assert all(torch.equal(a, b) for a, b in zip(host, expected))
