import re
import subprocess
import sys


def test_default_job_runs_and_the_loss_goes_down():
    # The README's main command, shortened; the full default (2000 steps) takes ~5 s.
    proc = subprocess.run(
        [sys.executable, "-m", "distzo.train", "--max-steps", "400", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    match = re.search(r"eval loss ([\d.]+) -> ([\d.]+) after 400 steps", proc.stderr)
    assert match, proc.stderr[-2000:]
    before, after = map(float, match.groups())
    assert after < before - 0.5, (before, after)


def test_help_documents_every_flag_with_its_default():
    out = subprocess.run([sys.executable, "-m", "distzo.train", "--help"], capture_output=True, text=True).stdout
    for flag in ["--max-steps", "--batch-size", "--lr", "--eps", "--mode", "--num-slots", "--device", "--seed"]:
        assert flag in out
    assert "(default: 2000)" in out
