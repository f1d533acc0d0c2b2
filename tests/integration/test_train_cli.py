import re
import subprocess
import sys
from pathlib import Path

import pytest

from distzo.config.checks import default_lr
from distzo.config.job import resolve


def test_default_job_runs_and_the_loss_goes_down(tmp_path):
    # The README's main command, shortened; the full default (2000 steps) takes ~30 s.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "distzo.train",
            "--max-steps",
            "400",
            "--device",
            "cpu",
            "--output-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    match = re.search(
        r"400 steps in .* eval loss ([\d.]+), accuracy [\d.]+ -> loss ([\d.]+)", proc.stderr
    )
    assert match, proc.stderr[-2000:]
    before, after = map(float, match.groups())
    assert after < before - 0.5, (before, after)
    assert (
        "lr = 0.01\n" in (tmp_path / "config.toml").read_text()
    )  # the default, resolved and recorded


@pytest.mark.parametrize(
    "argv, lr",
    [
        ([], 1e-2),
        (["--task", "text"], 1e-3),
        (["--task", "sst2"], 1e-3),
        (["--model", "facebook/opt-1.3b", "--task", "sst2"], 1e-6),  # a pretrained model: MeZO's lr
        (["--model-config", "opt-13b"], 1e-6),
        (["--model", "facebook/opt-1.3b", "--lr", "1e-7"], 1e-7),
    ],
)
def test_the_default_lr_follows_the_model(argv, lr):
    job = resolve(argv)
    assert (job.optim.lr if job.optim.lr is not None else default_lr(job)) == lr


@pytest.mark.parametrize("script", ["distzo-train", "distzo-replay"])
def test_the_installed_commands_run(script):
    # `pip install` puts them beside the interpreter; `torchrun ... $(which distzo-train)` works
    # too.
    path = Path(sys.executable).parent / script
    proc = subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith(f"usage: {script} "), proc.stdout[:200]


def test_help_documents_every_flag_with_its_default():
    out = subprocess.run(
        [sys.executable, "-m", "distzo.train", "--help"], capture_output=True, text=True
    ).stdout
    for flag in [
        "--max-steps",
        "--batch-size",
        "--lr",
        "--eps",
        "--mode",
        "--num-slots",
        "--device",
        "--seed",
    ]:
        assert flag in out
    assert "(default: 2000)" in out
