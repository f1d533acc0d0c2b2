"""Gemma 3 4B and larger (model type gemma3: a vision tower, a projector and a text model):
``--model`` trains the text model, equal to transformers' multimodal class on text, and the
export is that class again, its vision tower the checkpoint's bit for bit."""

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    Gemma3ForConditionalGeneration,
)

from distzo.config.job import resolve
from distzo.dist import LaunchEnv
from distzo.job.trainer import Trainer, TrainerCallback
from distzo.job.validation import check_model
from distzo.models import family_for
from distzo.models.multimodal import checkpoint_model, origin_of
from distzo.models.weights import check_weights, expected_tensors
from tests.helpers.models import save_multimodal

STEPS = 6


def reference(folder: Path) -> Gemma3ForConditionalGeneration:
    return AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()


def loaded_text_model(folder: Path):
    """The text model distzo trains, its weights read through the streamed source."""
    config = AutoConfig.from_pretrained(folder)
    built, weights = checkpoint_model(folder, config, torch.float32)
    model: Any = built
    check_weights(weights, model)
    values = {}
    for names, shape in expected_tensors(model):
        for name in names:
            values[name] = weights.tensor(names, shape, torch.float32)
    model.load_state_dict(values, assign=True, strict=False)
    model.tie_weights()
    return model.eval()


@pytest.mark.parametrize("layout", ["legacy", "current", "untied"])
@pytest.mark.parametrize("pad", ["none", "left", "right"])
def test_the_blockwise_forward_equals_the_multimodal_model_on_text(tmp_path, layout, pad):
    folder = save_multimodal(tmp_path / "mm", layout)
    model = loaded_text_model(folder)
    assert not any("vision" in n or "projector" in n for n, _ in model.named_parameters())
    torch.manual_seed(1)
    ids = torch.randint(1, 60, (2, 9))
    mask = torch.ones_like(ids)
    if pad == "left":
        mask[0, :3] = 0
    elif pad == "right":
        mask[0, -3:] = 0
    with torch.no_grad():
        ours, _ = family_for(model).forward(ids, mask)
        theirs = reference(folder)(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], rtol=1e-5, atol=1e-5)


def test_the_streamed_load_reads_only_the_language_model(tmp_path):
    folder = save_multimodal(tmp_path / "mm")
    config = AutoConfig.from_pretrained(folder)
    model, weights = checkpoint_model(folder, config, torch.float32)
    read: list[str] = []
    tensor = weights.tensor
    weights.tensor = lambda names, *a: read.append(weights._key(names[0])) or tensor(names, *a)
    for names, shape in expected_tensors(model):
        weights.tensor(names, shape, torch.float32)
    assert read and all(key.startswith("language_model.") for key in read)
    origin = origin_of(model)
    assert origin is not None and origin.left_alone
    assert all(k.startswith(("vision_tower.", "multi_modal_projector.")) for k in origin.left_alone)


def job(folder: Path, out: Path, *flags: str):
    return resolve(
        ["--model", str(folder), "--task", "counting", "--seq-len", "8", "--lr", "1e-3"]
        + ["--max-steps", str(STEPS), "--device", "cpu", "--log-every", "0"]
        + ["--output-dir", str(out), "--dtype", "fp64", *flags]
    )


def check_export(export: Path, folder: Path, trained: dict[str, torch.Tensor], origin) -> None:
    """The export is the multimodal class: its vision tower and projector the checkpoint's
    own tensors (dtype and bits), its text weights the engine's."""
    with safe_open(str(export / "model.safetensors"), "pt") as out:
        with safe_open(str(folder / "model.safetensors"), "pt") as source:
            for key in origin.left_alone:
                assert out.get_tensor(key).dtype == source.get_tensor(key).dtype
                assert torch.equal(out.get_tensor(key), source.get_tensor(key))
    loaded = AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float64)
    assert type(loaded) is Gemma3ForConditionalGeneration
    # what loaders that pick the class by config.json's architectures (not model_type) read
    assert AutoConfig.from_pretrained(export).architectures == ["Gemma3ForConditionalGeneration"]
    state = loaded.state_dict()
    for name, value in trained.items():
        torch.testing.assert_close(state[origin.canonical(name)], value, rtol=0, atol=0)


