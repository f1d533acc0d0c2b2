"""Divergence: a run stops at its first non-finite loss or projected gradient, on every rank
at the same step, and exits 1 with a line naming the step, the values, what is kept and
what to try. What is kept is the last good state: step N's loss is measured after step
N-1's update, so neither is kept (no checkpoint holding that update, no seed-log or metrics
record from step N-1 on), and ``--resume`` with a lower --lr trains on from there with
finite losses, exactly as a run that stopped there. ``--lr 0`` warns."""

import json
import math
import time
from pathlib import Path

from tests.helpers.launch import torchrun, train_in_process

# The default tiny job with these flags is finite for steps 0 and 1 (step 1's loss already
# ~7e6: step 0's update broke the weights, but not yet to inf) and NaN at step 2, after
# step 1's update. The last good state is after one step: the step-1 checkpoint (the step-2
# one, written asynchronously, carries step 1's update).
DIVERGING = [
    "--lr",
    "1e3",
    "--lr-schedule",
    "constant",
    "--max-steps",
    "10",
    "--save-steps",
    "1",
    "--log-every",
    "0",
]


def logged_steps(out: Path, name: str) -> list[int]:
    lines = (out / name).read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if '"header"' not in line]


def assert_kept_one_step(out: Path, checkpoints: list[str]) -> None:
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == checkpoints
    assert not (out / "export").exists()
    assert logged_steps(out, "seedlog.jsonl") == [0]
    assert logged_steps(out, "metrics.jsonl") == [0]
    assert logged_steps(out, "eval.jsonl") == [0]  # the evaluation before training


