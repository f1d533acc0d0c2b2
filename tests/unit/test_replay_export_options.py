"""``distzo.replay`` without export flags writes the export the run wrote: the run's own
``--export-shard-size`` and ``--merge-adapter`` (its config.toml, else its log's header),
not ``distzo.train``'s defaults; a flag still wins, and a log from before the header
recorded them replays with the defaults."""

import json
import logging
import re
import shutil
from pathlib import Path

import pytest

import distzo.replay
from distzo.config.job import resolve
from distzo.job.replay_defaults import run_export_options
from distzo.job.trainer import Trainer
from distzo.replay import main

SHARDS = ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """One step of the built-in model exported in 40KB shards (three of them)."""
    out = tmp_path_factory.mktemp("shards") / "run"
    flags = ["--max-steps", "1", "--device", "cpu", "--log-every", "0"]
    with Trainer(resolve(flags + ["--export-shard-size", "40KB", "--output-dir", str(out)])) as t:
        t.train()
    return out


def _weights(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("model"))


def _replay(log: Path, out: Path, *flags: str) -> list[str]:
    assert main(["--log", str(log), "--out", str(out), *flags]) == 0
    return _weights(out)


def test_a_replay_writes_the_shards_the_runs_export_has(run, tmp_path):
    assert _weights(run / "export")[:2] == SHARDS
    assert _replay(run / "seedlog.jsonl", tmp_path / "out") == _weights(run / "export")


def test_a_log_copied_alone_takes_its_headers_shard_size(run, tmp_path):
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(run / "seedlog.jsonl", alone)  # no config.toml beside it
    assert _replay(alone / "seedlog.jsonl", tmp_path / "out") == _weights(run / "export")


def test_a_resumes_changed_shard_size_in_config_toml_wins_over_the_header(run, tmp_path):
    moved = tmp_path / "run"
    shutil.copytree(run, moved, ignore=shutil.ignore_patterns("checkpoints", "export"))
    config = moved / "config.toml"
    config.write_text(config.read_text().replace('"40KB"', '"60KB"'))  # as a resume writes it
    assert len(_replay(moved / "seedlog.jsonl", tmp_path / "out")) == 3  # 2 shards, the index


def test_an_old_log_takes_the_default_and_a_flag_wins(run, tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    lines = (run / "seedlog.jsonl").read_text().splitlines(keepends=True)
    header = json.loads(lines[0])
    del header["export_shard_size"]  # a log from before the header recorded it
    (old / "seedlog.jsonl").write_text(json.dumps(header) + "\n" + "".join(lines[1:]))
    assert _replay(old / "seedlog.jsonl", tmp_path / "a") == ["model.safetensors"]
    flagged = _replay(run / "seedlog.jsonl", tmp_path / "b", "--export-shard-size", "5GB")
    assert flagged == ["model.safetensors"]


def test_merge_adapter_comes_from_config_toml_then_the_header(tmp_path, caplog):
    log = tmp_path / "seedlog.jsonl"
    header = {"merge_adapter": True, "export_shard_size": "2GB"}
    assert run_export_options(log, header) == {"export_shard_size": "2GB", "merge_adapter": True}
    (tmp_path / "config.toml").write_text("[peft]\nmerge_adapter = false\n")  # resumed so
    assert run_export_options(log, header)["merge_adapter"] is False
    assert run_export_options(log, {}) == {"export_shard_size": "5GB", "merge_adapter": False}
    (tmp_path / "config.toml").write_text("[peft\n")  # damaged: the header's, and a warning
    with caplog.at_level(logging.WARNING):
        assert run_export_options(log, header)["merge_adapter"] is True
    assert "config.toml: not valid TOML (" in caplog.text


def test_a_config_toml_value_of_the_wrong_type_leaves_the_headers(tmp_path):
    """A hand-edited ``merge_adapter = "no"`` is truthy: taken, it would merge."""
    log = tmp_path / "seedlog.jsonl"
    (tmp_path / "config.toml").write_text(
        '[run]\nexport_shard_size = 40\n[peft]\nmerge_adapter = "no"\n'
    )
    header = {"merge_adapter": False, "export_shard_size": "2GB"}
    assert run_export_options(log, header) == {"export_shard_size": "2GB", "merge_adapter": False}


def test_no_config_toml_is_no_warning_and_a_too_deep_one_is_one(tmp_path, caplog):
    log = tmp_path / "seedlog.jsonl"
    header = {"merge_adapter": True, "export_shard_size": "2GB"}
    with caplog.at_level(logging.WARNING):
        assert run_export_options(log, header)["merge_adapter"] is True  # a log copied alone
    assert caplog.text == ""
    (tmp_path / "config.toml").write_text("x = " + "[" * 5000)  # tomllib: RecursionError
    with caplog.at_level(logging.WARNING):
        assert run_export_options(log, header)["merge_adapter"] is True
    assert "config.toml: not valid TOML (" in caplog.text


def test_a_damaged_recorded_shard_size_is_one_line_before_any_model(run, tmp_path, monkeypatch):
    alone = tmp_path / "alone"
    alone.mkdir()
    lines = (run / "seedlog.jsonl").read_text().splitlines(keepends=True)
    header = {**json.loads(lines[0]), "export_shard_size": "lots"}
    (alone / "seedlog.jsonl").write_text(json.dumps(header) + "\n" + "".join(lines[1:]))

    def no_model(*args, **kwargs):
        raise AssertionError("the base model was built before the size was checked")

    monkeypatch.setattr(distzo.replay, "base_model", no_model)
    message = "--export-shard-size 'lots' is not a size; write e.g. 5GB or 500MB"
    with pytest.raises(ValueError, match=re.escape(message)):
        distzo.replay.replay(None, alone / "seedlog.jsonl", tmp_path / "out")
