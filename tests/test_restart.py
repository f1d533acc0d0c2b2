"""Restart with no lost step: a checkpoint plus the seed log's later steps, applied in one
pass over the blocks, is the uninterrupted trajectory bit for bit; the log survives a
crash mid-write; a log of another run is refused."""

import json
import signal
import subprocess
import sys

import pytest
import torch

from distzo.seed_log import SeedLogWriter, check_same_run, read_seed_log
from tests.conftest import random_batch
from tests.launch import Run, child_env, python_train, torchrun, train_in_process
from tests.test_peft import base_model, engine_for


def counted_uploads(engine):
    moved = {"upload": 0, "offload": 0}
    store = engine.streamed_store
    for name in moved:
        def counted(index, original=getattr(store, name), name=name):
            moved[name] += 1
            original(index)
        setattr(store, name, counted)
    return moved


@pytest.mark.parametrize("options", [
    dict(), dict(num_queries=2, optimizer="momentum", momentum_window=4), dict(optimizer="adam", lr=1e-3),
], ids=["sgd", "momentum", "adam"])
def test_catching_up_with_logged_steps_is_the_uninterrupted_trajectory_in_one_pass(options):
    def build():
        return engine_for(base_model("llama"), mode="offload", num_slots=2, **options)

    full = build()
    results = [full.step(random_batch(64, pad="left", seed=i)) for i in range(12)]
    expected = full.named_parameters()

    cut = build()
    for i in range(5):
        cut.step(random_batch(64, pad="left", seed=i))
    restarted = build()
    restarted.load_state_dict(cut.state_dict())  # the checkpoint at step 5
    moved = counted_uploads(restarted)
    restarted.catch_up([(r.step, r.projected_grads, r.lr) for r in results[5:9]])  # steps 5-8 from the log
    blocks = len(restarted.blocks)
    assert moved == {"upload": blocks, "offload": blocks}  # one pass for the four steps
    assert restarted.step_index == 9
    rest = [restarted.step(random_batch(64, pad="left", seed=i)) for i in range(9, 12)]
    assert [r.projected_grads for r in rest] == [r.projected_grads for r in results[9:]]
    values = restarted.named_parameters()
    assert all(torch.equal(values[n], expected[n]) for n in expected)


def test_catch_up_refuses_steps_that_do_not_follow():
    engine = engine_for(base_model("opt"))
    engine.step(random_batch(64, seed=0))
    with pytest.raises(ValueError, match="logged steps must run on from step 1 in order"):
        engine.catch_up([(2, (0.1,), 1e-2)])


def write_log(path, steps=3, **header):
    writer = SeedLogWriter(path, sync_every=2)
    writer.write({"kind": "header", "run_seed": 7, **header})
    for step in range(steps):
        writer.write({"step": step, "projected_grads": [0.5 * step], "lr": 1e-3})
    writer.close()


def test_a_torn_last_line_is_dropped_with_a_warning(tmp_path, caplog):
    path = tmp_path / "seedlog.jsonl"
    write_log(path)
    whole = path.read_text()
    path.write_text(whole[: len(whole) - 9])  # a crash mid-record: the last line cut short
    header, steps = read_seed_log(path)
    assert header["run_seed"] == 7 and [s["step"] for s in steps] == [0, 1]
    assert "dropped a torn last line (line 4, no newline)" in caplog.text
    path.write_text(whole.replace('"lr": 0.001}\n{"step": 2', '"lr": 0.001}\n{"step": 2, "proj\n{"step": 2'))
    with pytest.raises(ValueError, match="line 4: not JSON"):  # a broken line that is not the last is an error
        read_seed_log(path)


def test_a_log_of_another_run_is_refused_in_one_line(tmp_path):
    path = tmp_path / "seedlog.jsonl"
    write_log(path, optimizer={"name": "sgd"})
    header, _ = read_seed_log(path)
    check_same_run(path, header, {"run_seed": 7, "optimizer": {"name": "sgd"}})
    with pytest.raises(ValueError, match=r"is the log of another run \(run_seed 7, this run has 8\)") as info:
        check_same_run(path, header, {"run_seed": 8, "optimizer": {"name": "sgd"}})
    assert "\n" not in str(info.value)
    assert json.loads(path.read_text().splitlines()[0])["kind"] == "header"


def test_a_killed_rank_restarts_the_job_which_catches_up_from_the_seed_log(tmp_path):
    # Rank 2 of 4 dies (SIGKILL) at step 37 of 45; torchrun restarts the job, which loads
    # the step-20 checkpoint, applies steps 20-36 from the seed log in one pass and trains
    # on: its export is the uninterrupted run's bit for bit (sliced transfer, 2 queries).
    flags = ["--max-steps", "45", "--batch-size", "8", "--eval-batch-size", "8", "--log-every", "0", "--seed", "5",
             "--lr-schedule", "constant", "--save-steps", "20", "--transfer", "sliced", "--num-queries", "2"]
    full, killed = tmp_path / "full", tmp_path / "killed"
    proc = torchrun(4, flags + ["--output-dir", str(full)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = torchrun(4, flags + ["--output-dir", str(killed)], env={"DISTZO_KILL_AT": "2:37"}, max_restarts=1,
                    timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "killing rank 2 at step 37" in proc.stderr
    assert "caught up with steps 20-36 from the seed log in one pass; training from step 37" in proc.stderr
    assert Run(killed).grads == Run(full).grads  # metrics.jsonl holds every step once
    assert [json.loads(line)["step"] for line in (killed / "seedlog.jsonl").read_text().splitlines()[1:]] == list(range(45))
    assert all(torch.equal(Run(killed).params[k], v) for k, v in Run(full).params.items())


def test_a_torn_log_resumes_exactly_and_another_runs_log_is_refused(tmp_path):
    # A process killed at step 10 (checkpoint at 8) whose log's last record is torn: the
    # resumed run drops it, catches up with step 8, trains 9-11 and ends where an
    # uninterrupted run does; a log whose header is another run's is refused in one line.
    flags = ["--max-steps", "12", "--batch-size", "8", "--eval-batch-size", "8", "--log-every", "0", "--seed", "5",
             "--lr-schedule", "constant", "--save-steps", "4"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert python_train(flags + ["--output-dir", str(full)]).returncode == 0
    proc = subprocess.run([sys.executable, "-m", "distzo.train", *flags, "--output-dir", str(cut)], capture_output=True,
                          text=True, timeout=120, env=child_env({"DISTZO_KILL_AT": "0:10"}))
    assert proc.returncode == -signal.SIGKILL
    log = cut / "seedlog.jsonl"
    text = log.read_text()
    log.write_text(text[: len(text) - 20])  # step 9's record cut mid-line
    proc = python_train(flags + ["--output-dir", str(cut), "--resume"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "dropped a torn last line" in proc.stderr and "caught up with steps 8-8" in proc.stderr
    assert all(torch.equal(Run(cut).params[k], v) for k, v in Run(full).params.items())

    header, *steps = log.read_text().splitlines()
    log.write_text("\n".join([header.replace('"run_seed": 5', '"run_seed": 6'), *steps]) + "\n")
    proc = train_in_process(flags + ["--output-dir", str(cut), "--resume"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {log} is the log of another run (run_seed 6, this run has 5); resume with the options it was "
        "written with, or use a fresh --output-dir")
