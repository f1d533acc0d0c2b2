"""A resume whose --train-file or --eval-file moved (the same rows at another path: copied
to a local disk, or moved with the run's folder) goes on with the new path, which its
config.toml then records; rows that differ from the run's are refused naming both paths
and both digests (the path alone was compared, and the same rows refused as a change)."""

import json
import shutil
from pathlib import Path

from distzo.data.task_data import rows_digest
from tests.helpers.launch import train_in_process
from tests.unit.test_run_dir import error_line

ROWS = [f"row {i} of the corpus" for i in range(8)]
TINY = ["--task", "text", "--batch-size", "4", "--eval-batch-size", "4", "--log-every", "0"]


def corpus(path: Path, rows: list[str] = ROWS) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(row + "\n" for row in rows))
    return path


def files(train: Path | str, evals: Path | str) -> list[str]:
    return ["--train-file", str(train), "--eval-file", str(evals)]


def started(run: Path, train: Path, evals: Path) -> list[str]:
    """A run of one step whose checkpoint a resume goes on from; its argv but the files."""
    argv = [*TINY, "--max-steps", "1", "--output-dir", str(run)]
    proc = train_in_process([*files(train, evals), *argv])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return argv


def test_a_moved_train_and_eval_file_resume_and_the_config_records_the_new_paths(tmp_path):
    run, train, evals = tmp_path / "run", corpus(tmp_path / "a/train.txt"), tmp_path / "a/ev.txt"
    argv = started(run, train, corpus(evals, ROWS[:4]))
    header = json.loads((run / "seedlog.jsonl").read_text().splitlines()[0])
    assert (header["train_rows"], header["eval_rows"]) == (rows_digest(ROWS), rows_digest(ROWS[:4]))
    shutil.move(tmp_path / "a", tmp_path / "local")  # the data copied elsewhere, the old gone
    moved = files(tmp_path / "local/train.txt", tmp_path / "local/ev.txt")
    proc = train_in_process([*moved, *argv, "--max-steps", "2", "--resume"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        f"--resume: --train-file moved from {train} to {tmp_path / 'local/train.txt'}, with the "
        f"run's rows (rows digest {rows_digest(ROWS)}): reading {tmp_path / 'local/train.txt'}, "
        "which the run's config.toml now records"
    ) in proc.stderr
    assert f"--resume: --eval-file moved from {evals} to {tmp_path / 'local/ev.txt'}" in proc.stderr
    assert "would change the trajectory" not in proc.stderr
    recorded = (run / "config.toml").read_text()
    assert f'train_file = "{tmp_path / "local/train.txt"}"' in recorded
    assert f'eval_file = "{tmp_path / "local/ev.txt"}"' in recorded
    # the recorded paths are the run's now: --config alone resumes, with no line of a move
    again = ["--config", str(run / "config.toml"), "--max-steps", "3", "--resume"]
    proc = train_in_process(again)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "moved from" not in proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["options"]["data_commits"] == {}  # local files: no hub commit


def test_a_new_path_with_other_rows_is_refused_naming_both_paths_and_digests(tmp_path):
    run, train = tmp_path / "run", corpus(tmp_path / "train.txt")
    argv = started(run, train, train)
    other = corpus(tmp_path / "copy/train.txt", [*ROWS, "a row added since"])
    line = error_line(train_in_process([*files(other, train), *argv, "--resume"]))
    assert line == (
        f"error: --resume: --train-file {other} holds other rows than --train-file {train}, "
        f"which the run in {run} read (rows digest {rows_digest([*ROWS, 'a row added since'])} "
        f"of the task's examples, its seed log's {rows_digest(ROWS)}); give --train-file "
        f"{train}, or a copy of that file, or start afresh with --overwrite or another "
        "--output-dir"
    )
    assert f'train_file = "{train}"' in (run / "config.toml").read_text()  # left as it was


def test_a_log_without_the_eval_rows_digest_refuses_a_moved_eval_file_as_a_change(tmp_path):
    """A run of an earlier version recorded no digest of its evaluation rows: nothing says
    the new path holds them, so the change is refused as any other option's."""
    run, train, evals = tmp_path / "run", corpus(tmp_path / "train.txt"), tmp_path / "ev.txt"
    argv = started(run, train, corpus(evals))
    log = run / "seedlog.jsonl"
    header, *records = log.read_text().splitlines()
    older = {k: v for k, v in json.loads(header).items() if k != "eval_rows"}
    log.write_text("".join(line + "\n" for line in [json.dumps(older), *records]))
    copy = corpus(tmp_path / "copy/ev.txt")
    line = error_line(train_in_process([*files(train, copy), *argv, "--resume"]))
    assert line.startswith(
        f"error: --resume: --eval-file {evals} -> {copy} would change the trajectory of the run"
    )


def test_a_run_folder_moved_with_its_data_and_relative_paths_resumes(tmp_path, monkeypatch):
    """The run started with relative paths in its folder's parent; the folder moved, and
    the resume is started from elsewhere, the moved paths given."""
    project = tmp_path / "project"
    corpus(project / "data/train.txt")
    monkeypatch.chdir(project)
    argv = [*files("data/train.txt", "data/train.txt"), *TINY, "--max-steps", "1"]
    proc = train_in_process([*argv, "--output-dir", "runs/a"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert 'train_file = "data/train.txt"' in (project / "runs/a/config.toml").read_text()
    shutil.move(project, tmp_path / "moved")
    monkeypatch.chdir(tmp_path)
    moved = tmp_path / "moved"
    resume = ["--config", str(moved / "runs/a/config.toml"), "--output-dir", str(moved / "runs/a")]
    resume += [*files("moved/data/train.txt", "moved/data/train.txt"), "--max-steps", "2"]
    proc = train_in_process([*resume, "--resume"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--resume: --train-file moved from data/train.txt to moved/data/train.txt" in proc.stderr
    assert 'train_file = "moved/data/train.txt"' in (moved / "runs/a/config.toml").read_text()


def test_a_moved_or_copied_run_folder_resumes_in_the_folder_its_config_is_in(tmp_path):
    """``--config RUN/config.toml --resume`` without --output-dir: the folder recorded in
    the file (absolute) was the run directory; moved, the resume found no checkpoint there,
    and a copy's resume went on in the original."""
    train = corpus(tmp_path / "data/train.txt")
    started(tmp_path / "run", train, train)
    shutil.move(tmp_path / "run", tmp_path / "moved")
    proc = train_in_process(
        ["--config", str(tmp_path / "moved/config.toml"), "--max-steps", "2", "--resume"]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"the run's folder is {tmp_path / 'moved'}, not the {tmp_path / 'run'}" in proc.stderr
    assert not (tmp_path / "run").exists()
    assert f'output_dir = "{tmp_path / "moved"}"' in (tmp_path / "moved/config.toml").read_text()
    shutil.copytree(tmp_path / "moved", tmp_path / "copy")
    original = (tmp_path / "moved/seedlog.jsonl").read_text()
    proc = train_in_process(
        ["--config", str(tmp_path / "copy/config.toml"), "--max-steps", "3", "--resume"]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "moved/seedlog.jsonl").read_text() == original
    steps = [
        json.loads(line) for line in (tmp_path / "copy/metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in steps if "loss" in r] == [0, 1, 2]
