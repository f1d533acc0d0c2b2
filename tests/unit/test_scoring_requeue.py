"""A requeue of a finished scoring run (--max-steps 0): the same command with --resume (a
script that always passes it) or --resume auto reports the recorded evaluation, exits 0
and touches nothing, without scoring again; it scores again where the record is cut
short or the command evaluates otherwise, and a command that trains is refused as
before."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

from distzo.config.job import resolve
from distzo.dist import LaunchEnv, launch_gate
from distzo.job import trainer as trainer_module
from distzo.job.run_logs import read_records
from distzo.job.trainer import Trainer
from distzo.job.validation import validate
from tests.helpers.launch import train_in_process
from tests.helpers.run_copies import copied_run

SCORING = ["--max-steps", "0", "--device", "cpu", "--eval-batch-size", "8"]


def contents(directory: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``directory``: its sha256 and its modification time."""
    return {
        str(p.relative_to(directory)): (
            hashlib.sha256(p.read_bytes()).hexdigest(),
            p.stat().st_mtime_ns,
        )
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def scored(tmp_path_factory) -> Path:
    """A finished scoring run (in process: no interpreter's imports)."""
    run = tmp_path_factory.mktemp("scored") / "run"
    with Trainer(resolve([*SCORING, "--output-dir", str(run)])) as trainer:
        trainer.train()
    return run


@pytest.fixture
def run(scored, tmp_path) -> Path:
    """A copy of the finished scoring run that a test may change."""
    return copied_run(scored, tmp_path / "run")


@pytest.fixture
def scorings(monkeypatch) -> list[str]:
    """The evaluations run from here on (their splits)."""
    calls: list[str] = []
    evaluate = trainer_module.evaluate

    def counted(*args, **kwargs):
        calls.append(kwargs.get("split", "eval"))
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "evaluate", counted)
    return calls


@pytest.mark.parametrize("resume", ["yes", "auto"])
def test_a_requeue_of_a_finished_scoring_run_reports_its_record_touching_nothing(
    run, scorings, resume
):
    before = contents(run)
    (recorded,) = read_records(run / "eval.jsonl")
    proc = train_in_process([*SCORING, "--output-dir", str(run), "--resume", resume])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert scorings == [] and contents(run) == before
    done = proc.stderr.strip().splitlines()[-1]
    assert "done: scored without training (--max-steps 0): eval loss " in done
    assert f"loss {recorded['eval_loss']:.4f}" in done
    assert f"as the run in {run} recorded it (a requeue of a finished run" in done