def text_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_the_export_plans_the_vision_tower_from_the_headers(tmp_path, monkeypatch):
    """The export sizes its shards by the tensors it copies without reading them: a 27B
    checkpoint's vision tower was read once to plan and again to write, on every rank."""
    from distzo.export.multimodal import multimodal_shapes
    from distzo.models.weights import SafetensorsWeights

    folder = save_multimodal(tmp_path / "mm")
    model, _ = checkpoint_model(folder, AutoConfig.from_pretrained(folder), torch.float32)
    origin = origin_of(model)
    assert origin is not None

    def unread(self, key):
        raise AssertionError(f"{key} was read to plan the export")

    monkeypatch.setattr(SafetensorsWeights, "stored_tensor", unread)
    planned = multimodal_shapes(origin, {})
    with safe_open(str(folder / "model.safetensors"), "pt") as source:
        for key in origin.left_alone:
            stored = source.get_tensor(key)
            assert planned[key].is_meta and planned[key].dtype == stored.dtype == torch.bfloat16
            assert planned[key].shape == stored.shape


def test_full_tuning_exports_the_multimodal_model_and_resumes_exactly(tmp_path):
    from transformers import AutoImageProcessor, Gemma3ImageProcessorPil

    folder = save_multimodal(tmp_path / "mm")
    Gemma3ImageProcessorPil(size={"height": 28, "width": 28}).save_pretrained(folder)
    with Trainer(job(folder, tmp_path / "full")) as full:
        full.train()
        trained = full.engine.named_parameters()
        origin = origin_of(full.engine.model)
    start = loaded_text_model(folder).double().state_dict()
    assert any(not torch.equal(trained[n], start[n]) for n in trained)  # it trained
    export = tmp_path / "full" / "export"
    check_export(export, folder, trained, origin)
    processor = "preprocessor_config.json"  # the checkpoint's, which takes the images
    assert (export / processor).read_bytes() == (folder / processor).read_bytes()
    assert AutoImageProcessor.from_pretrained(export).size == {"height": 28, "width": 28}
    exported = (export / "model.safetensors").read_bytes()

    class StopAt(TrainerCallback):
        def on_step_start(self, trainer: Trainer, step: int) -> None:
            if step == 4:
                raise RuntimeError("stopped")

    stopped = tmp_path / "stopped"
    first = Trainer(
        job(folder, stopped, "--save-steps", "3", "--no-save-async"), callbacks=[StopAt()]
    )
    with first, pytest.raises(RuntimeError, match="stopped"):
        first.train()
    with Trainer(job(folder, stopped, "--resume")) as second:
        second.train()
    assert (stopped / "export" / "model.safetensors").read_bytes() == exported


def test_an_untied_head_trains_and_exports_as_its_own(tmp_path):
    """A checkpoint whose multimodal config unties the head (its text config says tied):
    the head trains apart from the embedding and is exported under the checkpoint's key."""
    folder = save_multimodal(tmp_path / "mm", "untied")
    with Trainer(job(folder, tmp_path / "run")) as run:
        run.train()
        trained = run.engine.named_parameters()
        origin = origin_of(run.engine.model)
    assert "lm_head.weight" in trained and origin is not None
    assert origin.exported("lm_head.weight") == "language_model.lm_head.weight"
    check_export(tmp_path / "run" / "export", folder, trained, origin)


