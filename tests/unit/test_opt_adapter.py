import pytest
import torch

from distzo import ZOConfig, ZOEngine, family_for, load_model
from tests.helpers.models import random_batch, tiny_opt

CONFIGS = {
    "tied": {},
    "project_in_out": {"word_embed_proj_dim": 16},  # opt-350m: embeddings narrower than the blocks
    "post_layer_norm": {"word_embed_proj_dim": 16, "do_layer_norm_before": False},
}


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("pad", [None, "left", "right"])
def test_blockwise_forward_equals_the_model_forward(name, pad):
    model = tiny_opt(seed=1, num_hidden_layers=3, **CONFIGS[name]).eval()
    batch = random_batch(model.config.vocab_size, pad=pad, seed=2)
    with torch.no_grad():
        reference = model(**batch)
        logits, loss = family_for(model).forward(
            batch["input_ids"], batch["attention_mask"], batch["labels"]
        )
    assert (logits - reference.logits).abs().max().item() <= 1e-5
    assert torch.allclose(loss, reference.loss, rtol=1e-6, atol=0)


@pytest.mark.parametrize("mode", ["offload", "resident"])
def test_engine_forward_equals_the_model_forward(mode):
    model = tiny_opt(seed=3, word_embed_proj_dim=16).eval()
    batch = random_batch(model.config.vocab_size, pad="left", seed=4)
    with torch.no_grad():
        reference = model(**batch)
    engine = ZOEngine(model, ZOConfig(mode=mode, device="cpu", seed=0))
    logits, loss = engine.forward(batch)
    assert (logits - reference.logits).abs().max().item() <= 1e-5
    assert torch.allclose(loss, reference.loss, rtol=1e-6, atol=0)


def test_tied_head_is_one_parameter_in_one_bucket():
    engine = ZOEngine(tiny_opt(), ZOConfig(device="cpu", seed=0))
    entries = [e for e in engine.resident_layout.entries if "lm_head.weight" in e.names]
    assert len(entries) == 1 and "model.decoder.embed_tokens.weight" in entries[0].names
    params = engine.named_parameters()
    assert params["lm_head.weight"] is params["model.decoder.embed_tokens.weight"]
    # every model parameter is either resident or in exactly one block
    total = sum(p.numel() for p in tiny_opt().parameters())
    assert engine.num_parameters == total


def test_labels_of_minus_100_are_ignored():
    model = tiny_opt(seed=5).eval()
    batch = random_batch(model.config.vocab_size, pad="right", seed=6)
    labels = batch["labels"].clone()
    labels[:, :6] = -100  # a prompt whose tokens are not trained on
    with torch.no_grad():
        logits, loss = family_for(model).forward(
            batch["input_ids"], batch["attention_mask"], labels
        )
    targets = labels[:, 1:]
    keep = targets != -100
    expected = torch.nn.functional.cross_entropy(logits[:, :-1][keep], targets[keep])
    assert torch.allclose(loss, expected, rtol=1e-6)
    assert torch.allclose(loss, model(**batch | {"labels": labels}).loss, rtol=1e-6)


def test_loads_from_a_local_directory(tmp_path):
    model = tiny_opt(seed=7)
    model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
