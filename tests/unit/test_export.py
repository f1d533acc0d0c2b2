"""The export streams the model out block by block in Hugging Face's format, sharded as
``save_pretrained`` would shard it, and loads back into transformers exactly."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from distzo import ZOConfig, ZOEngine
from distzo.export import hf_model
from distzo.export.hf_model import (
    INDEX_NAME,
    check_shard_size,
    export_adapter,
    export_hf,
    export_model,
)
from distzo.job.checkpoint import Checkpointer, latest_checkpoint
from tests.helpers.models import adapted, build, random_batch, tiny_opt


def trained(model, mode="offload", steps=3):
    engine = ZOEngine(
        model, ZOConfig(mode=mode, lr=1e-2, eps=1e-3, seed=0, device="cpu", noise_chunk=500)
    )
    for step in range(steps):
        engine.step(random_batch(64, pad="left", seed=step))
    return engine


@pytest.mark.parametrize(
    "name",
    ["llama", "llama_tied", "qwen3", "gpt2", "phi3", "gemma3", "granite", "qwen3_moe", "mixtral"],
)
def test_a_sharded_export_loads_back_exactly(tmp_path, name):
    engine = trained(build(name))
    expected = engine.named_parameters()
    out = export_hf(engine, tmp_path / "export", max_shard_size="20KB")
    assert out == tmp_path / "export" and not (tmp_path / "export.tmp").exists()
    index = json.loads((out / INDEX_NAME).read_text())
    files = sorted(out.glob("model-*.safetensors"))
    assert len(files) > 1 and not (out / "model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == [f.name for f in files]
    shards = {f.name: load_file(str(f)) for f in files}
    assert index["weight_map"] == {key: file for file, s in shards.items() for key in s}
    if "moe" not in name and name != "mixtral":  # a mixture's experts: one key an expert
        assert set(index["weight_map"]) == set(engine.canonical_names)
    sizes = {
        file: sum(t.numel() * t.element_size() for t in s.values()) for file, s in shards.items()
    }
    assert index["metadata"]["total_size"] == sum(sizes.values())
    # an oversized tensor alone, or the experts of one fused parameter, kept together
    for file, size in sizes.items():
        keys = list(shards[file])
        experts = {key.split(".experts.")[0] if ".experts." in key else key for key in keys}
        assert size <= 20_000 or len(keys) == 1 or len(experts) == 1, file

    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for key, value in loaded.state_dict().items():
        if key in expected:  # parameters (buffers such as rotary tables are not saved)
            assert torch.equal(value, expected[key]), key
    batch = random_batch(64, pad="left", seed=9)
    with torch.no_grad():
        logits, _ = engine.forward(batch)
        reference = loaded.eval()(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits
    keep = batch["attention_mask"].bool()
    assert (reference - logits)[keep].abs().max().item() <= 1e-5


def test_a_small_model_is_one_file_with_its_config_dtype(tmp_path):
    engine = trained(tiny_opt(seed=0, dtype=torch.float64), mode="resident")
    live = engine.model.config.to_dict()
    out = export_hf(engine, tmp_path / "export")
    assert (out / "model.safetensors").exists() and not (out / INDEX_NAME).exists()
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float64" and config["architectures"] == ["OPTForCausalLM"]
    assert engine.model.config.to_dict() == live  # the export wrote a copy of the config
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.float64


def test_a_rank_that_does_not_write_materialises_nothing():
    engine = trained(tiny_opt(seed=0))
    assert list(engine.stream_parameters(materialize=False)) == []
    streamed = dict(engine.stream_parameters())
    assert list(streamed) == engine.canonical_names
    params = engine.named_parameters()
    for name, value in streamed.items():
        assert torch.equal(value, params[name])
        # its own storage
        assert value.untyped_storage().nbytes() == value.numel() * value.element_size()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_checkpoint_and_the_export_round_trip_on_the_device(tmp_path, device):
    # The paths a run ends with (asynchronous DCP save, load, streamed export) on the
    # device that trained: on CUDA, through pinned host buckets and the upload stream.
    # Two queries per step: the checkpoint's pending update carries two g.
    def engine(num_queries=2):
        config = ZOConfig(
            mode="offload",
            device=device,
            lr=1e-2,
            eps=1e-3,
            weight_decay=0.1,
            seed=0,
            num_queries=num_queries,
        )
        return ZOEngine(tiny_opt(seed=0, num_hidden_layers=3), config)

    first = engine()
    for step in range(3):
        first.step(random_batch(64, pad="left", seed=step))
    saver = Checkpointer(tmp_path / "checkpoints", first)
    saver.save(asynchronous=True)
    saver.wait()
    latest = latest_checkpoint(tmp_path / "checkpoints")
    second = engine()
    assert Checkpointer(tmp_path / "checkpoints", second).load(latest) == 3
    batch = random_batch(64, pad="left", seed=7)
    at_save = first.named_parameters()  # a flush: it does not change the trajectory
    assert first.step(batch) == second.step(batch)  # the resumed engine takes the same step
    # A run resumed with another number of queries still applies the saved update whole.
    single = engine(num_queries=1)
    Checkpointer(tmp_path / "checkpoints", single).load(latest)
    assert len(single.pending.projected_grads) == 2
    for name, value in single.named_parameters().items():
        assert torch.equal(value, at_save[name]), name

    out = export_hf(first, tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(out).to(device).eval()
    logits, _ = first.forward(batch)
    with torch.no_grad():
        reference = loaded(
            input_ids=batch["input_ids"].to(device),
            attention_mask=batch["attention_mask"].to(device),
        ).logits
    keep = batch["attention_mask"].bool().to(device)
    assert (reference - logits)[keep].abs().max().item() <= 1e-5


@pytest.mark.parametrize("size", ["lots", "1000", "-1GB"])
def test_an_unreadable_shard_size_is_a_clear_error(size):
    with pytest.raises(ValueError, match="is not a size; write e.g. 5GB"):
        check_shard_size(size)


def test_export_hf_refuses_its_own_bad_arguments_by_name_before_writing(tmp_path):
    """From Python, merged=True on a fully trained model failed deep in the shard plan
    (AttributeError: 'NoneType' object has no attribute 'entries'), and an unreadable
    max_shard_size was transformers' "Unit 'GS' not supported", naming neither argument."""
    engine = trained(tiny_opt(), steps=1)
    with pytest.raises(ValueError, match="merged=True folds an adapter .* with merged=False$"):
        export_hf(engine, tmp_path / "merged", merged=True)
    with pytest.raises(ValueError, match="^max_shard_size '5 gigs' is not a size; write e.g. 5GB"):
        export_hf(engine, tmp_path / "sized", max_shard_size="5 gigs")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_export_adapter_of_a_model_without_one_names_the_call_and_the_fix(tmp_path):
    """It said "frozen=True reads the frozen base of an adapter run; there is none", an
    argument of an internal call the user never passed."""
    engine = trained(tiny_opt(), steps=1)
    with pytest.raises(ValueError, match="^export_adapter writes a peft adapter, .* has none: "):
        export_adapter(engine, tmp_path / "adapter")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_export_model_refuses_merge_adapter_without_an_adapter_before_writing(tmp_path):
    """merge_adapter=True on a model without peft was quietly ignored: the full model was
    written, as if the flag meant nothing (export_hf(merged=True) refuses the same)."""
    engine = trained(tiny_opt(), steps=1)
    with pytest.raises(ValueError, match="^merge_adapter=True merges .* with merge_adapter=False$"):
        export_model(engine, tmp_path / "merged", merge_adapter=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("adapter", [False, True])
def test_a_tokenizer_given_by_name_is_refused_before_any_shard(tmp_path, adapter):
    """tokenizer="gpt2" failed with "'str' object has no attribute 'save_pretrained'" once
    every shard was written, and left the half-written ``<name>.tmp`` behind."""
    engine = trained(adapted("opt") if adapter else tiny_opt(), steps=1)
    with pytest.raises(TypeError, match="^tokenizer must be a transformers tokenizer .* got a str"):
        export_model(engine, tmp_path / "export", tokenizer="gpt2")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_export_that_fails_on_the_way_leaves_no_staging_folder(tmp_path, monkeypatch):
    """Only an OSError removed ``<name>.tmp``: any other error left the shards written so far."""

    def fails(*args):
        raise RuntimeError("a config that does not serialise")

    monkeypatch.setattr(hf_model, "_write_configs", fails)
    with pytest.raises(RuntimeError, match="does not serialise"):
        export_hf(trained(tiny_opt(), steps=1), tmp_path / "export")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_export_leaves_a_folder_with_files_unless_asked_to_replace_it(tmp_path):
    engine = trained(tiny_opt(), steps=1)
    folder = tmp_path / "my-models"
    (folder / "other-model").mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="the folder holds files; pass overwrite=True"):
        export_hf(engine, folder)
    assert (folder / "notes.txt").read_text() == "mine" and not (
        tmp_path / "my-models.tmp"
    ).exists()
    export_hf(engine, folder, overwrite=True)
    assert (folder / "model.safetensors").is_file() and not (folder / "notes.txt").exists()


