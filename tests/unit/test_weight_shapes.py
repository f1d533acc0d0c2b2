"""Weights that disagree with config.json are refused from the safetensors headers, before
any tensor is read: not after the memory plan and every block but the mismatched one."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, Qwen2Config

from distzo import ZOConfig, ZOEngine
from distzo.models.weights import (
    SafetensorsWeights,
    TorchBinWeights,
    check_weights,
    open_checkpoint,
    skeleton,
)
from tests.helpers.launch import train_in_process
from tests.helpers.models import COMMON, adapted, build, tiny_opt

INDEX = "model.safetensors.index.json"


def family(name: str):
    if name == "opt":
        return tiny_opt(seed=1)
    if name == "qwen2_tied":
        from transformers import AutoModelForCausalLM

        config = Qwen2Config(num_hidden_layers=2, tie_word_embeddings=True, **COMMON)
        return AutoModelForCausalLM.from_config(config)
    return build(name, seed=1)


def saved(model, folder: Path, sharded: bool) -> Path:
    model.save_pretrained(folder, max_shard_size="20KB" if sharded else "5GB")
    return folder


def file_of(folder: Path, name: str) -> Path:
    if (folder / INDEX).exists():
        return folder / json.loads((folder / INDEX).read_text())["weight_map"][name]
    return folder / "model.safetensors"


def rewrite(file: Path, change) -> None:
    state = load_file(str(file))
    change(state)
    save_file(state, str(file), metadata={"format": "pt"})


def last_weight(folder: Path) -> str:
    """The last block's last weight by name: among the last tensors a load reaches."""
    names = [n for n in SafetensorsWeights(folder).weight_map if re.search(r"\.\d+\.", n)]
    block = max(int(re.search(r"\.(\d+)\.", n).group(1)) for n in names)  # type: ignore[union-attr]
    return sorted(n for n in names if f".{block}." in n and n.endswith("weight"))[-1]


@pytest.fixture
def no_reads(monkeypatch):
    """A source whose every tensor read fails the test: the refusal must come first."""

    def read(*args, **kwargs):
        raise AssertionError("a tensor was read before the disagreement was found")

    for source in (SafetensorsWeights, TorchBinWeights):
        monkeypatch.setattr(source, "tensor", read)
        monkeypatch.setattr(source, "tensor_range", read)


def engine_of(folder: Path, adapter: bool = False) -> ZOEngine:
    model = skeleton(AutoConfig.from_pretrained(folder), torch.float32)
    weights = open_checkpoint(folder)
    if adapter:
        from distzo.adapters.peft_adapters import AdapterSpec, AdapterWeights, attach_adapter

        model = attach_adapter(model, AdapterSpec("lora", r=4, alpha=8), seed=5)
        weights = AdapterWeights(weights, model)
    return ZOEngine(model, ZOConfig(device="cpu", seed=0), weights=weights)


