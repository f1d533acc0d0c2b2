"""The run directory: a command never re-runs into a run it did not ask to go on with or
to replace (nor two runs started in the same second into one default directory),
``--overwrite`` deletes only the run's own files, and a resume goes on only from a
checkpoint its seed log leads up to, with options that keep its trajectory."""

import datetime
import hashlib
import json
import os
import shutil
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from distzo.config.checks import resolve_defaults
from distzo.config.job import resolve
from distzo.data.task_data import LoadedRows, rows_digest
from distzo.dist import LaunchEnv
from distzo.job import run_dir as run_dir_module
from distzo.job.resume import check_resumed_rows, resume_mode
from distzo.job.run_dir import check_resumed_options, clear_run, new_run_dir
from distzo.job.run_end import kept_export
from distzo.job.trainer import Trainer
from tests.helpers.launch import main_in_process, python_train, train_in_process
from tests.helpers.run_copies import copied_run

SMALL = ["--batch-size", "8", "--eval-batch-size", "8", "--log-every", "0"]


def hashes(directory: Path) -> dict[str, str]:
    """Every file under ``directory``, by relative path, with its sha256."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints after 2 and 4 steps."""
    run = tmp_path_factory.mktemp("finished") / "run"
    proc = python_train([*SMALL, "--max-steps", "4", "--save-steps", "2", "--output-dir", str(run)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run


@pytest.fixture
def run(finished, tmp_path) -> Path:
    """A copy of the finished run that a test may change."""
    return copied_run(finished, tmp_path / "run")


@pytest.fixture
def frozen_clock(monkeypatch) -> str:
    """Every run starts in the same second; returns its timestamp."""

    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 1, 2, 3, 4, 5)

    monkeypatch.setattr(run_dir_module, "datetime", types.SimpleNamespace(datetime=Frozen))
    return "20260102-030405"


def test_runs_started_in_the_same_second_get_their_own_default_directories(
    frozen_clock, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    trainers = [Trainer(resolve([*SMALL, "--lr", lr]), LaunchEnv()) for lr in ("0.01", "0.02")]
    for trainer in trainers:
        trainer.build()
        trainer.close()
    runs = tmp_path / "runs"
    assert [t.run_dir for t in trainers] == [
        Path("runs") / frozen_clock,
        Path("runs") / f"{frozen_clock}-2",
    ]
    for trainer, lr in zip(trainers, ("0.01", "0.02")):  # neither wrote into the other's
        assert f"lr = {lr}\n" in (tmp_path / trainer.run_dir / "config.toml").read_text()
    assert sorted(p.name for p in runs.iterdir()) == [frozen_clock, f"{frozen_clock}-2"]


def test_a_default_directory_is_made_atomically_once_per_caller(frozen_clock, tmp_path):
    # Eight "jobs" asking at once get eight directories: mkdir(exist_ok=False) decides.
    with ThreadPoolExecutor(8) as pool:
        made = list(pool.map(lambda _: new_run_dir(tmp_path / "runs"), range(8)))
    names = [frozen_clock] + [f"{frozen_clock}-{n}" for n in range(2, 9)]
    assert sorted(p.name for p in made) == sorted(names)
    assert all(p.is_dir() and not any(p.iterdir()) for p in made)


def error_line(proc) -> str:
    """The one line a refusal writes (exit code 2, nothing else on stderr)."""
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_rerun_into_a_run_directory_is_refused_and_changes_no_byte(run):
    (run / "notes.txt").write_text("mine")
    before = hashes(run)
    line = error_line(train_in_process([*SMALL, "--max-steps", "2", "--output-dir", str(run)]))
    assert line.startswith(f"error: --output-dir {run} already holds a run (base/, checkpoints/")
    assert line.endswith(
        "add --resume to go on with it, --overwrite to delete it and start afresh, or give "
        "another --output-dir"
    )
    # The run's own config.toml names its directory: passed back alone, the same refusal.
    recorded = (run / "config.toml").read_text()
    assert f'output_dir = "{run}"' in recorded and "resume =" not in recorded
    assert error_line(train_in_process(["--config", str(run / "config.toml")])) == line
    assert hashes(run) == before


def test_overwrite_deletes_the_runs_own_files_and_nothing_else(run):
    (run / "notes.txt").write_text("mine")
    (run / "mine").mkdir()
    (run / "mine" / "data.jsonl").write_text("{}\n")
    (run / "checkpoints" / "step-9").mkdir()  # a stale checkpoint a resume would have taken
    proc = python_train([*SMALL, "--max-steps", "3", "--output-dir", str(run), "--overwrite"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"deleted the old run in {run} (" in proc.stderr and "--resume auto" not in proc.stderr
    assert (run / "notes.txt").read_text() == "mine" and (run / "mine" / "data.jsonl").exists()
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-3"]
    steps = [json.loads(line) for line in (run / "seedlog.jsonl").read_text().splitlines()][1:]
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert "\noverwrite =" not in (run / "config.toml").read_text()


def test_overwrite_deletes_the_old_runs_export_best(run):
    """An ``--export-best`` run's ``export-best/`` is the old run's model: left by
    ``--overwrite``, it sat beside the new run's files as if the new run had chosen it."""
    (run / "export-best").mkdir()
    (run / "export-best" / "model.safetensors").write_bytes(b"the old run's best step")
    (run / "export-best.tmp").mkdir()  # a replay killed before its rename
    proc = train_in_process([*SMALL, "--max-steps", "2", "--output-dir", str(run), "--overwrite"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (run / "export-best").exists() and not (run / "export-best.tmp").exists()


def test_a_resumed_runs_config_records_the_run_not_the_resume(run, tmp_path):
    proc = train_in_process([*SMALL, "--max-steps", "5", "--output-dir", str(run), "--resume"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    recorded = (run / "config.toml").read_text()
    assert "max_steps = 5\n" in recorded and f'output_dir = "{run}"' in recorded
    assert "\nresume =" not in recorded and "\noverwrite =" not in recorded
    # Passed back for a new run it starts one afresh, as the file a resume wrote before did not.
    new = tmp_path / "new"
    job = resolve(["--config", str(run / "config.toml"), "--output-dir", str(new)])
    assert job.run.resume is None and not job.run.overwrite
    assert resume_mode(job.run, LaunchEnv()) == "no"


def test_overwrite_and_resume_are_refused_together(run):
    line = error_line(train_in_process(["--output-dir", str(run), "--overwrite", "--resume"]))
    assert line == (
        "error: --overwrite starts afresh and --resume yes goes on with the run: keep one"
    )


def test_a_torchrun_restart_of_an_overwrite_run_goes_on_from_the_first_attempt(run):
    job = resolve(["--output-dir", str(run), "--overwrite"])
    first = LaunchEnv(max_restarts=1, restart_count=0)
    assert resume_mode(job.run, first) == "no" and job.run.overwrite
    restart = LaunchEnv(max_restarts=1, restart_count=1)
    assert resume_mode(job.run, restart) == "yes" and not job.run.overwrite


def test_a_checkpoint_ahead_of_the_seed_log_is_refused_naming_both(run):
    log = run / "seedlog.jsonl"
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines()[:3]))  # 0, 1
    line = error_line(train_in_process([*SMALL, "--output-dir", str(run), "--resume"]))
    assert line == (
        f"error: --resume: {run}/checkpoints/step-4 holds 4 steps but {log} ends at step 1; "
        "the two are not one run; start afresh with --overwrite or another --output-dir"
    )


@pytest.mark.parametrize("garbage", [b"not json at all\n{}\n", b"\xff\xfe\x00binary"])
def test_a_seed_log_without_its_header_is_refused_as_damaged(run, garbage):
    """A damaged log was said to 'end at its header', which it did not hold (and a binary
    one raised UnicodeDecodeError's traceback)."""
    log = run / "seedlog.jsonl"
    log.write_bytes(garbage)
    line = error_line(train_in_process([*SMALL, "--output-dir", str(run), "--resume"]))
    assert line == (
        f"error: --resume: {log} does not begin with a seed log's header (damaged, or not "
        f"distzo's); restore it, move it aside to resume from {run}/checkpoints/step-4 (4 "
        "steps) alone (a replay then cannot rebuild the run), or start afresh with "
        "--overwrite or another --output-dir"
    )
    log.unlink()  # moved aside: the checkpoint resumes alone, as the line says (a step on
    # from it: without --max-steps the default job's 400 steps followed, at a minute's cost)
    resumed = train_in_process([*SMALL, "--max-steps", "5", "--output-dir", str(run), "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "(resumed at step 4)" in resumed.stderr


def test_a_seed_log_whose_records_are_not_text_is_read_as_holding_none(run):
    """Its steps were read as UTF-8 and the resume failed on the decoder's message."""
    log = run / "seedlog.jsonl"
    log.write_bytes(log.read_bytes().split(b"\n")[0] + b"\n\xff\xfe binary\n")
    line = error_line(train_in_process([*SMALL, "--output-dir", str(run), "--resume"]))
    assert line == (
        f"error: --resume: {run}/checkpoints/step-4 holds 4 steps but {log} ends at its "
        "header; the two are not one run; start afresh with --overwrite or another --output-dir"
    )


def test_a_seed_log_that_begins_after_the_checkpoint_is_refused_naming_both(run):
    """A log that starts at step 6 (its run resumed from a copied checkpoint of 6 steps)
    cannot bring a checkpoint of 4 steps to step 6: steps 4 and 5 are in neither."""
    import json

    log = run / "seedlog.jsonl"
    header, *records = [json.loads(line) for line in log.read_text().splitlines()]
    header["first_step"] = 6
    for offset, record in enumerate(records):
        record["step"] = 6 + offset
    log.write_text("".join(json.dumps(r) + "\n" for r in [header, *records]))
    line = error_line(train_in_process([*SMALL, "--output-dir", str(run), "--resume"]))
    assert line == (
        f"error: --resume: {run}/checkpoints/step-4 holds 4 steps but {log} ends at step 9; "
        "the two are not one run; start afresh with --overwrite or another --output-dir"
    )


def test_a_seed_log_with_a_gap_is_refused_naming_both(run):
    # The old failure: a re-run overwrote the log (steps 0-1), a later --resume loaded the
    # old step-4 checkpoint and appended steps 4-5.
    log = run / "seedlog.jsonl"
    lines = log.read_text().splitlines()
    log.write_text("".join(line + "\n" for line in lines[:3] + lines[4:]))  # 0, 1, then 3
    line = error_line(train_in_process([*SMALL, "--output-dir", str(run), "--resume"]))
    assert line == (
        f"error: --resume: {log} jumps from step 1 to step 3, so it does not go on from "
        f"{run}/checkpoints/step-4 (4 steps); the two are not one run; start afresh with "
        "--overwrite or another --output-dir"
    )


def test_resume_refuses_options_that_change_the_trajectory_naming_each(run):
    argv = [*SMALL, "--output-dir", str(run), "--resume", "--batch-size", "4", "--lr", "0.02"]
    line = error_line(train_in_process([*argv, "--eps", "0.01", "--optimizer", "momentum"]))
    assert line == (  # lr and eps may be retuned: they are not named
        "error: --resume: --batch-size 8 -> 4, "
        f"--optimizer sgd -> momentum would change the trajectory of the run in {run} (its "
        f"config.toml); resume with its values (--config {run / 'config.toml'} --resume gives "
        "all of them), or start afresh with --overwrite or another --output-dir"
    )
    # what the line suggests resumes the run, with no other option
    assert train_in_process(["--config", str(run / "config.toml"), "--resume"]).returncode == 0


def test_a_resume_names_an_option_the_run_left_unset_as_unset(run):
    """The line quoted Python's None (``--model-config None -> opt-125m``), which no one
    typed."""
    argv = [*SMALL, "--output-dir", str(run), "--resume", "--model-config", "opt-125m"]
    line = error_line(train_in_process([*argv, "--model-layers", "1"]))
    assert line.startswith(
        "error: --resume: --model-config unset -> opt-125m, --model-layers unset -> 1 would "
    )


def test_resume_accepts_options_that_keep_the_trajectory_naming_them_in_one_warning(run):
    argv = [*SMALL, "--output-dir", str(run), "--resume", "--max-steps", "6", "--eval-steps"]
    proc = python_train([*argv, "3", "--keep-checkpoints", "0", "--mode", "resident"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    (warning,) = [line for line in proc.stderr.splitlines() if "changed since" in line]
    assert warning.endswith(
        "--resume: changed since the run started: --mode offload -> "
        "resident, --eval-steps 0 -> 3, --save-steps 2 -> 0, "
        "--keep-checkpoints 2 -> 0"
    )
    # the linear schedule decays the lr to 0 at --max-steps: the steps from 4 on differ
    assert (
        "--resume: --max-steps 4 -> 6: the steps from here on differ from the run's (the "
        "logged ones stay)" in proc.stderr
    )
    steps = [json.loads(line) for line in (run / "seedlog.jsonl").read_text().splitlines()][1:]
    assert [r["step"] for r in steps] == list(range(6))


def test_a_resume_short_of_the_runs_steps_is_refused_and_a_finished_one_logs_once(run):
    before, evaluations = hashes(run), (run / "eval.jsonl").read_text()
    line = error_line(
        train_in_process([*SMALL, "--output-dir", str(run), "--resume", "--max-steps", "3"])
    )
    assert line == (
        f"error: --resume: the run in {run} has done 4 steps, more than --max-steps 3; give "
        "--max-steps 4 or more"
    )
    assert hashes(run) == before
    proc = train_in_process([*SMALL, "--output-dir", str(run), "--resume", "--max-steps", "4"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (run / "eval.jsonl").read_text() == evaluations  # the final one not repeated


def test_a_fresh_run_refused_while_building_leaves_nothing_behind(tmp_path):
    # The memory plan refuses it after base/ (the initial weights) was written.
    out = tmp_path / "run"
    proc = train_in_process([*SMALL, "--batch-size", "100000000", "--output-dir", str(out)])
    assert proc.returncode == 2 and "the run does not fit" in proc.stderr, proc.stderr[-2000:]
    assert not out.exists()  # the run made it: nothing left
    proc = train_in_process([*SMALL, "--max-steps", "1", "--output-dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_refused_resume_of_a_copied_checkpoint_leaves_the_directory_as_it_was(run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run / "checkpoints", copy / "checkpoints")
    before = hashes(copy)
    argv = [*SMALL, "--max-steps", "6", "--output-dir", str(copy), "--resume"]
    proc = train_in_process([*argv, "--optimizer", "momentum"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "was trained with --optimizer sgd, this run has --optimizer momentum" in last
    assert hashes(copy) == before  # no config.toml naming the refused option
    proc = train_in_process(argv)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_copied_checkpoints_run_resumes_again_and_its_log_says_where_it_begins(run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run / "checkpoints", copy / "checkpoints")  # step-2 and step-4, no log
    argv = [*SMALL, "--save-steps", "2", "--output-dir", str(copy), "--resume"]
    for steps in ("6", "8"):
        proc = train_in_process([*argv, "--max-steps", steps])
        assert proc.returncode == 0, proc.stderr[-2000:]
    header, *records = [
        json.loads(line) for line in (copy / "seedlog.jsonl").read_text().splitlines()
    ]
    assert header["kind"] == "header" and header["first_step"] == 4
    assert [r["step"] for r in records] == [4, 5, 6, 7]
    out = tmp_path / "replayed"
    replay = main_in_process(
        "distzo.replay", ["--log", str(copy / "seedlog.jsonl"), "--out", str(out)]
    )
    assert replay.returncode == 2 and replay.stderr.strip() == (
        f"error: --log {copy / 'seedlog.jsonl'} begins at step 4 (its run went on from a "
        "copied checkpoint): a replay needs every step from 0; use the run's export/ instead"
    )


def test_an_empty_seed_log_beside_a_checkpoint_is_no_log(run, tmp_path):
    """A resume of a copied checkpoint that stopped (or whose machine went down) before its
    log's header reached the disk left an empty log: the next resume was refused, as a log
    that "ends at its header", where a missing log resumes."""
    copy = tmp_path / "copy"
    shutil.copytree(run / "checkpoints", copy / "checkpoints")
    (copy / "seedlog.jsonl").touch()
    proc = train_in_process([*SMALL, "--max-steps", "6", "--output-dir", str(copy), "--resume"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    header = json.loads((copy / "seedlog.jsonl").read_text().splitlines()[0])
    assert header["kind"] == "header" and header["first_step"] == 4


def test_a_log_that_goes_on_from_a_checkpoint_no_longer_there_is_refused_naming_it(run, tmp_path):
    """A copied checkpoint's run (its log begins at step 4) whose checkpoints went: --resume
    pointed to --resume auto, which said "None holds 0 steps"."""
    copy = tmp_path / "copy"
    shutil.copytree(run / "checkpoints", copy / "checkpoints")
    argv = [*SMALL, "--max-steps", "6", "--output-dir", str(copy), "--resume"]
    assert train_in_process(argv).returncode == 0
    shutil.rmtree(copy / "checkpoints")
    for mode in ("yes", "auto"):
        assert error_line(train_in_process([*argv, mode])) == (
            f"error: --resume: {copy / 'seedlog.jsonl'} begins at step 4 (its run went on "
            f"from a checkpoint), but {copy / 'checkpoints'} holds none to go on from; "
            "restore the run's checkpoints, or start afresh with --overwrite or another "
            "--output-dir"
        )


def test_a_resume_with_seed_minus_1_takes_the_runs_seed(run):
    job = resolve([*SMALL, "--output-dir", str(run), "--seed", "-1"])
    resolve_defaults(job)  # as validate does first
    check_resumed_options(job, LaunchEnv())
    assert job.run.seed == 0


def test_a_config_from_before_objectives_resumes_as_teacher_forcing(run):
    """Before --objective (2026-11-23) every task trained on teacher forcing, and config.toml
    named no objective: that is the run's, and the refusal of another names the flag that
    --config cannot give."""
    config = run / "config.toml"
    recorded = resolve([*SMALL, "--output-dir", str(run), "--objective", "classification"])
    resolve_defaults(recorded)
    with pytest.raises(ValueError) as info:  # a config.toml that names it gives it
        check_resumed_options(recorded, LaunchEnv())
    assert f"(--config {config} --resume gives all of them)" in str(info.value)
    config.write_text(config.read_text().replace('objective = "lm"\n', ""))
    job = resolve([*SMALL, "--output-dir", str(run)])
    resolve_defaults(job)
    check_resumed_options(job, LaunchEnv())  # counting's default, lm: the run's
    job.optim.objective = "classification"  # a prompt task's default today
    with pytest.raises(ValueError) as info:
        check_resumed_options(job, LaunchEnv())
    assert str(info.value).startswith("--resume: --objective lm -> classification would change")
    assert f"(--config {config} --objective lm --resume gives all of them)" in str(info.value)


def test_resume_auto_with_nothing_to_go_on_from_says_so_before_deleting(tmp_path):
    """Its deletion was announced as '--overwrite: deleted the old run', a flag the user
    never gave."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("[run]\n")  # a run that stopped before its first step
    proc = train_in_process(
        [*SMALL, "--max-steps", "1", "--output-dir", str(run), "--resume", "auto"]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = [line.split(": ", 1)[1] for line in proc.stderr.splitlines() if "WARNING" in line]
    assert said == [
        f"--resume auto: {run} holds no checkpoint and no logged step to go on from; its old "
        "run's files go, as with --overwrite",
        f"deleted the old run in {run} (config.toml) to start afresh",
    ]


def test_resume_auto_starting_afresh_is_said_once_by_rank_0(tmp_path, caplog):
    """Each rank decides the resume mode; only rank 0 says that the old run goes (eight
    ranks said it eight times)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("[run]\n")
    for rank, said in ((1, 0), (0, 1)):
        job = resolve([*SMALL, "--output-dir", str(run), "--resume", "auto"])
        caplog.clear()
        env = LaunchEnv(rank=rank, world_size=2, local_world_size=2)
        assert resume_mode(job.run, env) == "no" and job.run.overwrite
        assert len([r for r in caplog.records if "as with --overwrite" in r.message]) == said


def test_resume_without_a_checkpoint_but_with_logged_steps_points_to_resume_auto(run):
    shutil.rmtree(run / "checkpoints")
    line = error_line(train_in_process([*SMALL, "--output-dir", str(run), "--resume"]))
    assert line == (
        f"error: --resume: no checkpoint in {run}/checkpoints, but its seed log holds 4 steps: "
        "--resume auto catches up with them from the initial weights"
    )


def test_overwrite_without_an_output_dir_deletes_nothing(run, monkeypatch):
    # The run goes to ./runs/<timestamp>: the working directory's files are not its own.
    monkeypatch.chdir(run)
    before = hashes(run)
    clear_run(resolve(["--overwrite"]))
    assert hashes(run) == before


def test_a_log_dir_holding_a_runs_logs_is_refused_too(run, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    shutil.copy(run / "metrics.jsonl", logs / "metrics.jsonl")
    argv = ["--output-dir", str(tmp_path / "new"), "--log-dir", str(logs)]
    line = error_line(train_in_process(argv))
    assert line.startswith(f"error: --log-dir {logs} already holds a run (metrics.jsonl): add")


def test_a_log_dir_is_refused_without_an_output_dir_and_cleared_only_on_overwrite(
    run, tmp_path, monkeypatch
):
    # Without --output-dir the run goes to a new runs/<timestamp>, but its logs to --log-dir.
    monkeypatch.chdir(tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    shutil.copy(run / "metrics.jsonl", logs / "metrics.jsonl")
    (logs / "notes.txt").write_text("mine")
    before = hashes(logs)
    line = error_line(train_in_process([*SMALL, "--max-steps", "1", "--log-dir", str(logs)]))
    assert line.startswith(f"error: --log-dir {logs} already holds a run (metrics.jsonl): add")
    assert hashes(logs) == before and not (tmp_path / "runs").exists()
    clear_run(resolve(["--log-dir", str(logs), "--overwrite"]))
    assert sorted(p.name for p in logs.iterdir()) == ["notes.txt"]


def test_a_log_dir_that_cannot_be_made_is_refused_before_the_run(tmp_path):
    file = tmp_path / "file"
    file.write_text("")
    argv = ["--output-dir", str(tmp_path / "run"), "--log-dir", str(file / "logs")]
    line = error_line(train_in_process(argv))
    assert line == (
        f"error: --log-dir {file / 'logs'}: {file} is a file, not a directory; give another "
        "--log-dir"
    )
    assert not (tmp_path / "run").exists()


def test_resume_may_lower_the_lr_and_says_the_steps_from_there_differ(run, caplog):
    # How a diverged run is retried from its last good checkpoint.
    argv = [*SMALL, "--output-dir", str(run), "--resume", "--max-steps", "4", "--lr", "0.005"]
    proc = train_in_process(argv)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        "--resume: --lr 0.01 -> 0.005: the steps from here on differ from the run's "
        "(the logged ones stay)" in proc.stderr
    )


def test_a_second_job_in_a_running_jobs_directory_is_refused(run):
    """Once two jobs in one directory both ran, the second's seed log rewrite sending the
    first's later steps to a deleted file: a checkpoint ahead of its log, never resumable."""
    argv = [*SMALL, "--max-steps", "6", "--output-dir", str(run), "--resume"]
    running = Trainer(resolve(argv), LaunchEnv())
    running.build()  # holds the directory until closed
    try:
        before = hashes(run)
        for extra in ([], ["--overwrite"]):
            flags = [a for a in argv if a != "--resume" or extra == []] + extra
            proc = train_in_process(flags)
            assert proc.returncode == 2, proc.stderr[-2000:]
            line = proc.stderr.strip().splitlines()[-1]  # after the lines of its build
            # the same process here: the holder is named as this process's Trainer
            assert line == (
                f"error: --output-dir {run}: another Trainer of this process holds it (built, "
                "not closed); call its close(), or give another --output-dir"
            )
            assert hashes(run) == before  # --overwrite deleted nothing of the running job's
        lock_file = run / ".distzo.lock"  # as another process's job writes it
        lock_file.write_text("pid 1 on elsewhere\n")
        proc = train_in_process(argv)
        assert proc.stderr.strip().splitlines()[-1] == (
            f"error: --output-dir {run}: another job is running in it (pid 1 on elsewhere); "
            "wait for it to end or stop it, or give another --output-dir"
        )
    finally:
        running.close()
    proc = train_in_process(argv)  # a closed trainer lets the next job in
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_running_jobs_directory_is_refused_before_the_checks_that_read_its_files(run):
    """A second job with neither flag was told to add --resume, and with --resume before
    the first job's first save, to use --resume auto: advice for a run at rest, where one
    runs. Both are told that the directory is in use, as training.md says."""
    shutil.rmtree(run / "checkpoints")  # the running job has not saved yet
    argv = [*SMALL, "--max-steps", "6", "--output-dir", str(run)]
    running = Trainer(resolve([*argv, "--resume", "auto"]), LaunchEnv())
    running.build()  # holds the directory until closed
    try:
        for extra in ([], ["--resume"]):
            proc = train_in_process([*argv, *extra])
            assert proc.returncode == 2, proc.stderr[-2000:]
            assert proc.stderr.strip().splitlines()[-1] == (
                f"error: --output-dir {run}: another Trainer of this process holds it (built, "
                "not closed); call its close(), or give another --output-dir"
            ), extra
    finally:
        running.close()
    assert not (run / ".distzo.lock").exists()  # the check took no lock and left no file


def test_a_failed_build_unlocks_the_directory_and_leaves_no_lock_file(tmp_path):
    out = tmp_path / "run"
    trainer = Trainer(resolve([*SMALL, "--batch-size", "100000000", "--output-dir", str(out)]))
    with pytest.raises(ValueError, match="the run does not fit"):
        trainer.build()
    assert not out.exists()
    out.mkdir()
    with pytest.raises(ValueError, match="the run does not fit"):
        Trainer(resolve([*SMALL, "--batch-size", "100000000", "--output-dir", str(out)])).build()
    assert out.is_dir() and not list(out.iterdir())  # the user's folder stays, empty
    proc = train_in_process([*SMALL, "--max-steps", "1", "--output-dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_resume_from_a_train_file_whose_rows_changed_is_refused(tmp_path):
    # A step's batch is drawn from the file's rows by index: the same path rewritten since
    # the run started gave the steps after the resume other rows than the run's, silently.
    corpus = tmp_path / "corpus.txt"
    rows = [f"row {i} of the corpus" for i in range(8)]
    corpus.write_text("".join(row + "\n" for row in rows))
    run = tmp_path / "run"
    argv = ["--task", "text", "--train-file", str(corpus), "--eval-file", str(corpus)]
    argv += ["--batch-size", "4", "--eval-batch-size", "4", "--log-every", "0"]
    argv += ["--max-steps", "1", "--output-dir", str(run)]
    assert train_in_process(argv).returncode == 0
    header = json.loads((run / "seedlog.jsonl").read_text().splitlines()[0])
    assert header["train_rows"] == rows_digest(rows)
    corpus.write_text("".join(row + "\n" for row in [*rows, "a row added since"]))
    line = error_line(train_in_process([*argv, "--resume"]))
    assert line == (
        f"error: --resume: --train-file {corpus} holds other rows than the run in {run} "
        f"trained on (rows digest {rows_digest([*rows, 'a row added since'])} of the task's "
        f"examples, its seed log's {rows_digest(rows)}); restore the file the run started "
        "with (or the distzo: another version may build the examples otherwise), or start "
        "afresh with --overwrite or another --output-dir"
    )
    corpus.write_text("".join(row + "\n" for row in rows))  # the run's own rows
    assert train_in_process([*argv, "--resume"]).returncode == 0


def test_a_resume_from_an_eval_file_whose_rows_changed_is_refused(tmp_path):
    # The evaluations after the resume scored another set than those before it, in one
    # curve, with no word: the digest was compared only where the path had changed.
    corpus, held_out = tmp_path / "corpus.txt", tmp_path / "held_out.txt"
    corpus.write_text("".join(f"row {i} of the corpus\n" for i in range(8)))
    evals = [f"held-out row {i}" for i in range(4)]
    held_out.write_text("".join(row + "\n" for row in evals))
    run = tmp_path / "run"
    argv = ["--task", "text", "--train-file", str(corpus), "--eval-file", str(held_out)]
    argv += ["--batch-size", "4", "--eval-batch-size", "4", "--log-every", "0"]
    argv += ["--max-steps", "1", "--output-dir", str(run)]
    assert train_in_process(argv).returncode == 0
    held_out.write_text("".join(row + "\n" for row in [*evals[:3], "another row"]))
    line = error_line(train_in_process([*argv, "--resume"]))
    assert line == (
        f"error: --resume: --eval-file {held_out} holds other rows than the run in {run} "
        f"evaluated (rows digest {rows_digest([*evals[:3], 'another row'])} of the task's "
        f"examples, its seed log's {rows_digest(evals)}); restore the file the run started "
        "with (or the distzo: another version may build the examples otherwise), or start "
        "afresh with --overwrite or another --output-dir"
    )
    held_out.write_text("".join(row + "\n" for row in evals))  # the run's own rows
    assert train_in_process([*argv, "--resume"]).returncode == 0


def test_a_seed_log_from_before_the_rows_digest_resumes(tmp_path):
    header = {"kind": "header", "run_seed": 0}  # no train_rows: nothing to compare
    (tmp_path / "seedlog.jsonl").write_text(json.dumps(header) + "\n")
    check_resumed_rows(tmp_path, LoadedRows("text", ["a b"], ["a b"]), "corpus.txt")


def test_a_log_dir_that_is_the_output_dir_names_each_file_once(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.toml", "metrics.jsonl", "eval.jsonl"):
        (run / name).write_text("")
    job = resolve(["--output-dir", str(run), "--log-dir", str(run / ".")])
    with pytest.raises(ValueError) as info:
        run_dir_module.check_fresh(job)
    assert "already holds a run (config.toml, eval.jsonl, metrics.jsonl): add" in str(info.value)


def test_a_filesystem_without_locks_runs_the_job_unlocked_and_says_so(
    tmp_path, monkeypatch, caplog
):
    """Some network mounts answer flock with ENOLCK: the job runs, warned that a second one
    would not be refused; any other error of the lock is raised."""
    import errno
    import fcntl

    from distzo.job.run_lock import RunLock

    def fails(code: int):
        def flock(handle, operation):
            raise OSError(code, os.strerror(code))

        return flock

    monkeypatch.setattr(fcntl, "flock", fails(errno.ENOLCK))
    lock = RunLock(tmp_path / "run")
    with caplog.at_level("WARNING", logger="distzo.train"):
        lock.acquire()
    assert not lock.held
    assert "cannot be locked (No locks available): a second job started in it" in caplog.text
    monkeypatch.setattr(fcntl, "flock", fails(errno.EIO))
    with pytest.raises(OSError, match="Input/output error"):
        RunLock(tmp_path / "run").acquire()


def test_a_lock_held_an_instant_is_waited_for_and_one_held_on_is_refused(tmp_path):
    """export-best takes its run directory again once the run let go of it: another job's
    start-up check (a shared lock, held an instant) at that moment refused the replay, and
    its export-best/ was never written. ``acquire(wait_s)`` asks again meanwhile."""
    import fcntl
    import threading

    from distzo.job.run_lock import LOCK_FILE, DirectoryLocked, RunLock

    run = tmp_path / "run"
    run.mkdir()
    checking = open(run / LOCK_FILE, "a+")  # check_not_running's shared lock
    fcntl.flock(checking, fcntl.LOCK_SH | fcntl.LOCK_NB)
    with pytest.raises(DirectoryLocked, match="another job is running in it") as refused:
        RunLock(run).acquire()
    assert refused.value.holder == "a process"  # its file names no job
    lock = RunLock(run)
    threading.Timer(0.05, checking.close).start()  # the check ends: its lock goes
    lock.acquire(wait_s=30)  # a bound far above the instant: no timing asserted
    assert lock.held
    with pytest.raises(DirectoryLocked):
        RunLock(run).acquire(wait_s=0.1)  # held on: refused once the wait is over
    lock.release()


def test_a_run_that_ended_in_the_directory_since_the_checks_is_refused_under_the_lock(
    tmp_path, monkeypatch
):
    """Two jobs started into one directory: the second's checks ran before the first wrote
    anything, and it takes the lock once the first has ended. Checked again under the
    lock, it is refused rather than starting afresh over the first one's run."""
    from distzo.job.run_lock import RunLock

    out = tmp_path / "run"
    acquire = RunLock.acquire

    def after_a_run_ended(self):
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text("the other job's\n")
        acquire(self)

    monkeypatch.setattr(RunLock, "acquire", after_a_run_ended)
    trainer = Trainer(resolve([*SMALL, "--max-steps", "1", "--output-dir", str(out)]))
    with pytest.raises(ValueError, match=r"already holds a run \(config.toml\)"):
        trainer.build()
    assert (out / "config.toml").read_text() == "the other job's\n"
    assert not (out / ".distzo.lock").exists()


def test_a_default_directory_a_failed_build_made_is_removed(tmp_path, monkeypatch):
    """Without --output-dir the run makes runs/<time>: a build that fails leaves no empty
    one behind (a folder the user has to clean up for each failed attempt)."""
    monkeypatch.chdir(tmp_path)
    trainer = Trainer(resolve([*SMALL, "--batch-size", "100000000"]))
    with pytest.raises(ValueError, match="the run does not fit"):
        trainer.build()
    assert not list((tmp_path / "runs").iterdir())


def whole_log_reads(monkeypatch, log: Path) -> list[str]:
    """Each read of the whole of ``log`` (a parse of every record), by what read it."""
    reads: list[str] = []
    for method in ("read_text", "read_bytes"):
        monkeypatch.setattr(Path, method, counted_reads(getattr(Path, method), log, reads))
    return reads


def counted_reads(read, log: Path, reads: list[str]):
    """``read`` (a ``Path`` method), its name added to ``reads`` for each read of ``log``."""

    def counting(path: Path, *args, **kwargs):
        if path == log:
            reads.append(read.__name__)
        return read(path, *args, **kwargs)

    return counting


@pytest.mark.parametrize("checkpoint", [True, False])
def test_only_rank_0_parses_the_whole_seed_log_of_a_resume(run, monkeypatch, checkpoint):
    """Every rank parsed every record of the log to validate a resume, once or (resuming
    from the log alone) three times: 4.4 s per parse and rank at a million steps. The
    others read its header and its end; rank 0's full check refuses for all of them, in one
    parse (``checked_log``) that the noise of a resume without a checkpoint reuses."""
    from distzo.job.validation import validate

    if not checkpoint:
        shutil.rmtree(run / "checkpoints")
    log = run / "seedlog.jsonl"
    reads = whole_log_reads(monkeypatch, log)
    for rank, parses in [(1, 0), (0, 1)]:
        reads.clear()
        job = resolve([*SMALL, "--max-steps", "6", "--output-dir", str(run), "--resume", "auto"])
        checked = validate(job, LaunchEnv(rank=rank, world_size=2, local_world_size=2))
        assert checked.job.run.resume == "yes"
        assert len(reads) == parses, (rank, reads)


def test_a_long_seed_log_ends_where_its_last_record_says(tmp_path):
    """The end read from a log's tail, across blocks: a torn last line and lines that are
    not step records skipped, as the whole read skips them."""
    from distzo.job import seed_log

    log = tmp_path / "seedlog.jsonl"
    header = json.dumps({"kind": "header", "first_step": 3})
    records = [json.dumps({"step": s, "projected_grads": [0.5], "lr": 0.1}) for s in range(3, 9000)]
    others = ["not json", "[1]", '{"step": null}', '{"step": "9001"}', ""]  # no step records
    log.write_text("\n".join([header, *records, *others]) + '{"step": 9000')
    assert (
        seed_log.last_logged_step(log)
        == 8999
        == run_dir_module.logged_steps_of(log.read_bytes())[-1][1]
    )
    log.write_text(header + "\n\xff\xfe binary\n")
    assert seed_log.last_logged_step(log) is None
    log.write_text('{"step": 4}')  # no complete line
    assert seed_log.last_logged_step(log) is None


@pytest.mark.parametrize("end", ["\n", "\r\n", "\r"])
@pytest.mark.parametrize("block", [1, 7, 64, 1 << 16])
def test_a_seed_logs_lines_read_backwards_are_its_lines_whatever_the_block(tmp_path, block, end):
    """The tail read joins a line that blocks split: each complete line once, last first,
    and a torn last line left out (a line cut at a block's edge read as two); its lines
    end as ``read_seed_log``'s do (universal newlines), a "\\r\\n" split by a block's edge
    too."""
    from distzo.job import seed_log

    log = tmp_path / "seedlog.jsonl"
    lines = [json.dumps({"kind": "header"}), *(json.dumps({"step": s}) for s in range(40))]
    log.write_bytes((end.join([*lines, ""]) + '{"step": 4').encode())
    with open(log, "rb") as stream, pytest.MonkeyPatch.context() as patch:
        patch.setattr(seed_log, "TAIL_BLOCK", block)
        size = log.stat().st_size
        read = [line.decode() for line in seed_log._complete_lines_backwards(stream, size)]
    assert read == lines[::-1]


def test_a_finished_run_resumed_keeps_its_final_checkpoint_and_export_as_they_are(run):
    # a requeued job that had finished rewrote its final checkpoint, then its export (each
    # all of a large model's weights) with the state it had just read from the checkpoint
    final, export = run / "checkpoints" / "step-4", run / "export"
    written = {p: p.stat().st_mtime_ns for d in (final, export) for p in d.iterdir()}
    proc = train_in_process([*SMALL, "--max-steps", "4", "--output-dir", str(run), "--resume"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        "no steps left: the run's checkpoint of step 4 and its export/ are kept as they are"
        in proc.stderr
    )
    assert "step-4 written" not in proc.stderr
    assert {p: p.stat().st_mtime_ns for d in (final, export) for p in d.iterdir()} == written
    assert f"model exported to {export}" in proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["export"] == str(export.absolute()) and summary["steps"] == 4


def test_a_finished_runs_export_cut_short_is_written_again_by_its_resume(run):
    # killed while publish() replaced export/: its weights deleted, its config not yet
    export = run / "export"
    whole = hashes(export)
    (export / "model.safetensors").unlink()
    proc = train_in_process([*SMALL, "--max-steps", "4", "--output-dir", str(run), "--resume"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no steps left: the run's checkpoint of step 4 is kept as it is" in proc.stderr
    assert hashes(export) == whole


def test_only_the_export_a_finished_runs_summary_records_whole_is_kept(run):
    options = {"export_shard_size": "5GB", "merge_adapter": False}
    assert kept_export(run, 4, options) == run / "export"
    assert kept_export(run, 5, options) is None  # another state's
    assert kept_export(run, 4, {**options, "export_shard_size": "1MB"}) is None  # resharded
    assert kept_export(run, 4, {**options, "merge_adapter": True}) is None
    summary = json.loads((run / "summary.json").read_text())
    listed = summary["export_written"]["files"]
    summary["export_written"]["files"] = {}  # a record that vouches for no file
    (run / "summary.json").write_text(json.dumps(summary))
    assert kept_export(run, 4, options) is None
    summary["export_written"]["files"] = listed
    (run / "summary.json").write_text(json.dumps(summary))
    assert kept_export(run, 4, options) == run / "export"
    (run / "export" / "config.json").write_text("{}")  # not the file the run wrote
    assert kept_export(run, 4, options) is None
    shutil.rmtree(run / "export")  # killed between publish()'s removal and its rename
    assert kept_export(run, 4, options) is None
    (run / "summary.json").write_text("[" * 100_000)  # damaged: written again, no traceback
    assert kept_export(run, 4, options) is None