def test_lora_exports_load_on_the_multimodal_base(tmp_path):
    from peft import PeftModel

    folder = save_multimodal(tmp_path / "mm")
    lora = ("--peft", "lora", "--lora-r", "2")
    with Trainer(job(folder, tmp_path / "adapter", *lora)) as run:
        run.train()
    with Trainer(job(folder, tmp_path / "merged", *lora, "--merge-adapter")) as merged_run:
        merged_run.train()
    ids = torch.randint(1, 60, (2, 7))
    base = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float64)
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter" / "export").eval()
    targets = adapted.peft_config["default"].target_modules
    assert targets and all(t.startswith("model.language_model.layers.") for t in targets)
    adapted_modules = [n for n, m in adapted.named_modules() if hasattr(m, "lora_A")]
    assert adapted_modules and not any("vision" in n for n in adapted_modules)
    merged = AutoModelForImageTextToText.from_pretrained(
        tmp_path / "merged" / "export", dtype=torch.float64
    ).eval()
    torch.testing.assert_close(text_logits(adapted, ids), text_logits(merged, ids))
    fresh = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float64).eval()
    assert not torch.equal(text_logits(merged, ids), text_logits(fresh, ids))  # it trained
    state, start = merged.state_dict(), fresh.state_dict()
    untouched = [n for n in start if "vision_tower" in n or "multi_modal_projector" in n]
    assert untouched and all(torch.equal(state[n], start[n]) for n in untouched)


