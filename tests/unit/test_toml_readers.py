"""A broken or unreadable TOML file is one kind of one-line error naming the file (and the
line and column where there is one), whichever reader meets it: ``--config``, a resume's
``config.toml`` (refused) and a replay's (a warning, the log's header instead). Bytes that
are not UTF-8 escaped all three as a bare codec message naming neither file nor line."""

import logging
import re
from pathlib import Path

import pytest

from distzo.config.job import JobConfig, load_toml
from distzo.job.replay_defaults import run_export_options
from distzo.job.run_dir import _recorded
from distzo.runtime.toml_file import UnreadableToml, read_toml

# Each broken file: its bytes (or "folder", or "missing": none there), and the problem named.
BROKEN: dict[str, tuple[bytes | str, str]] = {
    "missing": ("missing", "no such file"),
    "syntax": (b"[optim]\nlr = \n", "not valid TOML (Invalid value (at line 2, column 6))"),
    "nested": (
        b"a = " + b"[" * 5000 + b"]" * 5000 + b"\n",
        "not valid TOML (nested too deeply)",
    ),
    "folder": ("folder", "cannot read it (Is a directory)"),
    "bytes": (  # a Latin-1 comment on line 3: the line counted from the last newline
        b"[run]\nseed = 1\n# caf\xe9 \xff\n",
        "not valid TOML (not UTF-8: byte 0xe9 at line 3, column 6)",
    ),
}


def broken(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """``config.toml`` in ``tmp_path`` broken as ``kind``, and the problem it names."""
    content, problem = BROKEN[kind]
    path = tmp_path / "config.toml"
    if content == "folder":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    return path, problem


@pytest.mark.parametrize("kind", BROKEN)
def test_read_toml_names_the_file_and_the_problem(tmp_path, kind):
    path, problem = broken(tmp_path, kind)
    with pytest.raises(UnreadableToml, match=f"^{re.escape(f'{path}: {problem}')}$"):
        read_toml(path)


def test_read_toml_reads_a_good_file(tmp_path):
    (tmp_path / "job.toml").write_text('[run]\nseed = 3\n[model]\nmodel = "é"\n')
    assert read_toml(tmp_path / "job.toml") == {"run": {"seed": 3}, "model": {"model": "é"}}


@pytest.mark.parametrize("kind", BROKEN)
def test_a_broken_config_file_is_one_line_naming_it(tmp_path, kind):
    path, problem = broken(tmp_path, kind)
    with pytest.raises(
        ValueError, match="^" + re.escape(f"--config {path}: {problem}; correct the path")
    ):
        load_toml(str(path))


@pytest.mark.parametrize("kind", BROKEN)
def test_a_resumes_broken_config_toml_is_one_line_naming_it(tmp_path, kind):
    path, problem = broken(tmp_path, kind)
    with pytest.raises(
        ValueError, match=f"^{re.escape(f'--resume: {path}: {problem}; repair or remove it')}$"
    ):
        _recorded(JobConfig(), path)


@pytest.mark.parametrize("kind", [kind for kind in BROKEN if kind != "missing"])
def test_a_replays_broken_config_toml_is_a_warning_and_the_header_serves(tmp_path, caplog, kind):
    path, problem = broken(tmp_path, kind)
    header = {"export_shard_size": "40KB", "merge_adapter": True}
    with caplog.at_level(logging.WARNING, logger="distzo.job.replay_defaults"):
        options = run_export_options(tmp_path / "seedlog.jsonl", header)
    assert options == {"export_shard_size": "40KB", "merge_adapter": True}
    [record] = caplog.records
    assert record.getMessage() == f"{path}: {problem}; the log's header gives the export options"


def test_a_section_that_is_no_table_is_refused_by_a_resume_and_passed_over_by_a_replay(tmp_path):
    """A hand-edited ``run = 1`` parses: a resume refuses it in one line; a replay, which
    crashed on it (``'int' object has no attribute 'get'``), takes the log's header."""
    path = tmp_path / "config.toml"
    path.write_text("run = 1\n[peft]\nmerge_adapter = true\n")
    with pytest.raises(
        ValueError,
        match="^" + re.escape(f"--resume: {path} records run = 1, not a [run] table; repair"),
    ):
        _recorded(JobConfig(), path)
    header = {"export_shard_size": "40KB", "merge_adapter": False}
    options = run_export_options(tmp_path / "seedlog.jsonl", header)
    assert options == {"export_shard_size": "40KB", "merge_adapter": True}
