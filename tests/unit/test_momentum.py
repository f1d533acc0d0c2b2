"""ZO momentum regenerated from the gradient history (MeZO, appendix B.2): the engine's
trajectory follows a dense reference momentum, offload equals resident, and a resumed run
(state_dict or checkpoint) and a replay continue it exactly."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.engines import engine_for, reference_momentum, train
from tests.helpers.launch import RESUMABLE_RUN, python_replay, python_train
from tests.helpers.models import base_model, random_batch


@pytest.mark.parametrize("family, window", [("opt", 30), ("llama", 30), ("opt", 4)])
def test_momentum_follows_a_dense_reference(family, window):
    engine = engine_for(
        base_model(family, dtype=torch.float64),
        optimizer="momentum",
        beta1=0.9,
        momentum_window=window,
        num_queries=2,
        lr=1e-3,
        weight_decay=0.1,
    )
    initial = engine.named_parameters()
    results = train(engine, 64, steps=30)
    expected = reference_momentum(engine, initial, results, 0.9, window, 0.1)
    values = engine.named_parameters()
    moved = max((values[n] - initial[n]).abs().max().item() for n in expected)
    assert moved > 1e-3
    for name, value in expected.items():
        assert torch.allclose(
            values[name], value.to(values[name].dtype), rtol=1e-6, atol=1e-9 * moved
        ), name


def test_momentum_offload_equals_resident_and_a_state_dict_resumes_it():
    def momentum_engine(mode):
        return engine_for(
            base_model("llama"), mode=mode, num_slots=2, optimizer="momentum", momentum_window=3
        )

    runs = []
    for mode in ("resident", "offload"):
        engine = momentum_engine(mode)
        runs.append(
            ([r.projected_grads for r in train(engine, 64, steps=6)], engine.named_parameters())
        )
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][n], runs[1][1][n]) for n in runs[0][1])

    first = momentum_engine("offload")
    train(first, 64, steps=3)
    state = first.state_dict()
    assert [s for s, _ in state["recent_steps"]] == [2, 1, 0]
    resumed = momentum_engine("resident")
    resumed.load_state_dict(state)
    rest = [resumed.step(random_batch(64, pad="left", seed=i)) for i in range(3, 6)]
    assert [r.projected_grads for r in rest] == runs[0][0][3:]


def test_sgd_is_momentum_with_beta_zero_and_a_window_of_one():
    runs = [
        train(engine_for(base_model("opt"), **options), 64, steps=4)
        for options in (dict(), dict(optimizer="momentum", beta1=0.0, momentum_window=1))
    ]
    assert [r.projected_grads for r in runs[0]] == [r.projected_grads for r in runs[1]]


def test_bad_momentum_options_are_one_line_errors():
    from distzo import ZOConfig

    with pytest.raises(ValueError, match="momentum_window must be in \\[1, 256\\]"):
        ZOConfig(optimizer="momentum", momentum_window=0)
    with pytest.raises(ValueError, match="beta1 must be in \\[0, 1\\)"):
        ZOConfig(beta1=1.0)
    with pytest.raises(ValueError, match="optimizer 'adamw' is not one of sgd, momentum, adam"):
        ZOConfig(optimizer="adamw")


def test_a_momentum_run_resumes_from_its_checkpoint_and_replays_exactly(tmp_path):
    flags = [
        "--max-steps",
        "8",
        *RESUMABLE_RUN,
        "--eval-batch-size",
        "8",
        "--optimizer",
        "momentum",
        "--momentum-window",
        "3",
        "--lr",
        "1e-3",
    ]
    full, cut = tmp_path / "full", tmp_path / "cut"
    proc = python_train(flags + ["--save-steps", "4", "--output-dir", str(full)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    header = json.loads((full / "seedlog.jsonl").read_text().splitlines()[0])
    assert header["optimizer"] == {
        "name": "momentum",
        "beta1": 0.9,
        "momentum_window": 3,
        "beta2": 0.999,
        "adam_eps": 1e-8,
        "state": "recomputed",
        "state_dtype": "fp32",
    }

    shutil.copytree(full / "checkpoints" / "step-4", cut / "checkpoints" / "step-4")
    proc = python_train(flags + ["--output-dir", str(cut), "--resume"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    grads = [
        json.loads(line)["projected_grad"]
        for line in (full / "metrics.jsonl").read_text().splitlines()
    ]
    assert [
        json.loads(line)["projected_grad"]
        for line in (cut / "metrics.jsonl").read_text().splitlines()
    ] == grads[4:]
    exported = load_file(str(full / "export" / "model.safetensors"))
    resumed = load_file(str(cut / "export" / "model.safetensors"))
    assert all(torch.equal(exported[k], resumed[k]) for k in exported)

    out = tmp_path / "replayed"
    proc = python_replay(["--log", str(full / "seedlog.jsonl"), "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    replayed = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(exported[k], replayed[k]) for k in exported)
