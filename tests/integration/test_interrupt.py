"""Ctrl-C (SIGINT) stops a run like a preemption notice: every rank after the same step, a
checkpoint with --save-on-signal, exit 130 and one line, and the resumed run ends where an
uninterrupted one does; a second Ctrl-C stops at once, in one line, not a traceback."""

import json
import subprocess
import sys

from tests.helpers.launch import FAULTY_TRAIN, RESUMABLE_RUN, child_env, run_python, torchrun

FLAGS = [
    "--max-steps",
    "12",
    *RESUMABLE_RUN,
    "--eval-batch-size",
    "8",
    "--save-steps",
    "4",
    "--no-save-async",
]
EXPORTED = "export/model.safetensors"


def test_ctrl_c_on_both_ranks_stops_after_the_same_step_and_the_run_resumes_exactly(tmp_path):
    # SIGINT reaches both ranks before step 5 (a terminal's Ctrl-C, which torchrun forwards
    # to every rank): both stop after it, write a checkpoint and exit 130; the resumed run's
    # export is the uninterrupted run's, byte for byte.
    flags = FLAGS + ["--dp", "2"]
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    assert torchrun(2, flags + ["--output-dir", str(full)]).returncode == 0
    proc = torchrun(
        2,
        flags + ["--output-dir", str(stopped), "--save-on-signal"],
        env={"DISTZO_SIGNAL_AT": "0:5:SIGINT,1:5:SIGINT"},
        preload=False,
    )
    assert proc.returncode != 0
    for rank in (0, 1):
        assert f"[rank{rank}] WARNING distzo.job.preemption: SIGINT received: stopping" in (
            proc.stderr
        )
    said = "distzo.train: interrupted: stopped after step 5 on SIGINT; 6 steps done"
    assert proc.stderr.count(said) == 1  # by rank 0; torchrun's summary shows it as the cause
    assert "traceback : interrupted: stopped after step 5 on SIGINT" in proc.stderr
    assert "KeyboardInterrupt" not in proc.stderr
    assert "exitcode  : 130" in proc.stderr
    assert [
        json.loads(line)["step"] for line in (stopped / "metrics.jsonl").read_text().splitlines()
    ] == list(range(6))
    assert sorted(p.name for p in (stopped / "checkpoints").iterdir()) == ["step-4", "step-6"]
    assert not (stopped / "export").exists()
    proc = torchrun(2, flags + ["--output-dir", str(stopped), "--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (stopped / EXPORTED).read_bytes() == (full / EXPORTED).read_bytes()


def test_a_second_ctrl_c_stops_at_once_in_one_line(tmp_path):
    # Two SIGINTs before step 3: the first asks for a stop after the step, the second ends
    # the run there, without the step or the signal's checkpoint.
    out = tmp_path / "run"
    command = [sys.executable, "-m", FAULTY_TRAIN, *FLAGS, "--save-steps", "2"]
    command += ["--save-on-signal", "--output-dir", str(out)]
    proc = run_python(command, child_env({"DISTZO_SIGNAL_AT": "0:3:SIGINT,0:3:SIGINT"}), 120)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "ERROR distzo.train: interrupted at once by SIGINT: nothing saved since the last "
            "checkpoint; --resume goes on from it and the seed log"
        )
    )
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]
    assert not (out / "export").exists()


def test_a_second_ctrl_c_on_one_of_two_ranks_ends_the_job_without_a_hang(tmp_path):
    # Rank 0 gets two SIGINTs before step 3 and leaves at once; rank 1, waiting for it in
    # step 3's all-reduce, fails as after any dead peer, and the job ends (torchrun's
    # timeout bounds it) with no checkpoint of a later step.
    out = tmp_path / "run"
    proc = torchrun(
        2,
        FLAGS + ["--dp", "2", "--save-on-signal", "--output-dir", str(out)],
        env={"DISTZO_SIGNAL_AT": "0:3:SIGINT,0:3:SIGINT,1:3:SIGINT"},
        timeout=120,
        preload=False,
    )
    assert proc.returncode != 0
    assert "[rank0] ERROR distzo.train: interrupted at once by SIGINT" in proc.stderr
    assert "exitcode: 130) local_rank: 0" in proc.stderr
    assert not (out / "checkpoints").exists() and not (out / "export").exists()


# The job of ``python -m distzo.train ARGS`` whose asynchronous save of step 2 takes a minute
# to write, with Ctrl-C pressed twice meanwhile: once as the save starts, once while the
# stopping run waits for it. It prints when it sent the second.
_CTRL_C_TWICE_IN_A_SAVE = """
import os, signal, sys, threading, time
from distzo.job import checkpoint
from distzo.job.trainer import TrainerCallback
from distzo.train import main

write_data = checkpoint.HostStateWriter.write_data
def slow(self, plan, planner):
    time.sleep(60)
    return write_data(self, plan, planner)
checkpoint.HostStateWriter.write_data = slow

def second():
    print("second Ctrl-C", time.monotonic(), flush=True)
    os.kill(os.getpid(), signal.SIGINT)

class CtrlCTwice(TrainerCallback):
    def on_save(self, trainer, step, asynchronous):
        signal.raise_signal(signal.SIGINT)
        threading.Timer(0.5, second).start()

sys.exit(main(sys.argv[1:], callbacks=[CtrlCTwice()]))
"""


def test_a_second_ctrl_c_while_a_save_is_written_ends_the_process_at_once(tmp_path):
    # The interpreter joined the writer's thread at exit: after the one line saying it
    # stopped at once, the process went on for as long as the write took.
    import time

    out = tmp_path / "run"
    flags = ["--max-steps", "6", "--save-steps", "2", "--log-every", "0", "--output-dir"]
    proc = subprocess.run(
        [sys.executable, "-c", _CTRL_C_TWICE_IN_A_SAVE, *flags, str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
    )
    ended = time.monotonic()
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "interrupted at once by SIGINT: "
            "nothing saved since the last checkpoint; --resume goes on from it and the seed log"
        )
    )
    sent = float(proc.stdout.split("second Ctrl-C ")[1].split()[0])
    assert ended - sent < 20, f"the process ended {ended - sent:.0f} s after the second Ctrl-C"
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-2.tmp"]  # never counts
