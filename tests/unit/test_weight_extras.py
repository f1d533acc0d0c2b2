"""A checkpoint that holds more than the model config.json describes (its layers past
config.json's count) is refused before any tensor is read, as transformers reports such
keys unexpected: before, the job trained the smaller model and dropped the rest silently.
The keys a model's class ignores (transformers' own rule) still pass."""

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

from distzo.config import ZOConfig
from distzo.engine import ZOEngine
from distzo.models.weights import SafetensorsWeights, open_checkpoint, skeleton
from distzo.objectives import Classification
from tests.helpers.launch import train_in_process
from tests.helpers.masked_prompts import save_tiny_roberta
from tests.helpers.models import build, tiny_opt
from tests.unit.test_weight_shapes import engine_of, family, no_reads, saved

__all__ = ["no_reads"]  # the fixture, used by name

MESSAGE = (
    r"{file}: holds {count} tensors the model built from {folder}/config\.json has no place "
    r"for \({first}, \S+, \S+ and \d+ more\), which training would drop: the weights are of a "
    r"larger model than config\.json describes \(more layers\?\); give the folder the "
    r"config\.json of the model the weights are"
)


def one_layer_less(folder: Path) -> Path:
    """``folder``'s config.json edited to say one layer less than its weights hold."""
    config = json.loads((folder / "config.json").read_text())
    key = "n_layer" if "n_layer" in config else "num_hidden_layers"
    config[key] -= 1
    if "layer_types" in config:  # Qwen2's, one per layer
        config["layer_types"] = config["layer_types"][: config[key]]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def natural(key: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


def transformers_unexpected(folder: Path) -> list[str]:
    """The keys ``from_pretrained`` reports unexpected for ``folder``: the reference."""
    loaded: Any = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    return sorted(loaded[1]["unexpected_keys"])


@pytest.mark.parametrize("name", ["opt", "llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("sharded", [False, True])
def test_a_checkpoint_of_more_layers_is_refused_before_any_read(tmp_path, no_reads, name, sharded):
    folder = one_layer_less(saved(family(name), tmp_path, sharded))
    unexpected = transformers_unexpected(folder)
    last = AutoModelForCausalLM.from_pretrained(folder).config.num_hidden_layers
    assert unexpected and all(f".{last}." in key for key in unexpected)  # the last layer's
    first = min(unexpected, key=natural)
    with pytest.raises(ValueError) as err:
        engine_of(folder)
    assert re.fullmatch(
        MESSAGE.format(
            file=re.escape(str(folder / SafetensorsWeights(folder).weight_map[first])),
            count=len(unexpected),  # the same keys as transformers, its ignored ones passed
            folder=re.escape(str(folder)),
            first=re.escape(first),
        ),
        str(err.value),
    ), str(err.value)


def test_an_adapter_s_base_of_more_layers_is_refused(tmp_path, no_reads):
    folder = one_layer_less(saved(build("llama", seed=1), tmp_path, True))
    with pytest.raises(ValueError, match=r"holds 9 tensors the model built from "):
        engine_of(folder, adapter=True)


def extra(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    file = folder / "model.safetensors"
    save_file({**load_file(str(file)), **tensors}, str(file), metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("name", "key", "value"),
    [  # GPT-2's causal masks (openai-community/gpt2 holds them); old Llamas' rotary tables
        ("gpt2", "transformer.h.{}.attn.bias", torch.ones(1, 1, 64, 64, dtype=torch.bool)),
        ("llama", "model.layers.{}.self_attn.rotary_emb.inv_freq", torch.ones(4)),
    ],
)
def test_keys_the_model_class_ignores_pass(tmp_path, name, key, value):
    folder = saved(family(name), tmp_path, False)
    extra(folder, {key.format(i): value.clone() for i in range(3)})
    assert transformers_unexpected(folder) == []
    engine_of(folder)  # no error


@pytest.mark.parametrize(
    ("layers", "said"),
    [
        ([9], "1 tensor the model built from {config} has no place for ({names})"),
        ([10, 2, 9], "3 tensors the model built from {config} has no place for ({names})"),
    ],
    ids=["one", "three"],
)
def test_a_few_extra_tensors_are_counted_and_named_in_layer_order(tmp_path, layers, said):
    """The refusal names up to three of the tensors, layer 2 before layer 10, and says
    "and N more" only where there are more: a user looks for the first layer too many."""
    folder = saved(family("llama"), tmp_path, False)
    extra(folder, {f"model.layers.{i}.extra.weight": torch.ones(4) for i in layers})
    names = ", ".join(f"model.layers.{i}.extra.weight" for i in sorted(layers))
    with pytest.raises(ValueError) as err:
        engine_of(folder)
    text = said.format(config=folder / "config.json", names=names)
    assert f"{folder / 'model.safetensors'}: holds {text}, which training " in str(err.value)


def test_a_shard_s_tensor_its_index_does_not_list_is_refused(tmp_path):
    """transformers loads every tensor of the shards its index names, listed or not: one a
    shard holds beyond the index is as unexpected as one the index lists."""
    folder = saved(family("llama"), tmp_path, True)
    shard = sorted(folder.glob("*.safetensors"))[-1]
    tensors = {**load_file(str(shard)), "model.layers.7.extra.weight": torch.ones(4)}
    save_file(tensors, str(shard), metadata={"format": "pt"})
    assert transformers_unexpected(folder) == ["model.layers.7.extra.weight"]
    with pytest.raises(ValueError, match=rf"^{re.escape(str(shard))}: holds 1 tensor the "):
        engine_of(folder)


def test_the_job_refuses_a_checkpoint_of_more_layers_before_its_memory_plan(tmp_path, no_reads):
    folder = one_layer_less(saved(tiny_opt(seed=1), tmp_path / "model", False))
    done = train_in_process(["--model", str(folder), "--output-dir", str(tmp_path / "run")])
    assert done.returncode != 0
    assert "memory plan" not in done.stderr
    assert f"{folder}/model.safetensors: holds 16 tensors the model built from " in done.stderr
    assert "Traceback" not in done.stderr


def as_bin(folder: Path) -> Path:
    """``folder``'s safetensors checkpoint rewritten as ``.bin`` files (and their index), as
    older hub models ship (facebook/opt-30b): transformers 5 writes safetensors only."""
    from tests.unit.test_weight_shapes import INDEX

    index = folder / INDEX
    for file in sorted(folder.glob("*.safetensors")):
        torch.save(
            load_file(str(file)),
            file.with_name(file.stem.replace("model", "pytorch_model") + ".bin"),
        )
        file.unlink()
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {
            key: value.replace("model", "pytorch_model").replace(".safetensors", ".bin")
            for key, value in data["weight_map"].items()
        }
        (folder / "pytorch_model.bin.index.json").write_text(json.dumps(data))
        index.unlink()
    return folder


@pytest.mark.parametrize("sharded", [False, True])
def test_a_bin_checkpoint_is_checked_as_a_safetensors_one(tmp_path, no_reads, sharded):
    """A ``.bin`` checkpoint of more layers than config.json trained the smaller model
    silently, and one of other shapes failed only when its tensor was read (after the
    memory plan and every block before it): both are refused from the files' pickles."""
    from distzo.models.weights import TorchBinWeights, open_checkpoint

    bigger = as_bin(one_layer_less(saved(family("llama"), tmp_path / "bigger", sharded)))
    assert isinstance(open_checkpoint(bigger), TorchBinWeights)
    with pytest.raises(ValueError, match=r"\.bin: holds 9 tensors the model built from "):
        engine_of(bigger)
    other = saved(family("llama"), tmp_path / "other", sharded)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    as_bin(other)
    with pytest.raises(ValueError, match=r"\.bin: checkpoint tensor model\.layers\.0\.mlp\."):
        engine_of(other)


def test_a_roberta_checkpoint_s_pooler_is_left_out_as_its_masked_lm_leaves_it(tmp_path):
    """A pretrained RoBERTa's checkpoint holds the encoder's pooler, which
    RobertaForMaskedLM builds without (transformers loads it and reports the keys): the
    engine loads it too, its logits the model's own, and a layer too many is still refused."""
    folder = save_tiny_roberta(tmp_path / "model")
    pooler = {
        "roberta.pooler.dense.weight": torch.randn(32, 32),
        "roberta.pooler.dense.bias": torch.randn(32),
    }
    extra(folder, pooler)
    reference: Any = AutoModelForMaskedLM.from_pretrained(folder, output_loading_info=True)
    assert sorted(reference[1]["unexpected_keys"]) == sorted(pooler)
    engine = masked_engine_of(folder)
    ids = torch.tensor([[0, 5, 9, 12, 2]])
    logits, _ = engine.forward({"input_ids": ids})
    torch.testing.assert_close(logits, reference[0](input_ids=ids).logits, rtol=0, atol=0)
    one_layer_less(folder)
    with pytest.raises(ValueError, match=r"holds 16 tensors the model built from "):
        masked_engine_of(folder)


def masked_engine_of(folder: Path) -> ZOEngine:
    model = skeleton(AutoConfig.from_pretrained(folder), torch.float32)
    config = ZOConfig(device="cpu", seed=0)
    return ZOEngine(model, config, weights=open_checkpoint(folder), objective=Classification())
