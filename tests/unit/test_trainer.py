"""The Trainer in process: a few steps of the default tiny job, its state read back, and
a run stopped by a callback that a second Trainer resumes onto the uninterrupted run's
weights, bit for bit."""

from pathlib import Path

import pytest

from distzo.config.job import resolve
from distzo.job.trainer import Trainer, TrainerCallback

STEPS = 8


def job(out: Path, *flags: str):
    return resolve(
        ["--max-steps", str(STEPS), "--device", "cpu", "--log-every", "0"]
        + ["--output-dir", str(out), *flags]
    )


class StopAt(TrainerCallback):
    """Fails the run before ``step``, as a crash would; records the hook points it saw."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.seen: list[tuple[str, int]] = []

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        if step == self.step:
            raise RuntimeError(f"stopped at step {step}")
        self.seen.append(("start", step))

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict) -> None:
        self.seen.append(("end", step))

    def on_save(self, trainer: Trainer, step: int, asynchronous: bool) -> None:
        self.seen.append(("save", step))


def test_a_trainer_runs_in_process_and_resumes_onto_the_uninterrupted_weights(tmp_path):
    with Trainer(job(tmp_path / "full")) as full:
        after = full.train()
    assert full.step == full.engine.step_index == STEPS
    assert full.last_metrics is not None and full.last_metrics["step"] == STEPS - 1
    assert full.eval_after == after and full.eval_before is not None
    assert after["eval_loss"] < full.eval_before["eval_loss"]
    exported = (tmp_path / "full" / "export" / "model.safetensors").read_bytes()

    stopped = tmp_path / "stopped"
    callback = StopAt(6)
    first = Trainer(job(stopped, "--save-steps", "4", "--no-save-async"), callbacks=[callback])
    with first, pytest.raises(RuntimeError, match="stopped at step 6"):
        first.train()
    assert first.step == 6 and first.last_metrics["step"] == 5
    assert ("save", 4) in callback.seen and callback.seen[-1] == ("end", 5)
    assert (stopped / "checkpoints" / "step-4").is_dir()

    # The checkpoint of step 4, then steps 4-5 from the seed log, then steps 6-7 trained.
    second = Trainer(job(stopped, "--resume"))
    second.train()
    assert second.start_step == 6 and second.eval_before is None
    assert (stopped / "export" / "model.safetensors").read_bytes() == exported
