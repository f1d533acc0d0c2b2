"""Divergence: a run stops at its first non-finite loss or projected gradient, on every rank
at the same step, keeping nothing of that step (no checkpoint, export or seed-log record
after it), and exits 1 with a line naming the step, the values and what to try; the last
checkpoint loads and goes on as if the step had never been taken. ``--lr 0`` warns."""

import json
from pathlib import Path

from tests.helpers.launch import torchrun, train_in_process

# The default tiny job with these flags is finite for steps 0 and 1 and NaN at step 2; the
# step-2 checkpoint (written asynchronously) is the last good state.
DIVERGING = [
    "--lr",
    "1e3",
    "--lr-schedule",
    "constant",
    "--max-steps",
    "10",
    "--save-steps",
    "2",
    "--log-every",
    "0",
]


def logged_steps(out: Path, name: str) -> list[int]:
    lines = (out / name).read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if '"header"' not in line]


def assert_stopped_at_step_2(out: Path) -> None:
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]
    assert not (out / "export").exists()
    assert logged_steps(out, "seedlog.jsonl") == [0, 1]
    assert logged_steps(out, "metrics.jsonl") == [0, 1]


def test_a_nan_loss_stops_the_run_keeping_the_last_good_checkpoint(tmp_path):
    out, fresh = tmp_path / "diverged", tmp_path / "fresh"
    proc = train_in_process(DIVERGING + ["--output-dir", str(out)])
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "training diverged at step 2: loss nan" in last
    assert f"the run keeps {out / 'checkpoints' / 'step-2'} and the seed log up to step 1" in last
    assert "try a lower --lr (1000 in this run) or a larger --eps (0.001)" in last
    assert_stopped_at_step_2(out)
    # The checkpoint holds the state after the two good steps: resumed there, the run ends
    # where a run of two steps does, bit for bit.
    done = ["--max-steps", "2"]
    proc = train_in_process(DIVERGING + done + ["--output-dir", str(out), "--resume"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert train_in_process(DIVERGING + done + ["--output-dir", str(fresh)]).returncode == 0
    exported = "export/model.safetensors"
    assert (out / exported).read_bytes() == (fresh / exported).read_bytes()


def test_every_rank_stops_at_the_same_nan_step_and_exits_non_zero(tmp_path):
    out = tmp_path / "diverged"
    proc = torchrun(2, DIVERGING + ["--dp", "2", "--output-dir", str(out)])
    assert proc.returncode != 0
    # said once, by rank 0; each rank's error file carries it into torchrun's summary
    assert proc.stderr.count("ERROR distzo.train: training diverged at step 2: ") == 1
    assert "[rank0] ERROR distzo.train: training diverged at step 2: " in proc.stderr
    assert proc.stderr.count("traceback : training diverged at step 2: ") == 2
    assert "exitcode  : 1 " in proc.stderr
    assert "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr
    assert_stopped_at_step_2(out)
    # the checkpoint loads (on any number of ranks) and holds the state after two steps
    done = ["--max-steps", "2"]
    proc = train_in_process(DIVERGING + done + ["--output-dir", str(out), "--resume"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "export" / "model.safetensors").is_file()


def test_a_zero_learning_rate_warns_in_one_line(tmp_path):
    proc = train_in_process(["--lr", "0", "--max-steps", "2", "--output-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("nothing learns") == 1
    assert "WARNING distzo.train: --lr is 0: the parameters will not change" in proc.stderr
