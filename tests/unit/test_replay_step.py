"""``distzo.replay --step N``: the model after the first N steps of a run's seed log, the
step a dev set chose, rather than only its end."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distzo.config.job import resolve
from distzo.job.trainer import Trainer
from distzo.replay import main, replay


def _run(out: Path, steps: int) -> Path:
    flags = ["--max-steps", str(steps), "--lr-schedule", "constant", "--device", "cpu"]
    with Trainer(resolve(flags + ["--log-every", "0", "--output-dir", str(out)])) as trainer:
        trainer.train()
    return out


def test_a_replay_to_step_n_is_the_export_of_a_run_of_n_steps_bit_for_bit(tmp_path, capsys):
    longer, shorter = _run(tmp_path / "six", 6), _run(tmp_path / "three", 3)
    replayed = replay(None, longer / "seedlog.jsonl", tmp_path / "at3", step=3)
    assert replayed is not None
    ours, theirs = (load_file(d / "model.safetensors") for d in (replayed, shorter / "export"))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    ended = load_file(longer / "export" / "model.safetensors")
    assert not all(torch.equal(ours[name], ended[name]) for name in ours)  # not the end's
    # a step the log has not reached: one line, and no --out written
    argv = ["--log", str(longer / "seedlog.jsonl"), "--out", str(tmp_path / "at7")]
    assert main(argv + ["--step", "7"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.endswith(
        f"--step 7: --log {longer / 'seedlog.jsonl'} holds 6 steps; give --step 0 to 6 "
        "(0: the base, 6: the run's end)"
    )
    assert not (tmp_path / "at7").exists()


def test_step_0_is_the_base_and_the_logs_length_its_end():
    from distzo.replay import steps_up_to

    logged = [{"step": i} for i in range(6)]
    assert steps_up_to(Path("seedlog.jsonl"), logged, 0) == []
    assert steps_up_to(Path("seedlog.jsonl"), logged, 6) == logged
    assert steps_up_to(Path("seedlog.jsonl"), logged, None) == logged


@pytest.mark.parametrize("step", [-1, 7])
def test_a_step_outside_the_log_is_refused_before_any_model_is_built(tmp_path, step, monkeypatch):
    import distzo.replay as module

    log = _run(tmp_path / "run", 6) / "seedlog.jsonl"
    monkeypatch.setattr(module, "base_model", lambda *a: pytest.fail("a model was built"))
    with pytest.raises(ValueError, match=f"^--step {step}: --log .* holds 6 steps"):
        replay(None, log, tmp_path / "out", step=step)
