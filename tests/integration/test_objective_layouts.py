"""Every objective under every parallel layout follows the single process (fp64 masters),
launched through the CLI with torchrun + gloo, and records which objective it trained;
a masked LM's (RoBERTa's) prompt job too, on the 2D sliced mesh.

A data-parallel rank's loss is its examples' sum over the *global* example count, so
the ranks' values add up in the step's one all-reduce to the single process's mean.
"""

import json
import string

import pytest
import torch
from safetensors.torch import load_file

from distzo.replay import replay
from tests.helpers.launch import (
    Run,
    max_relative_difference,
    python_train,
    torchrun,
    train_in_process,
)
from tests.helpers.masked_prompts import save_tiny_roberta
from tests.helpers.rows import sst2_like, write_jsonl

ADAM = ["--optimizer", "adam", "--lr", "1e-3"]
# layout: (ranks, flags, the single-process run it must follow)
LAYOUTS = {
    "single": (1, [], None),
    "single_adam": (1, ADAM, None),
    "pertp": (2, ["--pert", "2"], "single"),
    # micro-batches give the whole batch's g
    "ddp": (2, ["--pert", "1", "--grad-accum", "2"], "single"),
    "2d_adam": (4, ["--dp", "2", "--pert", "2", "--grad-accum", "2", *ADAM], "single_adam"),
    # Adam's moments sliced over the node like the weights, all-gathered with them; a rank's
    # 4 rows run one a forward (--micro-batch-rows 1) while each block is gathered once
    "2d_sliced_adam": (
        4,
        ["--dp", "2", "--pert", "2", "--transfer", "sliced", "--micro-batch-rows", "1", *ADAM],
        "single_adam",
    ),
    "2d_sliced": (4, ["--dp", "2", "--pert", "2", "--transfer", "sliced"], "single"),
}
# objective: (task, extra flags, layouts besides single). A large eps makes the perturbed
# models' metrics differ, so the non-differentiable objectives move (g != 0).
OBJECTIVES = {
    # PertP: test_dist_launch
    "classification": ("sst2", ["--eps", "1e-3"], ["ddp", "2d_adam", "2d_sliced_adam"]),
    # scored like classification; f1 takes the 2D sliced layout
    "accuracy": ("sst2", ["--eps", "0.3"], []),
    "f1": ("squad", ["--eps", "0.3", "--max-new-tokens", "3"], ["2d_sliced"]),
}


def task_files(tmp_path, task):
    if task == "sst2":
        rows = sst2_like(16)
    else:
        # Every one-character word the byte tokenizer decodes to (punctuation normalises to
        # nothing, which SQuAD's F1 scores 0; bytes past ASCII decode to U+FFFD): a random
        # model's answer of a letter or digit among punctuation scores 1, others 0, and a
        # perturbation flips some of them.
        words = [c for c in map(chr, range(33, 127)) if c not in string.punctuation]
        rows = [
            {
                "title": "T",
                "context": f"Code {i}.",
                "question": "Which?",
                "answers": [*words, "\ufffd"],
            }
            for i in range(16)
        ]
    return write_jsonl(tmp_path / f"{task}.jsonl", rows)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for objective, (task, extra, layouts) in OBJECTIVES.items():
        data = task_files(tmp_path_factory.mktemp(f"{objective}-data"), task)
        baselines = sorted({LAYOUTS[layout][2] for layout in layouts}) or ["single"]
        for layout in [*baselines, *layouts]:
            nproc, flags, _ = LAYOUTS[layout]
            path = tmp_path_factory.mktemp(f"{objective}-{layout}")
            args = [
                "--task",
                task,
                "--train-file",
                data,
                "--eval-file",
                data,
                "--objective",
                objective,
                "--max-steps",
                "5",
                "--batch-size",
                "8",
                "--eval-batch-size",
                "8",
                "--log-every",
                "0",
                "--seed",
                "3",
                "--dtype",
                "fp64",
                "--output-dir",
                str(path),
                *extra,
                *flags,
            ]
            proc = python_train(args) if nproc == 1 else torchrun(nproc, args)
            assert proc.returncode == 0, proc.stderr[-3000:]
            out[objective, layout] = Run(path)
    return out


@pytest.mark.parametrize(
    "objective, layout",
    [(o, layout) for o, (_, _, layouts) in OBJECTIVES.items() for layout in layouts],
)
def test_every_objective_and_layout_follows_the_single_process(runs, objective, layout):
    single, other = runs[objective, LAYOUTS[layout][2]], runs[objective, layout]
    assert len(other.metrics) == 5
    assert [m["loss_plus"] for m in other.metrics] == pytest.approx(
        [m["loss_plus"] for m in single.metrics], rel=1e-9
    )
    g_diff, param_diff = max_relative_difference(other, single)
    assert g_diff <= 1e-9 and param_diff <= 1e-9, (g_diff, param_diff)