@pytest.mark.parametrize("export", [export_model, export_hf, export_adapter])
def test_an_overwrite_that_is_no_bool_is_refused_and_the_folder_kept(tmp_path, export):
    """overwrite="no" (or "False", or 0.0 read from a config) is truthy: the export replaced
    the user's folder, files and all."""
    engine = trained(adapted("opt"), steps=1)
    folder = tmp_path / "my-models"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(TypeError, match="^overwrite must be True or False, got str 'no': "):
        export(engine, folder, overwrite="no")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my-models"]
    assert (folder / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("export, flag", [(export_model, "merge_adapter"), (export_hf, "merged")])
def test_a_merge_flag_that_is_no_bool_is_refused_before_writing(tmp_path, export, flag):
    """merge_adapter="no" (merged="no") is truthy: the adapter run's base was written with
    the adapter merged in, the export the user said no to."""
    engine = trained(adapted("opt"), steps=1)
    with pytest.raises(TypeError, match=rf"^{flag} must be True or False, got str 'no': True "):
        export(engine, tmp_path / "export", **{flag: "no"})
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_checkpointer_from_python_saves_a_complete_checkpoint_at_once(tmp_path):
    """save() once left only step-N.tmp unless the caller knew to wait(); a str directory
    failed inside."""
    engine = trained(tiny_opt(), mode="resident", steps=2)
    Checkpointer(str(tmp_path), engine).save()
    assert latest_checkpoint(str(tmp_path)) == tmp_path / "step-2"


def test_an_out_that_is_a_dangling_link_or_under_a_file_is_refused(tmp_path, monkeypatch):
    """``--out``: a link is someone's (replaced only with --overwrite, even one that points
    nowhere); a path under a file is named before any model is built."""
    from distzo.export.out_dir import check_out

    monkeypatch.chdir(tmp_path)
    link = tmp_path / "latest"
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(ValueError, match="the file exists; add --overwrite"):
        check_out(link, overwrite=False)
    assert check_out(link, overwrite=True) == link
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="notes.txt is a file, not a directory"):
        check_out(tmp_path / "notes.txt" / "model", overwrite=False)


def test_publishing_over_a_link_replaces_the_link_and_keeps_what_it_pointed_to(tmp_path):
    from distzo.export.out_dir import publish

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    link = tmp_path / "latest"
    link.symlink_to(mine)
    staged = tmp_path / "latest.tmp"
    staged.mkdir()
    (staged / "model.safetensors").write_text("weights")
    publish(staged, link)
    assert not link.is_symlink() and (link / "model.safetensors").read_text() == "weights"
    assert (mine / "notes.txt").read_text() == "mine"
