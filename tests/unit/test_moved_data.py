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


def test_the_runs_data_file_gone_says_it_was_the_runs_and_that_a_new_path_goes_on(tmp_path):
    """The file moved, and the resume gave the run's path again (its --config, or the same
    command): the loader's "no such file; correct the path" said nothing of the run."""
    run, train, evals = tmp_path / "run", corpus(tmp_path / "train.txt"), tmp_path / "ev.txt"
    argv = started(run, train, corpus(evals, ROWS[:4]))
    shutil.move(train, tmp_path / "moved.txt")
    line = error_line(train_in_process([*files(train, evals), *argv, "--resume"]))
    assert line == (
        f"error: --resume: --train-file {train}: no such file, and the run in {run} read its "
        f"rows there (rows digest {rows_digest(ROWS)}); give --train-file with the file's new "
        "path (its rows are checked against that digest), or restore it there, or start "
        "afresh with --overwrite or another --output-dir"
    )
    typo = tmp_path / "mvoed.txt"  # a path the run never read: the loader's own line
    line = error_line(train_in_process([*files(typo, evals), *argv, "--resume"]))
    assert line.startswith(f"error: --train-file {typo}: no such file; correct the path")
    # a log of an earlier version has no eval_rows: only the file at its path goes on
    shutil.move(tmp_path / "moved.txt", train)
    evals.unlink()
    log = run / "seedlog.jsonl"
    header, *records = log.read_text().splitlines()
    older = {k: v for k, v in json.loads(header).items() if k != "eval_rows"}
    log.write_text("".join(line + "\n" for line in [json.dumps(older), *records]))
    proc = train_in_process(["--config", str(run / "config.toml"), "--resume"])
    assert error_line(proc) == (
        f"error: --resume: --eval-file {evals}: no such file, and the run in {run} read its "
        "rows there; its seed log records no digest of them to check another path against, "
        "so restore the file at that path, or start afresh with --overwrite or another "
        "--output-dir"
    )


def test_a_link_whose_target_moved_is_named_and_the_target_goes_on(tmp_path):
    run, target = tmp_path / "run", corpus(tmp_path / "store/train.txt")
    link = tmp_path / "train.txt"
    link.symlink_to(target)
    argv = started(run, link, link)
    shutil.move(tmp_path / "store", tmp_path / "store2")
    line = error_line(train_in_process([*files(link, link), *argv, "--resume"]))
    assert line.startswith(
        f"error: --resume: --train-file {link}: no such file (a link to {target}, which is "
        f"gone), and the run in {run} read its rows there (rows digest {rows_digest(ROWS)})"
    )
    new = tmp_path / "store2/train.txt"
    proc = train_in_process([*files(new, new), *argv, "--max-steps", "2", "--resume"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"--resume: --train-file moved from {link} to {new}, with the run's rows" in proc.stderr


def test_the_runs_file_named_otherwise_is_said_so_and_its_edit_refused(tmp_path, monkeypatch):
    """./data/train.txt for the run's data/train.txt (or a link to it) is no move: the line
    says it is the run's file; edited since, its fix is the run's rows, not its path."""
    monkeypatch.chdir(tmp_path)
    corpus(tmp_path / "data/train.txt")
    argv = [*TINY, "--max-steps", "1", "--output-dir", "run"]
    proc = train_in_process([*files("data/train.txt", "data/train.txt"), *argv])
    assert proc.returncode == 0, proc.stderr[-2000:]
    two_steps = [*argv, "--max-steps", "2"]
    proc = train_in_process([*files("./data/train.txt", "data/train.txt"), *two_steps, "--resume"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        "--resume: --train-file ./data/train.txt is the run's data/train.txt, named otherwise: "
        "reading ./data/train.txt, which the run's config.toml now records"
    ) in proc.stderr
    corpus(tmp_path / "data/train.txt", [*ROWS, "a row added since"])
    line = error_line(
        train_in_process([*files("data/train.txt", "data/train.txt"), *two_steps, "--resume"])
    )
    assert line.startswith(
        "error: --resume: --train-file data/train.txt (the run's ./data/train.txt, named "
        "otherwise) holds other rows than the run in run read (rows digest "
    )
    assert line.endswith(
        "restore the rows the run started with, or start afresh with "
        "--overwrite or another --output-dir"
    )
    (tmp_path / "data/train.txt").unlink()  # relative: from which folder is said
    line = error_line(
        train_in_process([*files("data/train.txt", "data/train.txt"), *two_steps, "--resume"])
    )
    assert line.startswith(
        f"error: --resume: --train-file data/train.txt: no such file under {tmp_path}, and the "
        "run in run read its rows there"
    )


def test_a_home_path_resumes_as_the_same_path(tmp_path, monkeypatch):
    """``~/data/train.txt`` is expanded before config.toml records it and before a resume
    compares it: the same file, no line of a move."""
    monkeypatch.setenv("HOME", str(tmp_path))
    corpus(tmp_path / "data/train.txt")
    home = files("~/data/train.txt", "~/data/train.txt")
    argv = started(tmp_path / "run", tmp_path / "data/train.txt", tmp_path / "data/train.txt")
    assert (
        f'train_file = "{tmp_path / "data/train.txt"}"'
        in (tmp_path / "run/config.toml").read_text()
    )
    proc = train_in_process([*home, *argv, "--max-steps", "2", "--resume"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--resume: --train-file" not in proc.stderr


def test_a_hub_split_and_a_file_of_its_rows_stand_for_each_other(tmp_path, monkeypatch):
    """A hub split exported to a file (an offline cluster) holds the run's rows: the rows
    decide, as for a moved file; other rows are refused, the fix fitting a hub spec."""
    import datasets.config
    from datasets import Dataset

    from distzo.models import hub_reads

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    monkeypatch.setattr(hub_reads, "hub_answers", lambda: False)
    (tmp_path / "hub/data").mkdir(parents=True)
    parquet = tmp_path / "hub/data/train-00000-of-00001.parquet"
    Dataset.from_list([{"text": row} for row in ROWS]).to_parquet(str(parquet))
    hub, run = f"hf:{tmp_path / 'hub'}:train", tmp_path / "run"
    argv = [*TINY, "--max-steps", "1", "--output-dir", str(run)]
    proc = train_in_process([*files(hub, hub), *argv])
    assert proc.returncode == 0, proc.stderr[-2000:]
    other = corpus(tmp_path / "other.txt", ROWS[:6])
    line = error_line(train_in_process([*files(other, hub), *argv, "--resume"]))
    assert line.endswith(
        f"give --train-file {hub}, or its rows as a file, or start afresh with --overwrite "
        "or another --output-dir"
    )
    exported = corpus(tmp_path / "exported.txt")
    proc = train_in_process([*files(exported, hub), *argv, "--max-steps", "2", "--resume"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        f"--resume: --train-file {exported} holds the rows the run read from {hub} (rows "
        f"digest {rows_digest(ROWS)}): reading {exported}, which the run's config.toml now "
        "records"
    ) in proc.stderr