def test_a_requeue_whose_record_is_cut_short_scores_again(run, scorings):
    (run / "eval.jsonl").write_text("")  # a file cut short by hand: the record is gone
    proc = train_in_process([*SCORING, "--output-dir", str(run), "--resume"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert scorings == ["eval"]
    assert "its eval.jsonl does not record what this command evaluates" in proc.stderr
    assert [r["step"] for r in read_records(run / "eval.jsonl")] == [0]
    assert json.loads((run / "summary.json").read_text())["steps"] == 0


def test_a_requeue_that_decodes_otherwise_scores_again(tmp_path, scorings):
    """A generation task's score is the eval's whole cost, and --max-new-tokens (which a
    resume may change) changes it: the record stands for the same budget only."""
    row = {"title": "T", "context": "The code is 4.", "question": "Code?", "answers": ["4"]}
    rows = tmp_path / "squad.jsonl"
    rows.write_text((json.dumps(row) + "\n") * 4)
    out = tmp_path / "run"
    squad = [*SCORING, "--task", "squad", "--train-file", str(rows), "--eval-file", str(rows)]
    squad += ["--output-dir", str(out), "--max-new-tokens"]
    assert train_in_process([*squad, "3"]).returncode == 0
    assert scorings == ["eval"]
    proc = train_in_process([*squad, "5", "--resume"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert scorings == ["eval", "eval"]
    assert "scoring again; its old run's files go, as with --overwrite" in proc.stderr
    assert "max_new_tokens = 5\n" in (out / "config.toml").read_text()
    assert [r["step"] for r in read_records(out / "eval.jsonl")] == [0]


def test_a_scoring_run_that_died_before_its_summary_is_no_finished_run(run):
    (run / "summary.json").unlink()
    proc = train_in_process([*SCORING, "--output-dir", str(run), "--resume"])
    assert proc.returncode == 2
    assert "no checkpoint" in proc.stderr and "--overwrite instead" in proc.stderr


def test_training_on_from_a_finished_scoring_run_is_refused_as_before(run):
    proc = train_in_process([*SCORING, "--output-dir", str(run), "--resume", "--max-steps", "2"])
    assert proc.returncode == 2
    assert "no logged step to go on from; --overwrite instead" in proc.stderr


def test_every_rank_takes_rank_0s_record_from_a_log_dir_on_its_node_alone(run, monkeypatch):
    """Only rank 0 writes the logs: a --log-dir on its node's disk holds eval.jsonl there
    alone. A rank reading its own node's (none: score again) built a run that rank 0,
    which reported the record and exited, never joined: a wait to --dist-timeout."""
    store = dist.HashStore()  # the launcher's store every rank reaches
    monkeypatch.setattr(launch_gate, "rendezvous_store", lambda env, timeout: store)
    logs = run.parent / "node0-logs"
    logs.mkdir()
    for name in ("eval.jsonl", "metrics.jsonl"):
        (run / name).rename(logs / name)
    (recorded,) = read_records(logs / "eval.jsonl")
    flags = [*SCORING, "--output-dir", str(run), "--log-dir", str(logs), "--resume"]
    checked = {}
    for rank in (0, 1):
        if rank == 1:
            shutil.rmtree(logs)  # rank 1's node has no such folder
        env = LaunchEnv(rank=rank, world_size=2, node_rank=rank, launched=True)
        checked[rank] = validate(resolve(flags), env)
    expected = {"eval": {k: v for k, v in recorded.items() if k != "step"}}
    assert checked[0].recorded_score == checked[1].recorded_score == expected
    assert checked[1].job.run.resume == "yes" and not checked[1].job.run.overwrite


def test_a_requeue_built_from_python_keeps_the_record_it_reports(run, scorings):
    """Trainer.build() before train(), as a script inspecting the run does: the build of a
    resume of no steps opened the logs afresh, emptying the eval.jsonl it then reported."""
    before = contents(run)
    (recorded,) = read_records(run / "eval.jsonl")
    with Trainer(resolve([*SCORING, "--output-dir", str(run), "--resume"])) as trainer:
        trainer.build()
        assert trainer.train() == {k: v for k, v in recorded.items() if k != "step"}
    assert scorings == [] and contents(run) == before


def test_the_record_stands_for_a_finished_scoring_run_with_every_split_its_summary_names(
    tmp_path,
):
    """A summary of 0 steps stands for a finished scoring run, and its record holds where
    eval.jsonl has the step-0 evaluation of each split the summary names (dev too, with
    --num-dev); a run that trained (its seed log gone) is no scoring run."""
    from distzo.job.scoring_requeue import recorded_score

    job = resolve([*SCORING, "--output-dir", str(tmp_path)])
    dev, scored = {"step": 0, "dev_loss": 2.5}, {"step": 0, "eval_loss": 3.5}
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 0, "dev": {"best": None}}))
    (tmp_path / "eval.jsonl").write_text(json.dumps(scored) + "\n")
    assert recorded_score(job, True) is None  # its dev record is gone: scored again
    (tmp_path / "eval.jsonl").write_text(f"{json.dumps(dev)}\n{json.dumps(scored)}\n")
    assert recorded_score(job, True) == {"dev": {"dev_loss": 2.5}, "eval": {"eval_loss": 3.5}}
    assert recorded_score(job, False) is None  # the command evaluates otherwise
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 4, "dev": {"best": None}}))
    assert recorded_score(job, True) is None  # a run that trained
