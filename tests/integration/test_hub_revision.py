"""A hub base is pinned to the commit the run read: a cluster's shared cache whose ``main``
moved on (``hf download`` of an update) must not give a resumed or replayed run, nor the
exported adapter, other weights than the run trained on."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from tests.helpers.launch import child_env, run_python
from tests.helpers.models import LLAMA

OLD, NEW = "a" * 40, "b" * 40


def add_commit(cache: Path, commit: str, seed: int) -> None:
    """``tiny/llama`` at ``commit`` (weights drawn from ``seed``) as the cache's ``main``."""
    torch.manual_seed(seed)
    repo = cache / "models--tiny--llama"
    model = LlamaForCausalLM(LlamaConfig(**{**LLAMA, "num_hidden_layers": 2}))
    model.save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)


def test_a_resume_and_a_replay_read_the_commit_the_run_trained_on(tmp_path):
    cache = tmp_path / "hub"
    add_commit(cache, OLD, seed=0)
    env = child_env({"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    run = tmp_path / "run"
    flags = ["--model", "tiny/llama", "--peft", "lora", "--lr", "1e-2", "--lr-schedule"]
    flags += ["constant", "--batch-size", "2", "--eval-batch-size", "2", "--output-dir", str(run)]
    train = [sys.executable, "-m", "distzo.train", *flags]
    proc = run_python(train + ["--max-steps", "2"], env, 120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    header = json.loads((run / "seedlog.jsonl").read_text().splitlines()[0])
    assert (header["base"], header["base_revision"]) == ("tiny/llama", OLD)
    add_commit(cache, NEW, seed=1)  # same shapes, other weights: nothing else tells them apart
    proc = run_python(train + ["--max-steps", "4", "--resume", "auto"], env, 120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    adapter = json.loads((run / "export" / "adapter_config.json").read_text())
    assert (adapter["base_model_name_or_path"], adapter["revision"]) == ("tiny/llama", OLD)
    replay = [sys.executable, "-m", "distzo.replay", "--log", str(run / "seedlog.jsonl")]
    proc = run_python(replay + ["--out", str(tmp_path / "replayed")], env, 120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the resumed run trained on OLD (as the replay reads it): the same adapter, bit for bit
    exported, replayed = (
        load_file(d / "adapter_model.safetensors") for d in (run / "export", tmp_path / "replayed")
    )
    assert all(torch.equal(exported[k], replayed[k]) for k in exported)
    adapter = json.loads((tmp_path / "replayed" / "adapter_config.json").read_text())
    assert adapter["revision"] == OLD  # the replayed adapter loads the same base too
    shutil.rmtree(cache / "models--tiny--llama" / "snapshots" / OLD)  # the old commit gone
    proc = run_python(replay + ["--out", str(tmp_path / "again")], env, 120)
    assert proc.returncode == 2 and not (tmp_path / "again").exists()
    assert f"at commit {OLD}, the one the run trained on" in proc.stderr
    assert f"hf download tiny/llama --revision {OLD}" in proc.stderr.strip().splitlines()[-1]


def test_a_replay_pins_the_logged_commit_only_for_the_logged_base():
    """``--base`` naming the log's own base keeps its commit; another base is read at its
    own ``main`` (the log's commit is no commit of that repository); a damaged header's
    revision is one line naming where it came from; a resume (no base of its own) reads
    its log's commit, and none without a log."""
    from distzo.job.seed_log import logged_revision

    header = {"base": "tiny/llama", "base_revision": OLD}
    assert logged_revision(header, "log") == logged_revision(header, "log", "tiny/llama") == OLD
    assert logged_revision(header, "log", "other/llama") is None
    assert logged_revision({"base": "tiny/llama"}, "log") is None
    assert logged_revision(None, "log") is None
    with pytest.raises(ValueError, match="^the log's header: base_revision 'main' is not a"):
        logged_revision({**header, "base_revision": "main"}, "the log's header")


def test_only_a_hub_name_records_its_snapshots_commit(tmp_path):
    """A folder given by its path is named by that path, even one inside the cache."""
    from distzo.job.run_model import hub_commit

    snapshot = tmp_path / "models--tiny--llama" / "snapshots" / OLD
    snapshot.mkdir(parents=True)
    assert hub_commit("tiny/llama", snapshot) == OLD
    assert hub_commit(str(snapshot), snapshot) is None
    assert hub_commit(None, None) is None


def test_a_resume_checks_the_config_of_the_commit_it_reads_not_mains(tmp_path):
    """The checks before the build read ``main``'s config.json: a resume whose cache's
    ``main`` moved to a checkpoint the checks refuse (here a quantized one) was refused,
    though it reads, and trains on, the commit its log records."""
    cache = tmp_path / "hub"
    add_commit(cache, OLD, seed=0)
    env = child_env({"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    run = tmp_path / "run"
    flags = ["--model", "tiny/llama", "--batch-size", "2", "--eval-batch-size", "2"]
    train = [sys.executable, "-m", "distzo.train", *flags, "--output-dir", str(run)]
    proc = run_python(train + ["--max-steps", "1"], env, 120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    add_commit(cache, NEW, seed=1)
    config = cache / "models--tiny--llama" / "snapshots" / NEW / "config.json"
    quantized = {**json.loads(config.read_text()), "quantization_config": {"quant_method": "gptq"}}
    config.write_text(json.dumps(quantized))
    proc = run_python(train + ["--max-steps", "2", "--resume", "yes"], env, 120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    fresh = run_python(train[:-1] + [str(tmp_path / "fresh"), "--max-steps", "1"], env, 120)
    assert fresh.returncode == 2 and "quantized" in fresh.stderr, fresh.stderr[-2000:]