@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_each_objective_moves_the_model_and_is_recorded(runs, objective):
    run = runs[objective, "single"]
    assert any(g != 0 for g in run.grads), (
        "every step estimated g = 0: the comparison would be vacuous"
    )
    assert {m["objective"] for m in run.metrics} == {objective}
    header = json.loads((run.out / "seedlog.jsonl").read_text().splitlines()[0])
    assert header["objective"] == objective
    assert f'objective = "{objective}"' in (run.out / "config.toml").read_text()


def test_the_default_objective_is_mezos(tmp_path):
    data = task_files(tmp_path, "sst2")
    proc = python_train(
        [
            "--task",
            "sst2",
            "--train-file",
            data,
            "--eval-file",
            data,
            "--max-steps",
            "1",
            "--batch-size",
            "4",
            "--eval-batch-size",
            "4",
            "--output-dir",
            str(tmp_path / "run"),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'objective = "classification"' in (tmp_path / "run" / "config.toml").read_text()


NO_FILES = [
    "--train-file",
    "/no/such.jsonl",
    "--eval-file",
    "/no/such.jsonl",
]  # never read: the check comes first


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--task", "sst2", "--objective", "f1", *NO_FILES],
            "--objective f1 does not apply to --task sst2; choose one of lm (a causal LM's), "
            "classification, accuracy",
        ),
        (
            ["--task", "text", "--objective", "classification", *NO_FILES],
            "--objective classification does not apply to --task text; choose one of lm",
        ),
        (
            ["--task", "squad", "--objective", "accuracy", *NO_FILES],
            "--objective accuracy does not apply to --task squad; choose one of lm, f1",
        ),
        (
            ["--objective", "accuracy"],
            "--objective accuracy does not apply to --task counting; choose one of lm",
        ),
    ],
)
def test_an_objective_that_does_not_fit_the_task_is_one_line_before_any_file(args, message):
    proc = train_in_process(args)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {message}", proc.stderr


# MeZO's RoBERTa prompt on a tiny random RoBERTa (a masked LM: its candidates scored at the
# <mask>, its decoder tied to the word embeddings, its head dense + LayerNorm + decoder):
# one process, and dp 2 x pert 2 with the sliced transfer, which shards the blocks only.
MASKED_LAYOUTS = {"single": (1, []), "2d_sliced": LAYOUTS["2d_sliced"][:2]}


@pytest.fixture(scope="module")
def masked_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("masked")
    model = save_tiny_roberta(root / "model")
    data = write_jsonl(root / "sst2.jsonl", sst2_like(16))
    out = {}
    for layout, (nproc, flags) in MASKED_LAYOUTS.items():
        path = root / layout
        args = ["--model", str(model), "--task", "sst2", "--train-file", data]
        args += ["--eval-file", data, "--max-steps", "4", "--batch-size", "8"]
        args += ["--eval-batch-size", "8", "--log-every", "0", "--seed", "3", "--lr", "1e-3"]
        args += ["--dtype", "fp64", "--output-dir", str(path), *flags]
        proc = python_train(args) if nproc == 1 else torchrun(nproc, args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[layout] = Run(path)
    return out


def test_a_masked_lm_on_the_2d_sliced_mesh_follows_the_single_process(masked_runs, tmp_path):
    """The masked job's steps, its tied export, and the seed log's replay of the mesh's run
    (which refused a masked LM's engine the default objective)."""
    single, mesh = masked_runs["single"], masked_runs["2d_sliced"]
    assert {r["transfer"] for r in mesh.ranks.values()} == {"sliced"} and len(mesh.ranks) == 4
    assert all(g != 0 for g in single.grads)
    g_diff, param_diff = max_relative_difference(mesh, single)
    assert g_diff <= 1e-9 and param_diff <= 1e-9, (g_diff, param_diff)
    # the decoder stays the word embeddings: no key of its own in either export
    assert "lm_head.decoder.weight" not in mesh.params
    assert mesh.params.keys() == single.params.keys()
    replayed = replay(None, mesh.out / "seedlog.jsonl", tmp_path / "replayed")
    assert replayed is not None
    rebuilt = load_file(replayed / "model.safetensors")
    assert rebuilt.keys() == mesh.params.keys()
    assert all(torch.equal(rebuilt[k], v) for k, v in mesh.params.items())