@pytest.mark.parametrize("name", ["opt", "llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("sharded", [False, True])
def test_the_last_block_s_wrong_tensor_is_refused_before_any_read(
    tmp_path, no_reads, name, sharded
):
    folder = saved(family(name), tmp_path, sharded)
    wrong = last_weight(folder)
    file = file_of(folder, wrong)
    rewrite(file, lambda state: state.update({wrong: torch.zeros(3, 5)}))
    with pytest.raises(ValueError) as err:
        engine_of(folder)
    assert re.fullmatch(
        rf"{file}: checkpoint tensor {re.escape(wrong)} has shape \(3, 5\), the model expects "
        rf"\([\d, ]+\) from {folder}/config.json: the weights and config.json are of different "
        "models; download or copy the model again",
        str(err.value),
    )


@pytest.mark.parametrize("sharded", [False, True])
def test_a_tensor_no_file_holds_is_named_before_any_read(tmp_path, no_reads, sharded):
    folder = saved(build("llama", seed=1), tmp_path, sharded)
    gone = last_weight(folder)
    rewrite(file_of(folder, gone), lambda state: state.pop(gone))
    if sharded:  # the index no longer names it either
        index = json.loads((folder / INDEX).read_text())
        del index["weight_map"][gone]
        (folder / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError) as err:
        engine_of(folder)
    assert str(err.value) == (
        f"{folder}: the checkpoint has no tensor for {gone}, which the model built from "
        f"{folder}/config.json has: the weights and config.json are of different models; "
        "download or copy the model again"
    )


def test_a_shard_that_lacks_what_the_index_places_there_is_named(tmp_path, no_reads):
    folder = saved(build("llama", seed=1), tmp_path, True)
    gone = last_weight(folder)
    file = file_of(folder, gone)
    rewrite(file, lambda state: state.pop(gone))
    with pytest.raises(ValueError, match=rf"^{file}: holds no tensor {re.escape(gone)}, which "):
        engine_of(folder)


def test_an_adapter_s_base_is_checked_under_its_original_names(tmp_path, no_reads):
    folder = saved(build("llama", seed=1), tmp_path, False)
    wrong = "model.layers.2.self_attn.q_proj.weight"  # a LoRA target: base_layer in the model
    rewrite(folder / "model.safetensors", lambda state: state.update({wrong: torch.zeros(3, 5)}))
    with pytest.raises(ValueError, match=rf"checkpoint tensor {re.escape(wrong)} has shape \(3, 5"):
        engine_of(folder, adapter=True)


@pytest.mark.parametrize("name", ["opt", "llama", "llama_tied", "gpt2", "qwen2", "qwen2_tied"])
@pytest.mark.parametrize("layout", ["single", "sharded", "base"])
def test_every_family_s_own_checkpoint_passes_tied_heads_absent_or_not(tmp_path, name, layout):
    model = family(name)
    tied = model.config.tie_word_embeddings
    if layout == "base" and not tied:
        pytest.skip("a base model's checkpoint holds no head: only a tied one may lack it")
    folder = saved(model, tmp_path, layout == "sharded")
    if layout == "base":  # as facebook/opt-* and gpt2 ship theirs: no prefix, no tied head
        prefix = model.base_model_prefix + "."
        state = {
            k.removeprefix(prefix): v
            for k, v in load_file(str(folder / "model.safetensors")).items()
            if k != "lm_head.weight"
        }
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    shaped = skeleton(AutoConfig.from_pretrained(folder), torch.float32)
    check_weights(open_checkpoint(folder), shaped)  # no error
    assert ("lm_head.weight" in dict(shaped.named_parameters())) != tied


def test_a_tied_weight_saved_under_the_head_s_name_alone_loads(tmp_path):
    """safetensors' ``save_model`` keeps one name of a shared tensor, the first sorted:
    ``lm_head.weight``, not the embedding's. Every name of a tied weight is one it may be
    read under, in the check and in the load."""
    from safetensors.torch import save_model

    model = tiny_opt(seed=1)
    model.config.save_pretrained(tmp_path)
    save_model(model, str(tmp_path / "model.safetensors"))
    assert "model.decoder.embed_tokens.weight" not in load_file(tmp_path / "model.safetensors")
    engine = engine_of(tmp_path)
    embed = model.get_input_embeddings().weight
    assert torch.equal(engine.named_parameters()["model.decoder.embed_tokens.weight"], embed)


def test_an_adapted_model_s_own_checkpoint_passes(tmp_path):
    from distzo.adapters.peft_adapters import AdapterWeights

    folder = saved(build("llama", seed=1), tmp_path, True)
    model = adapted("llama")  # the same shape as build("llama")
    weights = AdapterWeights(open_checkpoint(folder), model)
    check_weights(weights, model.get_base_model())


def test_the_job_refuses_an_edited_config_json_before_its_memory_plan(tmp_path, no_reads):
    folder = saved(tiny_opt(seed=1), tmp_path / "model", False)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "ffn_dim": 2 * config["ffn_dim"]}))
    done = train_in_process(["--model", str(folder), "--output-dir", str(tmp_path / "run")])
    assert done.returncode != 0
    assert "memory plan" not in done.stderr
    assert f"{folder}/model.safetensors: checkpoint tensor model.decoder.layers.0.fc1" in (
        done.stderr
    )
    assert "Traceback" not in done.stderr