def test_a_prefix_exports_and_loads_on_the_multimodal_base(tmp_path):
    # peft sizes a prefix table from the multimodal config's text_config: the text model's
    # table, whose layers are the language model's
    from peft import PeftModel

    folder = save_multimodal(tmp_path / "mm")
    prefix = ("--peft", "prefix", "--prefix-length", "3")
    with Trainer(job(folder, tmp_path / "run", *prefix)) as run:
        run.train()
        ids = torch.randint(1, 60, (2, 7))
        mask = torch.ones_like(ids)
        mask[0, :2] = 0
        ours, _ = run.engine.forward({"input_ids": ids, "attention_mask": mask})
    base = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float64)
    adapted = PeftModel.from_pretrained(base, tmp_path / "run" / "export").eval()
    assert adapted.peft_config["default"].peft_type == "PREFIX_TUNING"
    with torch.no_grad():
        theirs = adapted(input_ids=ids, attention_mask=mask).logits
        plain = base(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(plain[real], theirs[real], atol=1e-3)  # the prefix counts


def edit_config(folder: Path, edit) -> None:
    import json

    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


def test_a_text_config_of_another_family_is_one_line(tmp_path):
    """transformers builds Gemma 3's text model of a text_config that says llama; the llama
    adapter would run it, and the first forward died in a traceback."""
    folder = save_multimodal(tmp_path / "mm")
    edit_config(folder, lambda c: c["text_config"].update(model_type="llama"))
    run = job(folder, tmp_path / "run")
    with pytest.raises(ValueError, match="text_config says model_type 'llama', where a gemma3"):
        check_model(run, run.engine_config("cpu"), LaunchEnv())


def sharded(folder: Path) -> Path:
    """``folder``'s single file as two shards and an index, the vision tower's apart."""
    import json

    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    text = {k: v for k, v in state.items() if k.startswith("language_model.")}
    rest = {k: v for k, v in state.items() if k not in text}
    files = {"model-00001-of-00002.safetensors": text, "model-00002-of-00002.safetensors": rest}
    weight_map = {}
    for name, part in files.items():
        save_file(part, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def test_the_vision_tower_is_checked_before_training(tmp_path):
    """The tensors only the export copies are checked at the build: a vision_config that
    disagrees with them trained and wrote an export transformers refuses to load, and an
    index placing one in a shard without it failed the export after the training."""
    import json

    folder = save_multimodal(tmp_path / "mm")
    edit_config(folder, lambda c: c["vision_config"].update(hidden_size=32))
    with pytest.raises(ValueError, match=r"has shape \(.*config.json: the weights and config"):
        checkpoint_model(folder, AutoConfig.from_pretrained(folder), torch.float32)
    folder = sharded(save_multimodal(tmp_path / "lies"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["vision_tower.post_layernorm.weight"] = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="holds no tensor vision_tower.post_layernorm.weight"):
        checkpoint_model(folder, AutoConfig.from_pretrained(folder), torch.float32)


def test_a_sharded_checkpoint_trains_and_exports(tmp_path):
    folder = sharded(save_multimodal(tmp_path / "mm"))
    with Trainer(job(folder, tmp_path / "run", "--export-shard-size", "20KB")) as run:
        run.train()
        trained = run.engine.named_parameters()
        origin = origin_of(run.engine.model)
    export = tmp_path / "run" / "export"
    assert len(list(export.glob("*.safetensors"))) > 2
    loaded = AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float64).state_dict()
    source = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float64).state_dict()
    assert origin is not None and origin.left_alone
    for name in loaded:
        if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
            assert torch.equal(loaded[name], source[name])
    for name, value in trained.items():
        torch.testing.assert_close(loaded[origin.canonical(name)], value, rtol=0, atol=0)


def test_an_export_whose_checkpoint_moved_says_how_to_write_it(tmp_path):
    """A run of hours whose checkpoint folder moved failed its export with "<folder> holds
    no model.safetensors", naming neither the vision tower it copies nor the way back."""
    from distzo.export.multimodal import multimodal_shapes

    folder = save_multimodal(tmp_path / "mm")
    model, _ = checkpoint_model(folder, AutoConfig.from_pretrained(folder), torch.float32)
    origin = origin_of(model)
    assert origin is not None
    folder.rename(tmp_path / "moved")
    with pytest.raises(ValueError, match="copies the vision tower .* put it back there and resume"):
        multimodal_shapes(origin, {})


@pytest.mark.parametrize("outer", ["model.language_model.", "language_model."])
def test_lora_targets_named_as_in_the_multimodal_model_are_one_line(tmp_path, outer):
    """The exported adapter_config.json names its modules as the multimodal model does; the
    same names given as --lora-targets were refused by peft with only "not found". Older
    transformers named the language model ``language_model.`` at the top."""
    folder = save_multimodal(tmp_path / "mm")
    target = f"{outer}layers.0.self_attn.q_proj"
    named = job(folder, tmp_path / "run", "--peft", "lora", "--lora-targets", target)
    message = (
        f"--lora-targets {target}: the multimodal "
        "model's name of a text-model module; name it as the text model that trains does "
        "(layers.0.self_attn.q_proj, or a suffix such as q_proj): the export names it as the "
        "multimodal model does"
    )
    with pytest.raises(ValueError) as err:
        check_model(named, named.engine_config("cpu"), LaunchEnv())
    assert str(err.value) == message


@pytest.mark.parametrize("shard", ["20KB", "5GB"])
def test_the_memory_plan_counts_the_vision_tower_the_export_holds(tmp_path, monkeypatch, shard):
    # rank 0 holds each shard's tensors before writing it, the vision tower's among them
    from distzo import ZOConfig, ZOEngine
    from distzo.job.memory_plan import PlannedExport, plan_memory
    from tests.helpers.engines import export_shard_bytes

    folder = save_multimodal(tmp_path / "mm")
    model, weights = checkpoint_model(folder, AutoConfig.from_pretrained(folder), torch.float32)
    config = ZOConfig(device="cpu", seed=0)
    plan = plan_memory(model, config, 1, False, 2, 8, async_save=False, export=PlannedExport(shard))
    engine = ZOEngine(model, config, weights=weights)
    held = export_shard_bytes(monkeypatch, engine, tmp_path / "export", shard)
    block = max(layout.numel for layout in engine.block_layouts) * 4
    assert (len(held) > 1) == (shard == "20KB")
    assert plan.export_bytes - block == max(held)
