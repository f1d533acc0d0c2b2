"""Bad input and failed writes through the entry points: one line on stderr, exit code 2 for
bad input (1 for a failure), and no run directory or ``*.tmp`` left where none should be."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.helpers.launch import main_in_process, python_train, train_in_process
from tests.helpers.models import tiny_opt

ROWS = [{"sentence": "good movie", "label": 1}, {"sentence": "bad", "label": 0}] * 4


def one_line(proc, code: int = 2) -> str:
    """The one error line of a failed launch (its logging before it aside)."""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == code and len(errors) == 1, proc.stderr[-2000:]
    assert proc.stderr.rstrip().endswith(errors[0]), proc.stderr[-2000:]
    return errors[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A short run with a checkpoint per step: a base, a seed log, checkpoints."""
    out = tmp_path_factory.mktemp("run") / "run"
    proc = python_train(["--max-steps", "3", "--save-steps", "1", "--output-dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def llama_dir(path: Path) -> Path:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


# -- distzo.replay


def test_replay_takes_distzo_trains_export_shard_size_its_check_and_its_shards(run, tmp_path):
    """A replay exporting a large run wrote 5GB shards, with no way to choose: it takes
    distzo.train's --export-shard-size, refused in train's one line before any step."""
    from safetensors.torch import load_file

    log, out = str(run / "seedlog.jsonl"), tmp_path / "out"
    proc = main_in_process(
        "distzo.replay", ["--log", log, "--out", str(out), "--export-shard-size", "0GB"]
    )
    assert (
        one_line(proc) == "error: --export-shard-size '0GB' is not a size; write e.g. 5GB or 500MB"
    )
    assert not out.exists()
    proc = main_in_process(
        "distzo.replay", ["--log", log, "--out", str(out), "--export-shard-size", "60KB"]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()
    assert all(shard.stat().st_size <= 60_000 + 10_000 for shard in shards)  # a header's worth
    replayed = {k: v for shard in shards for k, v in load_file(str(shard)).items()}
    exported = load_file(str(run / "export" / "model.safetensors"))
    assert replayed.keys() == exported.keys()
    assert all(torch.equal(replayed[k], exported[k]) for k in exported)


def test_replay_refuses_a_base_of_another_model(run, tmp_path):
    out = tmp_path / "out"
    proc = main_in_process(
        "distzo.replay",
        ["--base", str(llama_dir(tmp_path / "llama")), "--log", str(run / "seedlog.jsonl")]
        + ["--out", str(out)],
    )
    assert "model type llama" in one_line(proc) and "opt" in proc.stderr
    assert not out.exists() and not list(tmp_path.glob("*.tmp"))


def test_replay_refuses_a_base_of_other_sizes_and_checks_old_logs(run, tmp_path):
    other = tmp_path / "opt"
    tiny_opt(ffn_dim=48).save_pretrained(other)  # an OPT, of other sizes than the run's
    log = tmp_path / "seedlog.jsonl"
    header, *steps = (run / "seedlog.jsonl").read_text().splitlines()
    old = json.loads(header)
    del old["model"]  # a log from before the record: its base folder's config decides
    log.write_text("\n".join([json.dumps(old), *steps]) + "\n")
    for seed_log in (run / "seedlog.jsonl", log):
        proc = main_in_process(
            "distzo.replay",
            ["--base", str(other), "--log", str(seed_log), "--out", str(tmp_path / "out")],
        )
        assert "the log's run trained" in one_line(proc) and "model type" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_replay_refuses_an_existing_out_without_overwrite(run, tmp_path):
    log = str(run / "seedlog.jsonl")
    for existing in (tmp_path / "dir", tmp_path / "file"):
        if existing.name == "dir":
            existing.mkdir()
        else:
            existing.write_text("x")
        proc = main_in_process("distzo.replay", ["--log", log, "--out", str(existing)])
        assert "--overwrite" in one_line(proc) and str(existing) in proc.stderr
        assert not list(tmp_path.glob("*.tmp"))
    proc = main_in_process(
        "distzo.replay", ["--log", log, "--out", str(tmp_path / "dir"), "--overwrite"]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "dir" / "model.safetensors").is_file()


def test_replay_leaves_a_users_folder_named_like_its_staging_folder(run, tmp_path):
    out = tmp_path / "mine"
    (tmp_path / "mine.tmp").mkdir()
    (tmp_path / "mine.tmp" / "notes.txt").write_text("mine")
    for extra in ([], ["--overwrite"]):
        proc = main_in_process(
            "distzo.replay", ["--log", str(run / "seedlog.jsonl"), "--out", str(out), *extra]
        )
        assert one_line(proc) == (
            f"error: --out {out}: {out}.tmp exists (the output is written there first, then "
            "renamed); move it aside or give another --out"
        )
    assert (tmp_path / "mine.tmp" / "notes.txt").read_text() == "mine" and not out.exists()


def test_replay_refuses_an_out_holding_the_working_directory(run, tmp_path, monkeypatch):
    """``--out .. --overwrite`` deleted the working directory's parent, then staged into
    ``...tmp`` inside it and failed: the user's files gone, no model written."""
    here = tmp_path / "a" / "b"
    here.mkdir(parents=True)
    (tmp_path / "a" / "keep.txt").write_text("mine")
    monkeypatch.chdir(here)
    log = str(run / "seedlog.jsonl")
    for out, full, verb, example in (
        ("..", tmp_path / "a", "holds", "../model"),
        (".", here, "is", "model"),
    ):
        proc = main_in_process("distzo.replay", ["--log", log, "--out", out, "--overwrite"])
        assert one_line(proc) == (
            f"error: --out {out}: {full} {verb} the working directory, which replacing it would "
            f"delete; give a folder of its own, such as --out {example}"
        )
    assert (tmp_path / "a" / "keep.txt").read_text() == "mine" and here.is_dir()
    proc = main_in_process("distzo.replay", ["--log", log, "--out", "x/..", "--overwrite"])
    assert "x/..: " in one_line(proc) and not list(tmp_path.rglob("*.tmp"))


def test_replay_names_its_device_flag(run, tmp_path):
    """The engine's check named the field ``device`` where the user typed --device."""
    log = str(run / "seedlog.jsonl")
    proc = main_in_process(
        "distzo.replay", ["--log", log, "--out", str(tmp_path / "o"), "--device", "tpu"]
    )
    assert one_line(proc) == (
        "error: --device 'tpu' is not a torch device; use auto, cpu, cuda or cuda:N"
    )


def test_replay_refuses_an_empty_base(run, tmp_path):
    """``--base ""`` replayed onto the log's own base, as if it were not given."""
    args = ["--log", str(run / "seedlog.jsonl"), "--out", str(tmp_path / "o"), "--base", ""]
    proc = main_in_process("distzo.replay", args)
    assert one_line(proc) == (
        "error: --base is empty; give the base's hub name or folder, or leave it out"
    )
    assert not (tmp_path / "o").exists()


def test_replay_over_a_file_with_overwrite_leaves_no_tmp(run, tmp_path):
    out = tmp_path / "model"
    out.write_text("x")
    proc = main_in_process(
        "distzo.replay", ["--log", str(run / "seedlog.jsonl"), "--out", str(out), "--overwrite"]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "model.safetensors").is_file() and not list(tmp_path.glob("*.tmp"))


def test_replay_onto_a_missing_local_base_says_no_such_directory(run, tmp_path):
    proc = main_in_process(
        "distzo.replay",
        ["--base", "./nope", "--log", str(run / "seedlog.jsonl"), "--out", str(tmp_path / "o")],
    )
    assert "no such directory" in one_line(proc) and "Repo id" not in proc.stderr


def test_replay_writes_the_files_of_the_runs_export(run, tmp_path):
    """The default run's base folder holds no tokenizer; transformers would build OPT's
    with an empty vocabulary from its config, which the replay then wrote beside the
    weights."""
    out = tmp_path / "out"
    proc = main_in_process(
        "distzo.replay", ["--log", str(run / "seedlog.jsonl"), "--out", str(out)]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = [sorted(p.name for p in folder.iterdir()) for folder in (out, run / "export")]
    assert names[0] == names[1]


def test_a_text_task_on_a_model_folder_without_a_tokenizer_names_the_missing_files(tmp_path):
    model = tmp_path / "opt"
    tiny_opt().save_pretrained(model)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    proc = train_in_process(
        ["--model", str(model), "--task", "sst2", "--train-file", str(data), "--eval-file"]
        + [str(data), "--output-dir", str(tmp_path / "run")]
    )
    line = one_line(proc)
    assert line.startswith(f"error: --model {model}: no tokenizer to read the task's text")
    assert "holds no tokenizer files" in line


def damaged_log(run: Path, tmp_path: Path, header=None, record=None) -> Path:
    """The run's seed log with its header, or its first step's record, replaced."""
    first, *steps = (run / "seedlog.jsonl").read_text().splitlines()
    lines = [header if header is not None else first, record if record is not None else steps[0]]
    log = tmp_path / "seedlog.jsonl"
    log.write_text("\n".join([*lines, *steps[1:]]) + "\n")
    return log


@pytest.mark.parametrize(
    "record",
    [
        "[0]",
        '{"step": 0, "projected_grads": [NaN], "lr": 0.01}',
        '{"step": 0, "projected_grads": [1.0], "lr": null}',
        '{"step": 0, "projected_grads": [], "lr": 0.01}',
        '{"step": 0, "projected_grads": "1.0", "lr": 0.01}',
        # each finite, their product not: the replay wrote non-finite weights with exit 0
        '{"step": 0, "projected_grads": [1e308], "lr": 1e308}',
    ],
)
def test_replay_names_a_damaged_step_record(run, tmp_path, record):
    """A run never logs a step whose g is not finite: such a record would replay into NaN
    weights without a word; the others were tracebacks."""
    log = damaged_log(run, tmp_path, record=record)
    proc = main_in_process("distzo.replay", ["--log", str(log), "--out", str(tmp_path / "o")])
    assert one_line(proc) == f"error: --log {log}, line 2: expected the record of step 0"
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("field", ["run_seed", "weight_decay", "dtype"])
def test_replay_names_what_a_damaged_header_lacks(run, tmp_path, field):
    header = json.loads((run / "seedlog.jsonl").read_text().splitlines()[0])
    del header[field]
    log = damaged_log(run, tmp_path, header=json.dumps(header))
    proc = main_in_process("distzo.replay", ["--log", str(log), "--out", str(tmp_path / "o")])
    assert one_line(proc).startswith(f"error: --log {log}: its header has no {field} ")


def test_replay_names_a_log_that_is_not_a_header_or_not_text(run, tmp_path):
    log = damaged_log(run, tmp_path, header="[1, 2]")
    proc = main_in_process("distzo.replay", ["--log", str(log), "--out", str(tmp_path / "o")])
    assert "the first line must be the run's header" in one_line(proc)
    log.write_bytes(b"\x80\x81\n")
    proc = main_in_process("distzo.replay", ["--log", str(log), "--out", str(tmp_path / "o")])
    assert one_line(proc) == f"error: --log {log}: not text (byte 0 is not UTF-8)"


def test_replay_names_where_a_missing_base_came_from(run, tmp_path):
    """A base the user did not pass was called --model; a hub name that could not be
    fetched was 'cannot write OUT' (an OSError from transformers taken for a failed write)."""
    log = tmp_path / "seedlog.jsonl"
    moved = (run / "seedlog.jsonl").read_text().replace(str(run / "base"), str(tmp_path / "gone"))
    log.write_text(moved)
    out = str(tmp_path / "o")
    proc = main_in_process("distzo.replay", ["--log", str(log), "--out", out])
    assert one_line(proc) == (
        f"error: the log's base {tmp_path / 'gone'}: no such directory (a local model is a "
        "Hugging Face folder); pass --base"
    )
    proc = main_in_process(
        "distzo.replay",
        ["--base", "org/none", "--log", str(run / "seedlog.jsonl"), "--out", out],
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert one_line(proc).startswith("error: cannot download --base 'org/none': ")


def test_replay_on_a_full_disk_says_so_and_leaves_no_tmp(run, tmp_path, monkeypatch):
    import distzo.export.hf_model as hf_model

    def full(tensors, filename, metadata=None):
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(hf_model, "save_file", full)
    out = tmp_path / "out"
    proc = main_in_process(
        "distzo.replay", ["--log", str(run / "seedlog.jsonl"), "--out", str(out)]
    )
    line = one_line(proc, code=1)
    assert "no space left on device" in line and str(out) in line
    assert not out.exists() and not list(tmp_path.glob("*.tmp"))


def test_the_seed_log_names_the_base_by_an_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the command's working directory (the fork server's child's)
    proc = python_train(["--max-steps", "1", "--output-dir", "rel"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    header = json.loads((tmp_path / "rel" / "seedlog.jsonl").read_text().splitlines()[0])
    assert Path(header["base"]).is_absolute() and Path(header["base"]).is_dir()
    assert header["model"]["model_type"] == "opt"


# -- the model


@pytest.mark.parametrize("name", ["/nope/model", "./nope", "../nope/model"])
def test_a_missing_local_model_says_no_such_directory(name):
    line = one_line(train_in_process(["--model", name]))
    assert "no such directory" in line and "Repo id" not in line


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_damaged_safetensors_file_is_named(tmp_path, damage):
    model = tmp_path / "model"
    tiny_opt().save_pretrained(model)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"garbage" * 10 if damage == "garbage" else data[: len(data) // 2])
    out = tmp_path / "out"
    line = one_line(train_in_process(["--model", str(model), "--output-dir", str(out)]))
    assert str(weights) in line and "safetensors" in line
    assert not out.exists()


@pytest.mark.parametrize("kind", ["model.safetensors", "pytorch_model.bin"])
def test_a_weights_file_this_user_may_not_read_is_named(tmp_path, monkeypatch, kind):
    """A model a colleague saved, its weights private to them (safetensors writes its files
    so): safetensors called the file missing, in a traceback, and torch a damaged one."""
    model = tmp_path / "model"
    original = tiny_opt()
    original.save_pretrained(model)
    weights = model / kind
    if kind == "pytorch_model.bin":
        (model / "model.safetensors").unlink()
        torch.save(original.state_dict(), weights)
    weights.chmod(0)  # unreadable to this user, unless it is root, which reads any file:
    # for root, os.access answers as it does a user without root's override
    access = os.access
    monkeypatch.setattr(
        os, "access", lambda path, mode: access(path, mode) and Path(path) != weights
    )
    out = tmp_path / "out"
    line = one_line(train_in_process(["--model", str(model), "--output-dir", str(out)]))
    assert line == (
        f"error: {weights}: no permission to read it; its owner can share it (chmod a+r), "
        "or copy the model to a folder you may read"
    )
    assert not out.exists()


@pytest.mark.parametrize("program", ["distzo.train", "distzo.replay"])
def test_a_model_folder_this_user_may_not_read_is_named(run, tmp_path, monkeypatch, program):
    """A colleague's model folder, private to them: each file in it failed on its own, a
    training in a traceback (``exists()`` of a shard index), a replay's --base as a
    failed write ("cannot write .../config.json")."""
    model = tmp_path / "model"
    tiny_opt().save_pretrained(model)
    model.chmod(0)  # closed to this user, unless it is root, which enters any folder:
    # for root, os.access answers as it does a user without root's override
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: access(path, mode) and path != model)
    out, option = tmp_path / "out", "--model" if program == "distzo.train" else "--base"
    args = [option, str(model)]
    if program == "distzo.train":
        args += ["--max-steps", "1", "--output-dir", str(out)]
    else:
        args += ["--log", str(run / "seedlog.jsonl"), "--out", str(out)]
    try:
        line = one_line(main_in_process(program, args))
    finally:
        model.chmod(0o755)
    assert line == (
        f"error: {option} {model}: no permission to read this folder; its owner can share it "
        "(chmod -R a+rX), or copy the model to a folder you may read"
    )
    assert not out.exists()


class _Opens:
    """Pickled as a call to ``open(path, "w")``: what unpickling a .bin would run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


@pytest.mark.parametrize("damage", ["garbage", "truncated", "corrupt", "code"])
def test_a_damaged_torch_bin_file_is_named_and_never_unpickled(tmp_path, damage):
    model = tmp_path / "model"
    original = tiny_opt()
    original.save_pretrained(model)
    (model / "model.safetensors").unlink()  # .bin weights only, as older repositories hold
    weights, ran = model / "pytorch_model.bin", tmp_path / "unpickled"
    torch.save(original.state_dict(), weights)
    data = weights.read_bytes()
    if damage == "code":
        torch.save({**original.state_dict(), "evil": _Opens(ran)}, weights)
    else:
        middle = data[:2000] + bytes(len(data) - 4000) + data[-2000:]  # a zip, records zeroed
        damaged = {"garbage": b"garbage" * 10, "truncated": data[: len(data) // 2]}
        weights.write_bytes(damaged.get(damage, middle))
    out = tmp_path / "out"
    line = one_line(train_in_process(["--model", str(model), "--output-dir", str(out)]))
    assert line.startswith(f"error: {weights}: not a readable PyTorch weights file (")
    assert line.endswith("); download or export it again")
    # the global pickle names: io.open on Python 3.11, _io.open from 3.12 (open.__module__)
    opens = f"pickles code, {open.__module__}.{open.__qualname__},"
    assert (opens in line) == (damage == "code")
    assert not out.exists() and not ran.exists()


# -- checkpoints


def test_a_checkpoint_without_metadata_offers_the_previous_one(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "checkpoints" / "step-3" / ".metadata").unlink()
    line = one_line(train_in_process(["--output-dir", str(copy), "--resume"]))
    assert ".metadata" in line and "step-3" in line and "step-2" in line


def test_a_truncated_distcp_file_is_named(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    shard = next((copy / "checkpoints" / "step-3").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    line = one_line(train_in_process(["--output-dir", str(copy), "--resume"]))
    assert shard.name in line and "step-2" in line


# -- writing


def test_an_output_dir_under_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    line = one_line(train_in_process(["--output-dir", str(tmp_path / "file" / "run")]))
    assert "--output-dir" in line and "not a directory" in line


@pytest.mark.parametrize("mount", ["writable", "read-only"])
def test_an_unwritable_output_dir_is_refused(tmp_path, monkeypatch, mount):
    """Why it is not writable: a folder's permissions, which its owner can change, or a
    read-only mount (a shared project folder), which no permission opens."""
    # a stand-in for a read-only folder: the tests may run as root, which os.access never denies
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    if mount == "read-only":  # statvfs's answer on a read-only bind mount
        statvfs = os.statvfs
        monkeypatch.setattr(
            os,
            "statvfs",
            lambda path: SimpleNamespace(f_flag=statvfs(path).f_flag | os.ST_RDONLY),
        )
    out = tmp_path / "run"
    line = one_line(train_in_process(["--output-dir", str(out)]))
    why = "a read-only file system" if mount == "read-only" else "permission denied"
    assert line == (
        f"error: --output-dir {out}: {tmp_path} is not writable ({why}); give another --output-dir"
    )
    assert not out.exists()


@pytest.mark.parametrize("program", ["distzo.replay", "distzo.export.training_step"])
def test_an_out_in_a_folder_this_user_may_not_write_is_refused_first(
    run, tmp_path, monkeypatch, program
):
    """A replay found out after its last step (hours of a large model's) that its --out
    could not be written, and the exported step after building its model."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o555)  # unwritable to this user, unless it is root, which writes
    # anywhere: for root, os.access answers as it does a user without root's override
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: access(path, mode) and path != shared)
    out = shared / "out"
    args = ["--out", str(out)]
    if program == "distzo.replay":
        args += ["--log", str(run / "seedlog.jsonl")]
    proc = main_in_process(program, args)
    line = one_line(proc)
    assert line == (
        f"error: --out {out}: {shared} is not writable (permission denied); give another --out"
    )
    assert "replayed" not in proc.stderr and "ZO engine" not in proc.stderr  # no work done
    assert not out.exists() and not (shared / "out.tmp").exists()


def full_disk(*args, **kwargs):
    """What safetensors raises on a full disk (a ``SafetensorError``, no ``OSError``: seen
    on a full tmpfs)."""
    from safetensors import SafetensorError

    raise SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28)"
    )


def test_a_full_disk_says_so_and_where(tmp_path, monkeypatch):
    import distzo.export.hf_model as hf_model

    monkeypatch.setattr(hf_model, "save_file", full_disk)
    out = tmp_path / "out"
    line = one_line(train_in_process(["--max-steps", "1", "--output-dir", str(out)]), code=1)
    assert "no space left on device" in line and str(out / "export.tmp") in line
    assert not (out / "export.tmp").exists()


def test_a_full_disk_writing_the_initial_weights_says_so_and_leaves_nothing(tmp_path, monkeypatch):
    import transformers.modeling_utils

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk)
    out = tmp_path / "out"
    line = one_line(train_in_process(["--max-steps", "1", "--output-dir", str(out)]), code=1)
    assert line.startswith(f"error: no space left on device writing {out / 'base'}"), line
    assert not out.exists()  # the directory the run made goes too


def test_a_full_disk_during_a_checkpoint_save_leaves_no_tmp(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import filesystem

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(filesystem, "_write_item", full)
    out = tmp_path / "out"
    proc = train_in_process(["--max-steps", "2", "--save-steps", "1", "--output-dir", str(out)])
    line = one_line(proc, code=1)
    assert "no space left on device" in line and str(out / "checkpoints" / "step-1") in line
    assert not list((out / "checkpoints").glob("*.tmp"))


def test_a_full_log_dir_names_its_file_not_the_run_directory(tmp_path, monkeypatch):
    # A write to an open file names no file: the line named the run directory, whose disk
    # was not the full one.
    import distzo.job.run_logs as run_logs

    def full_metrics(path, mode="r"):  # the kernel's full disk
        return open("/dev/full" if path.name == "metrics.jsonl" else path, mode)

    monkeypatch.setattr(run_logs, "open", full_metrics, raising=False)
    logs = tmp_path / "logs"
    proc = train_in_process(
        ["--max-steps", "2", "--output-dir", str(tmp_path / "out"), "--log-dir", str(logs)]
    )
    assert one_line(proc, code=1) == (
        f"error: no space left on device writing {logs / 'metrics.jsonl'}; free space there "
        "or use another directory"
    )


class _FullAfter:
    """An open log on a disk that fills after its first ``records`` writes."""

    def __init__(self, file, records: int) -> None:
        self.file, self.left = file, records

    def write(self, text: str) -> int:
        self.left -= 1
        if self.left < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.file.write(text)

    def __getattr__(self, name: str):
        return getattr(self.file, name)


def test_a_full_log_dir_still_completes_the_checkpoint_being_written(tmp_path, monkeypatch):
    # The step-2 checkpoint (another disk) is in flight when metrics.jsonl's disk fills at
    # step 2: it was left as step-2.tmp, while any other failure completes it.
    import time

    import distzo.job.checkpoint as checkpoint
    import distzo.job.run_logs as run_logs

    def two_records(path, mode="r"):
        file = open(path, mode)
        return _FullAfter(file, 2) if path.name == "metrics.jsonl" else file

    write_data = checkpoint.HostStateWriter.write_data

    def slow(self, plan, planner):  # a large model, or a network disk
        time.sleep(1)
        return write_data(self, plan, planner)

    monkeypatch.setattr(run_logs, "open", two_records, raising=False)
    monkeypatch.setattr(checkpoint.HostStateWriter, "write_data", slow)
    out, logs = tmp_path / "out", tmp_path / "logs"
    args = ["--max-steps", "4", "--save-steps", "2", "--output-dir", str(out)]
    line = one_line(train_in_process([*args, "--log-dir", str(logs)]), code=1)
    assert line.startswith(f"error: no space left on device writing {logs / 'metrics.jsonl'}")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]


class _FillingDisk(io.RawIOBase):
    """A file on a disk that fills after its first bytes."""

    def __init__(self) -> None:
        self.written = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.written += len(data)
        if self.written > 600:
            raise OSError(errno.ENOSPC, "No space left on device")
        return len(data)


def test_a_disk_filling_inside_torch_save_says_so_in_one_line(tmp_path, monkeypatch):
    # A real full disk: torch.save's zip writer reports the failed write as a RuntimeError
    # ("unexpected pos"), the OSError only its context; it was a traceback.
    from torch.distributed.checkpoint import filesystem

    def filling(*args, **kwargs):
        disk = io.BufferedWriter(_FillingDisk())
        try:
            torch.save(torch.zeros(10_000), disk)
        finally:  # closed here: on Python 3.13 the garbage collector's close flushed the
            with contextlib.suppress(OSError):  # unwritten bytes into the full disk again
                disk.close()

    monkeypatch.setattr(filesystem, "_write_item", filling)
    out = tmp_path / "out"
    proc = train_in_process(["--max-steps", "2", "--save-steps", "1", "--output-dir", str(out)])
    line = one_line(proc, code=1)
    assert "no space left on device" in line and str(out / "checkpoints" / "step-1") in line
    assert not list((out / "checkpoints").glob("*.tmp"))


# -- data files


def test_non_utf8_bytes_name_the_file_and_row(tmp_path):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    bad.write_bytes(b'{"sentence": "ok", "label": 1}\n{"sentence": "\xff\xfe", "label": 0}\n')
    line = one_line(
        train_in_process(["--task", "sst2", "--train-file", str(bad), "--eval-file", str(good)])
    )
    assert str(bad) in line and "row 2" in line and "UTF-8" in line


@pytest.mark.parametrize("missing", ["--train-file", "--eval-file"])
def test_a_missing_data_file_is_named_by_its_flag(tmp_path, missing):
    """``data file d.tsv does not exist`` named neither the flag nor a fix: with both flags
    in one command, the user had to guess which path was wrong."""
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    files = {"--train-file": str(good), "--eval-file": str(good), missing: "nope/d.tsv"}
    out = tmp_path / "out"
    line = one_line(
        train_in_process(
            ["--task", "sst2", *(x for kv in files.items() for x in kv)]
            + ["--output-dir", str(out)]
        )
    )
    assert line == (
        f"error: {missing} nope/d.tsv: no such file; correct the path, or give a hub "
        "dataset's split as hf:PATH[:CONFIG]:SPLIT"
    )
    assert not out.exists()


def test_a_csv_field_over_the_limit_is_one_line(tmp_path):
    good, big = tmp_path / "good.jsonl", tmp_path / "big.csv"
    good.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    big.write_text("sentence,label\nok,1\n" + "x" * 200_000 + ",1\n")
    line = one_line(
        train_in_process(["--task", "sst2", "--train-file", str(big), "--eval-file", str(good)])
    )
    assert str(big) in line and "row 2" in line and "field limit" in line


def test_max_length_too_small_for_the_candidates(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "out"
    line = one_line(
        train_in_process(
            ["--task", "sst2", "--train-file", str(data), "--eval-file", str(data)]
            + ["--max-length", "1", "--output-dir", str(out)]
        )
    )
    assert "--max-length 1" in line
    assert not out.exists()


# -- combined messages (item 10)


def test_a_batch_size_message_names_only_its_flag():
    line = one_line(train_in_process(["--batch-size", "0"]))
    assert "--batch-size" in line and "--max-steps" not in line and "--eval-batch-size" not in line


def test_an_evaluation_set_too_large_is_refused_by_the_plan_before_it_is_drawn(
    tmp_path, monkeypatch
):
    """The counting task's --eval-batch-size is its evaluation set: 10^8 sequences once
    took every byte of host memory before the memory plan could speak."""
    from distzo.data.synthetic import CountingTask

    def drawn(self, size):
        raise AssertionError(f"an evaluation set of {size} sequences was drawn")

    monkeypatch.setattr(CountingTask, "eval_set", drawn)
    out = tmp_path / "run"
    line = one_line(train_in_process(["--eval-batch-size", "100000000", "--output-dir", str(out)]))
    assert "does not fit" in line and "--eval-batch-size" in line, line
    assert not out.exists() or not any(out.iterdir())  # nothing a retry takes for a run


def test_a_bad_thread_count_in_the_environment_is_one_line_before_any_run(tmp_path):
    out = tmp_path / "run"
    proc = train_in_process(["--output-dir", str(out)], env={"OMP_NUM_THREADS": "lots"})
    assert proc.returncode == 2
    assert one_line(proc).endswith(
        "OMP_NUM_THREADS='lots' is not a thread count; set it to a number >= 1, unset it, or "
        "give --threads N"
    )
    assert not out.exists()


def test_a_dp_suggestion_says_one_thing_once():
    line = one_line(train_in_process(["--dp", "2"]))
    assert line.count("--dp 1") == 1


def test_an_unknown_toml_key_suggests_the_closest(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("[optim]\nlrr = 0.1\n")
    line = one_line(train_in_process(["--config", str(config)]))
    assert "did you mean 'lr'" in line


# -- LOZO's noise options


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--noise", "lowrank", "--lozo-rank", "0"], "--lozo-rank must be >= 1, got 0"),
        (["--noise", "lowrank", "--lozo-interval", "0"], "--lozo-interval must be >= 1 step"),
        (
            ["--estimator", "lozo", "--noise", "gaussian"],
            "--estimator lozo perturbs along low-rank z, got --noise gaussian: set --noise lowrank",
        ),
    ],
)
def test_lozo_options_it_cannot_honour_are_one_line_before_any_run(tmp_path, flags, message):
    out = tmp_path / "out"
    line = one_line(train_in_process(flags + ["--output-dir", str(out)]))
    assert message in line
    assert not out.exists()


def test_replay_reads_a_leading_tilde_as_the_home_folder(run, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    shutil.copy(run / "seedlog.jsonl", tmp_path / "seedlog.jsonl")
    proc = main_in_process("distzo.replay", ["--log=~/seedlog.jsonl", "--out=~/out"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "out" / "config.json").is_file() and not (tmp_path / "~").exists()


def test_a_model_folder_of_a_million_layers_is_one_line_before_its_skeleton(tmp_path):
    # its skeleton built for an hour and took the host's memory before the plan could run
    model = tmp_path / "big"
    model.mkdir()
    config = tiny_opt().config.to_dict() | {"num_hidden_layers": 10**6}
    (model / "config.json").write_text(json.dumps(config))
    # a process of its own, cut at a minute: without the check it would build for an hour,
    # taking the memory of the test process that runs it (and its neighbours')
    args = ["--model", str(model), "--output-dir", str(tmp_path / "run")]
    proc = python_train(args, timeout=60)
    line = one_line(proc)
    assert line.startswith(f"error: --model {model}: its config.json describes "), line
    assert "M modules, at least" in line and "--force starts anyway" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("text", "message"),
    [("null", "config.json holds null, not a model's config"), ("PATCH", "expected int, got str")],
)
def test_replay_onto_a_base_whose_config_is_damaged_is_one_line(run, tmp_path, text, message):
    base = tmp_path / "base"
    shutil.copytree(run / "base", base)
    config = json.loads((base / "config.json").read_text()) | {"num_hidden_layers": "2"}
    (base / "config.json").write_text(json.dumps(config) if text == "PATCH" else text)
    args = ["--base", str(base), "--log", str(run / "seedlog.jsonl"), "--out", str(tmp_path / "o")]
    line = one_line(main_in_process("distzo.replay", args))
    assert line.startswith("error: --base") and message in line, line