def assert_trains_on_with_finite_losses(out: Path, resume: str) -> None:
    proc = train_in_process(DIVERGING + ["--output-dir", str(out), resume, "--lr", "1e-3"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "at step 1" in proc.stderr  # resumed (or caught up) after the one step kept
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(10))
    assert all(math.isfinite(r["loss"]) for r in records)
    assert [r["lr"] for r in records[1:]] == [1e-3] * 9


def test_a_nan_loss_stops_the_run_keeping_the_state_before_the_update_that_broke_it(tmp_path):
    out, fresh = tmp_path / "diverged", tmp_path / "fresh"
    proc = train_in_process(DIVERGING + ["--output-dir", str(out)])
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"checkpoint {out / 'checkpoints' / 'step-2'} dropped: it holds the update" in (
        proc.stderr
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert "training diverged at step 2: loss nan" in last
    assert "neither this step nor step 1, whose update led to it, is kept" in last
    assert (
        f"the run keeps {out / 'checkpoints' / 'step-1'} and the seed log up to step 0: "
        "--resume goes on from step 1, with a lower --lr (1000 in this run) or a larger --eps "
        "(0.001)"
    ) in last
    assert_kept_one_step(out, ["step-1"])
    # What is kept is the state after one step, bit for bit: resumed there, the run ends
    # where a run of one step does.
    done = ["--max-steps", "1"]
    proc = train_in_process(DIVERGING + done + ["--output-dir", str(out), "--resume"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert train_in_process(DIVERGING + done + ["--output-dir", str(fresh)]).returncode == 0
    exported = "export/model.safetensors"
    assert (out / exported).read_bytes() == (fresh / exported).read_bytes()
    # And with a lower lr it trains on from there: no NaN at once, as from step 2's state.
    assert_trains_on_with_finite_losses(out, "--resume")


def test_a_last_update_that_breaks_the_weights_is_caught_by_the_final_evaluation(tmp_path):
    # Two steps: step 1's update, the last, breaks the weights and no step 2 measures it.
    # The final evaluation does: its loss is NaN. The final checkpoint (step-2, holding
    # that update) is dropped, nothing is exported and the run exits 1.
    out = tmp_path / "diverged"
    proc = train_in_process(DIVERGING + ["--max-steps", "2", "--output-dir", str(out)])
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"checkpoint {out / 'checkpoints' / 'step-2'} dropped" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        "training diverged at step 2: the evaluation of the weights after 2 steps gives loss "
        "nan, accuracy nan; step 1's update, which led to it, is not kept; the run keeps "
        f"{out / 'checkpoints' / 'step-1'} and the seed log up to step 0: --resume goes on "
        "from step 1, with a lower --lr"
    ) in last
    assert_kept_one_step(out, ["step-1"])
    assert_trains_on_with_finite_losses(out, "--resume")


def test_with_no_checkpoint_kept_the_seed_log_alone_goes_on(tmp_path):
    # Saving every 2 steps, the only checkpoint (step-2, complete: written synchronously)
    # holds step 1's update: deleted.
    out = tmp_path / "diverged"
    saves = ["--save-steps", "2", "--no-save-async"]
    proc = train_in_process(DIVERGING + saves + ["--output-dir", str(out)])
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"checkpoint {out / 'checkpoints' / 'step-2'} dropped" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        "the run keeps the seed log up to step 0 and no checkpoint: --resume auto catches up "
        "with it from the initial weights and goes on from step 1, with a lower --lr"
    ) in last
    assert_kept_one_step(out, [])
    assert_trains_on_with_finite_losses(out, "--resume=auto")


def test_keeping_one_checkpoint_still_keeps_the_one_before_a_save_that_diverged(tmp_path):
    # --keep-checkpoints 1 counts only checkpoints whose last update a finite loss measured:
    # step-1 stays beside step-2 until step 2's loss is known, which is NaN, so step-2 is
    # dropped and step-1 is what the run keeps (step-1 used to be deleted when step-2 was
    # written, and a resume had to catch up from the initial weights).
    out = tmp_path / "diverged"
    keep_one = ["--keep-checkpoints", "1", "--no-save-async"]
    proc = train_in_process(DIVERGING + keep_one + ["--output-dir", str(out)])
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert (
        f"the run keeps {out / 'checkpoints' / 'step-1'} and the seed log up to step 0"
        in (proc.stderr.strip().splitlines()[-1])
    )
    assert_kept_one_step(out, ["step-1"])
    # a run that does not diverge still ends with one checkpoint
    fine = tmp_path / "fine"
    proc = train_in_process(
        DIVERGING + keep_one + ["--lr", "1e-3", "--max-steps", "3", "--output-dir", str(fine)]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [p.name for p in (fine / "checkpoints").iterdir()] == ["step-3"]


def test_a_save_of_the_steps_kept_still_in_flight_is_completed_not_dropped(tmp_path, monkeypatch):
    # A warm-up step 0 moves nothing, so the run diverges at step 3 and keeps 2 steps: the
    # step-2 save, still being written (slowed here, as on a busy disk) when step 3's NaN
    # is measured, holds no bad update and is completed, not dropped with the bad ones.
    from distzo.job.checkpoint import HostStateWriter

    write_data = HostStateWriter.write_data

    def slowly(self, plan, planner):
        time.sleep(1.0)
        return write_data(self, plan, planner)

    monkeypatch.setattr(HostStateWriter, "write_data", slowly)
    out = tmp_path / "diverged"
    later = ["--warmup-steps", "1", "--save-steps", "2", "--output-dir", str(out)]
    proc = train_in_process(DIVERGING + later)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "dropped" not in proc.stderr
    assert (
        f"the run keeps {out / 'checkpoints' / 'step-2'} and the seed log up to step 1"
        in (proc.stderr.strip().splitlines()[-1])
    )
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]


def test_every_rank_stops_at_the_same_nan_step_and_exits_non_zero(tmp_path):
    out = tmp_path / "diverged"
    proc = torchrun(2, DIVERGING + ["--dp", "2", "--output-dir", str(out)], preload=False)
    assert proc.returncode != 0
    # said once, by rank 0; each rank's error file carries it into torchrun's summary
    assert proc.stderr.count("ERROR distzo.train: training diverged at step 2: ") == 1
    assert "[rank0] ERROR distzo.train: training diverged at step 2: " in proc.stderr
    assert proc.stderr.count("traceback : training diverged at step 2: ") == 2
    assert "exitcode  : 1 " in proc.stderr
    assert "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr
    (said,) = [line for line in proc.stderr.splitlines() if "[rank0] ERROR" in line]
    assert f"the run keeps {out / 'checkpoints' / 'step-1'} and the seed log up to step 0" in said
    assert_kept_one_step(out, ["step-1"])
    # the checkpoint loads (on any number of ranks) and trains on with a lower lr
    assert_trains_on_with_finite_losses(out, "--resume")


def test_a_zero_learning_rate_warns_in_one_line(tmp_path):
    proc = train_in_process(["--lr", "0", "--max-steps", "2", "--output-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("nothing learns") == 1
    assert "WARNING distzo.train: --lr is 0: the parameters will not change" in proc.stderr


def test_an_eps_below_the_weights_resolution_warns_in_one_line(tmp_path):
    # fp32 weights: theta + 1e-12 z is theta, so every g is 0
    proc = train_in_process(["--eps", "1e-12", "--max-steps", "1", "--output-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("WARNING distzo.train: --eps 1e-12 is below half a unit") == 1
    assert "of a weight of 0.05 in float32 (3e-09)" in proc.stderr
