"""The export writes what ``save_pretrained`` writes: a mixture's experts one a key (the
checkpoint's own names, which transformers 4.x, vLLM and llama.cpp read), not the fused
parameters transformers 5 holds; one file byte for byte, and sharded the same tensors."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion

from distzo import ZOConfig, ZOEngine
from distzo.export.hf_model import INDEX_NAME, export_hf
from distzo.export.original_format import original_keys, original_tensors
from tests.helpers.models import CONFIGS, build, random_batch

EXPERT_KEYS = {
    "mixtral": "model.layers.1.block_sparse_moe.experts.3.w1.weight",
    "qwen3_moe": "model.layers.1.mlp.experts.3.gate_proj.weight",
}


def _shards(folder):
    return {
        k: v for f in sorted(folder.glob("model*.safetensors")) for k, v in load_file(f).items()
    }


@pytest.mark.parametrize("name", sorted(EXPERT_KEYS))
def test_a_mixture_exports_what_save_pretrained_writes_and_loads_back_exactly(tmp_path, name):
    engine = ZOEngine(build(name), ZOConfig(lr=1e-2, eps=1e-3, seed=0, device="cpu"))
    engine.step(random_batch(64, seed=0))
    trained = engine.named_parameters()
    reference = build(name)
    reference.load_state_dict(trained, strict=False)  # every parameter; buffers as built
    reference.save_pretrained(tmp_path / "saved")
    saved = tmp_path / "saved" / "model.safetensors"
    assert EXPERT_KEYS[name] in load_file(saved)

    whole = export_hf(engine, tmp_path / "whole")
    assert (whole / "model.safetensors").read_bytes() == saved.read_bytes()
    # sharded: each fused parameter's experts in one shard, as save_pretrained keeps them
    sharded = export_hf(engine, tmp_path / "sharded", max_shard_size="20KB")
    weight_map = json.loads((sharded / INDEX_NAME).read_text())["weight_map"]
    tensors = _shards(sharded)
    assert set(weight_map) == set(tensors) == set(load_file(saved))
    assert all(torch.equal(tensors[k], v) for k, v in load_file(saved).items())
    shapes = {n: torch.empty(v.shape, device="meta") for n, v in trained.items()}
    parts = [keys for keys in original_keys(engine.model, shapes).values() if len(keys) > 1]
    assert parts and all(len({weight_map[k] for k in keys}) == 1 for keys in parts)

    loaded, info = AutoModelForCausalLM.from_pretrained(sharded, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    state = loaded.state_dict()
    assert all(torch.equal(state[k], v) for k, v in trained.items())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_parameter_reverts_alone_as_the_whole_model_does(name):
    """The streamed export reverts one parameter at a time: for every family distzo
    trains, that gives save_pretrained's keys and tensors for the whole state dict."""
    model = build(name)
    state = dict(model.named_parameters())
    whole = revert_weight_conversion(model, {k: v.detach() for k, v in state.items()})
    alone = {k: v for n, p in state.items() for k, v in original_tensors(model, n, p).items()}
    assert set(alone) == set(whole)
    assert all(torch.equal(alone[k], v) for k, v in whole.items())
    shapes = {k: torch.empty(v.shape, device="meta") for k, v in state.items()}
    assert sorted(k for keys in original_keys(model, shapes).values() for k in keys) == sorted(
        whole
    )
