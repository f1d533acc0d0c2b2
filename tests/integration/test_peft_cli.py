"""Adapter runs through the command line: resume, replay, the export, every layout."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM

from distzo.models.tiny import byte_tokenizer
from tests.helpers.launch import (
    RESUMABLE_RUN,
    child_env,
    python_replay,
    python_train,
    run_python,
    torchrun,
)
from tests.helpers.models import LLAMA

COMMON = [
    "--max-steps",
    "8",
    *RESUMABLE_RUN,
    "--eval-batch-size",
    "8",
    "--lora-r",
    "4",
]


def grads(run):
    return [
        json.loads(line)["projected_grad"]
        for line in (run / "metrics.jsonl").read_text().splitlines()
    ]


def adapter(run):
    return load_file(str(run / "export" / "adapter_model.safetensors"))


def assert_same(a, b, rel=0.0):
    assert a.keys() == b.keys()
    for k in a:
        assert ((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)).item() <= rel, k


def test_a_lora_fa_run_resumes_and_replays_exactly(tmp_path):
    flags = COMMON + ["--peft", "lora-fa"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    proc = python_train(flags + ["--output-dir", str(full)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in (full / "export").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    config = json.loads((full / "export" / "adapter_config.json").read_text())
    assert (
        config["peft_type"] == "LORA"
        and config["r"] == 4
        and set(config["target_modules"]) == {"q_proj", "v_proj"}
    )
    assert config["base_model_name_or_path"] == str(full / "base")  # what peft loads it onto
    header = json.loads((full / "seedlog.jsonl").read_text().splitlines()[0])
    assert header["peft"]["method"] == "lora-fa"
    assert "trained on a frozen base" in proc.stderr
    rank = json.loads((full / "rank0.json").read_text())
    assert rank["base_read_only"] and 0 < rank["trained_parameters"] < rank["frozen_parameters"]

    assert python_train(flags + ["--max-steps", "4", "--output-dir", str(cut)]).returncode == 0
    proc = python_train(flags + ["--output-dir", str(cut), "--resume"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert grads(cut) == grads(full)
    assert_same(adapter(cut), adapter(full))

    out = tmp_path / "replayed"
    proc = python_replay(["--log", str(full / "seedlog.jsonl"), "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert_same(load_file(str(out / "adapter_model.safetensors")), adapter(full))

    # another adapter cannot continue this run's state
    shutil.copytree(full / "checkpoints", tmp_path / "other" / "checkpoints")
    proc = python_train(
        COMMON + ["--peft", "lora", "--output-dir", str(tmp_path / "other"), "--resume"]
    )
    assert proc.returncode == 2 and "holds other trained parameters" in proc.stderr


def test_a_prefix_run_resumes_replays_and_follows_pertp(tmp_path):
    flags = COMMON + [
        "--peft",
        "prefix",
        "--prefix-length",
        "3",
        "--num-queries",
        "2",
        "--dtype",
        "fp64",
    ]
    full = tmp_path / "full"
    proc = python_train(flags + ["--save-steps", "4", "--output-dir", str(full)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = json.loads((full / "export" / "adapter_config.json").read_text())
    assert config["peft_type"] == "PREFIX_TUNING" and config["num_virtual_tokens"] == 3
    assert list(adapter(full)) == ["prompt_embeddings"]

    cut = tmp_path / "cut"  # the run as it stood at its step-4 checkpoint
    shutil.copytree(full / "checkpoints" / "step-4", cut / "checkpoints" / "step-4")
    proc = python_train(flags + ["--output-dir", str(cut), "--resume"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert grads(cut) == grads(full)[4:]
    assert_same(adapter(cut), adapter(full))

    out = tmp_path / "replayed"  # the real init is redone from the run seed, then the logged steps
    proc = python_replay(["--log", str(full / "seedlog.jsonl"), "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert_same(load_file(str(out / "adapter_model.safetensors")), adapter(full))

    pertp = tmp_path / "pertp"  # each rank one sign of both queries, batched into one forward
    proc = torchrun(2, flags + ["--pert", "2", "--batch-queries", "--output-dir", str(pertp)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert grads(pertp) == pytest.approx(grads(full), rel=1e-9)
    assert_same(adapter(pertp), adapter(full), rel=1e-9)


def test_layouts_follow_the_single_process(tmp_path):
    # fp64: the DDP split of the batch reassociates the loss sums (see test_dist_launch)
    flags = COMMON + ["--peft", "lora", "--dtype", "fp64", "--max-steps", "5", "--num-queries", "2"]
    single = tmp_path / "single"
    assert python_train(flags + ["--output-dir", str(single)]).returncode == 0
    # 2D: each rank runs one sign of both queries, batched into one forward (--dual-forward has
    # nothing to pair there; the engine tests hold it equal to the sequential passes)
    runs = {
        "pertp": (2, ["--pert", "2"]),
        "2d-sliced": (
            4,
            [
                "--dp",
                "2",
                "--pert",
                "2",
                "--transfer",
                "sliced",
                "--dual-forward",
                "--batch-queries",
            ],
        ),
    }
    for name, (nproc, extra) in runs.items():
        proc = torchrun(nproc, flags + extra + ["--output-dir", str(tmp_path / name)])
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert grads(tmp_path / "pertp") == grads(single)  # PertP runs the same passes: bit for bit
    assert_same(adapter(tmp_path / "pertp"), adapter(single))
    sliced = tmp_path / "2d-sliced"
    assert grads(sliced) == pytest.approx(grads(single), rel=1e-9)
    assert_same(adapter(sliced), adapter(single), rel=1e-9)


def test_merge_adapter_exports_a_plain_model(tmp_path):
    proc = python_train(
        COMMON
        + ["--peft", "lora", "--merge-adapter", "--max-steps", "3", "--output-dir", str(tmp_path)]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    names = {n for n, _ in merged.named_parameters()}
    assert names == {n for n, _ in base.named_parameters()}
    moved = [n for n, p in merged.named_parameters() if not torch.equal(p, base.get_parameter(n))]
    assert moved and all(n.endswith(("q_proj.weight", "v_proj.weight")) for n in moved)


def test_a_merged_model_run_keeps_its_generation_config_tokenizer_and_replays_merged(tmp_path):
    """The export (and a replay of the log) carries the source's generation config (an
    end-of-sequence list, sampling) and its tokenizer; a sharded export's index counts what
    it holds; a replay of a --merge-adapter run writes the merged model, as the run did."""
    source = tmp_path / "model"
    config = LlamaConfig(**{**LLAMA, "num_hidden_layers": 2})
    LlamaForCausalLM(config).save_pretrained(source)
    GenerationConfig(eos_token_id=[1, 5], do_sample=True, temperature=0.6).save_pretrained(source)
    byte_tokenizer().save_pretrained(source)
    run = tmp_path / "run"
    flags = ["--model", str(source), "--peft", "lora", "--merge-adapter"]
    flags += ["--export-shard-size", "20KB", "--max-steps", "2", "--output-dir", str(run)]
    proc = python_train(flags)
    assert proc.returncode == 0, proc.stderr[-2000:]
    replayed = tmp_path / "replayed"
    proc = python_replay(["--log", str(run / "seedlog.jsonl"), "--out", str(replayed)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    for out in (run / "export", replayed):
        generation = GenerationConfig.from_pretrained(out)
        assert generation.eos_token_id == [1, 5] and generation.temperature == 0.6
        assert (out / "tokenizer_config.json").is_file()
        tensors = {}
        for name in out.glob("model*.safetensors"):
            tensors.update(load_file(str(name)))
        assert tensors and not any("lora" in n for n in tensors)
    index = json.loads((run / "export" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_parameters"] == sum(t.numel() for t in tensors.values())
    assert_same(
        AutoModelForCausalLM.from_pretrained(replayed).state_dict(),
        AutoModelForCausalLM.from_pretrained(run / "export").state_dict(),
    )
    # distzo.train's --no-merge-adapter: the adapter alone, which the run never wrote
    from tests.helpers.launch import main_in_process

    adapter = tmp_path / "adapter"
    flags = ["--log", str(run / "seedlog.jsonl"), "--out", str(adapter), "--no-merge-adapter"]
    proc = main_in_process("distzo.replay", [*flags, "--export-shard-size", "20KB"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ignored: --export-shard-size (it applies only with " in proc.stderr  # as train's
    assert not list(adapter.glob("model*.safetensors"))
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    assert lora and all("lora_" in name for name in lora)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--peft", "lora", "--lora-dropout", "0.1"], "drop --lora-dropout"),
        (["--merge-adapter"], "--merge-adapter needs a LoRA adapter"),
        (["--peft", "prefix", "--merge-adapter"], "--merge-adapter needs a LoRA adapter"),
        (["--peft", "prefix", "--prefix-length", "0"], "--prefix-length must be >= 1"),
        (["--dual-forward"], "--dual-forward and --batch-queries need an adapter"),
        (["--peft", "lora", "--lora-targets", "nothing_here"], "--lora-targets"),
    ],
)
def test_bad_adapter_flags_are_one_line(tmp_path, capsys, flags, message):
    # in process: the entry point's own error path, no interpreter start-up
    from distzo.train import main

    assert main(COMMON + flags + ["--output-dir", str(tmp_path)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0]


def test_an_adapter_run_over_a_low_bit_base_replays_exactly(tmp_path):
    """Only the frozen base rests low-bit (rounded once, to nearest); the adapter never
    rounds, so the log replays, and the merged export is the run's: the adapter merged into
    the base as the run held it, which the replay rounds as the run did."""
    run, replayed = tmp_path / "run", tmp_path / "replayed"
    flags = COMMON + ["--max-steps", "3", "--peft", "lora", "--merge-adapter"]
    proc = python_train(flags + ["--transfer-dtype", "fp8", "--output-dir", str(run)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = python_replay(["--log", str(run / "seedlog.jsonl"), "--out", str(replayed)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    exported = load_file(str(run / "export" / "model.safetensors"))
    assert_same(load_file(str(replayed / "model.safetensors")), exported)


def test_a_prefix_initialised_in_bf16_compute_replays_exactly(tmp_path):
    """A prefix's init by real activations runs in the compute dtype, which the replay takes
    from the log's header (in fp32 its prefix would start elsewhere)."""
    run, replayed = tmp_path / "run", tmp_path / "replayed"
    flags = COMMON + ["--max-steps", "2", "--peft", "prefix", "--compute-dtype", "bf16"]
    proc = python_train(flags + ["--output-dir", str(run)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = python_replay(["--log", str(run / "seedlog.jsonl"), "--out", str(replayed)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert_same(load_file(str(replayed / "adapter_model.safetensors")), adapter(run))


@pytest.mark.parametrize(
    "tuning, refusal",
    [
        (
            ["--peft", "prefix", "--prefix-length", "2"],
            "the run trained a prefix, which cannot be merged into the weights; replay without "
            "--merge-adapter (the peft adapter)",
        ),
        ([], "the run tuned the full model, with no adapter to merge; drop --merge-adapter"),
    ],
    ids=["prefix", "full"],
)
def test_replay_refuses_a_merge_it_cannot_do_before_replaying_a_step(
    tmp_path, monkeypatch, tuning, refusal
):
    """The export refused a prefix's merge only once every logged step had been replayed, and
    a full run's --merge-adapter was silently ignored (training refuses it)."""
    from distzo.engine import ZOEngine
    from tests.helpers.launch import main_in_process

    run = tmp_path / "run"
    flags = ["--max-steps", "1", "--batch-size", "4", *tuning]
    proc = python_train(flags + ["--log-every", "0", "--output-dir", str(run)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    replayed = []
    monkeypatch.setattr(ZOEngine, "catch_up", lambda engine, steps: replayed.append(steps))
    out = tmp_path / "out"
    proc = main_in_process(
        "distzo.replay", ["--log", str(run / "seedlog.jsonl"), "--out", str(out), "--merge-adapter"]
    )
    assert proc.returncode == 2 and not replayed and not out.exists()
    assert proc.stderr.strip().splitlines()[-1] == f"error: --merge-adapter: {refusal}"


def test_an_exported_adapter_names_its_base_so_that_it_loads_anywhere(tmp_path, monkeypatch):
    """``AutoPeftModelForCausalLM`` loads the base its adapter names: a relative --model was
    named as given (no base from another directory), a hub model by its cache folder (no
    base on another machine); a replay names the run's base too."""
    source = tmp_path / "models" / "llama"
    LlamaForCausalLM(LlamaConfig(**{**LLAMA, "num_hidden_layers": 2})).save_pretrained(source)
    revision = "0" * 40
    repo = tmp_path / "hub" / "models--tiny--llama"
    shutil.copytree(source, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    env = child_env({"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"})
    monkeypatch.chdir(tmp_path)
    flags = ["--peft", "lora", "--max-steps", "1", "--batch-size", "2", "--eval-batch-size", "2"]
    for model, base in (("models/llama", source.resolve()), ("tiny/llama", Path("tiny/llama"))):
        run = tmp_path / model.replace("/", "-")
        command = [sys.executable, "-m", "distzo.train", "--model", model, "--output-dir", str(run)]
        proc = run_python(command + flags, env, 120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        config = json.loads((run / "export" / "adapter_config.json").read_text())
        assert Path(config["base_model_name_or_path"]) == base
    replay = [sys.executable, "-m", "distzo.replay", "--log", str(run / "seedlog.jsonl")]
    proc = run_python(replay + ["--out", str(tmp_path / "replayed")], env, 120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = json.loads((tmp_path / "replayed" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny/llama"
