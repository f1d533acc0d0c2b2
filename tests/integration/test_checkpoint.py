"""Resume, crash during an asynchronous save, export and replay, through the real CLI."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from distzo import ZOConfig, ZOEngine
from distzo.data import CountingTask
from distzo.export.hf_model import export_hf
from distzo.job.checkpoint import latest_checkpoint
from tests.helpers.launch import (
    RESUMABLE_RUN,
    Run,
    checkpoint_writers,
    child_env,
    free_port,
    main_in_process,
    python_replay,
    python_train,
    run_python,
    torchrun,
    torchrun_command,
)
from tests.helpers.models import random_batch, tiny_opt

# A constant lr: the schedule then does not depend on where a run was cut. fp64 masters:
# resuming on another world size changes how the batch is split, and g magnifies the
# fp32 reassociation of the loss sums by 1/(2 eps) (see test_dist_launch).
COMMON = [
    "--max-steps",
    "10",
    *RESUMABLE_RUN,
]
# ``distzo.train`` with one rank's listing of the checkpoints late (``DISTZO_LAG``).
LAGGING_TRAIN = "tests.helpers.lagging_train"


def launch(nproc, args, env=None):
    proc = python_train(args) if nproc == 1 else torchrun(nproc, args, env=env)
    return proc


def assert_same_params(a: Run, b: Run, rel: float = 0.0):
    for name, value in b.params.items():
        diff = ((a.params[name] - value).norm() / value.norm()).item()
        assert diff <= rel, (name, diff)


def test_resume_is_exact_and_independent_of_world_size(tmp_path):
    # Adam: its moments are in the checkpoint beside the weights and reshard with them.
    flags = COMMON + ["--dtype", "fp64", "--optimizer", "adam", "--lr", "1e-3"]
    full = tmp_path / "full"
    proc = launch(4, flags + ["--save-steps", "5", "--output-dir", str(full)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert latest_checkpoint(full / "checkpoints").name == "step-10"
    files = checkpoint_writers(full / "checkpoints" / "step-5")
    assert {k for k in files if k.startswith("exp_avg_sq/")} == {
        "exp_avg_sq/resident",
        "exp_avg_sq/block/0",
        "exp_avg_sq/block/1",
    }
    reference = Run(full)
    for nproc in (4, 2, 1):
        resumed = tmp_path / f"resumed{nproc}"
        (resumed / "checkpoints").mkdir(parents=True)
        shutil.copytree(full / "checkpoints" / "step-5", resumed / "checkpoints" / "step-5")
        proc = launch(nproc, flags + ["--output-dir", str(resumed), "--resume"])
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert Run(resumed).grads == pytest.approx(reference.grads[5:], rel=1e-9)
        assert_same_params(Run(resumed), reference, rel=1e-9)
    # The seed log replays the Adam run (its moments rebuilt from the log's g) to the export.
    out = tmp_path / "replayed"
    proc = python_replay(["--log", str(full / "seedlog.jsonl"), "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    exported, replayed = (
        load_file(str(full / "export" / "model.safetensors")),
        load_file(str(out / "model.safetensors")),
    )
    assert all(torch.allclose(exported[k], replayed[k], rtol=1e-12, atol=0) for k in exported)
    # Resuming with another optimizer is refused in one line: by the checkpoint itself when
    # the directory holds no config.toml to compare the options with.
    other = tmp_path / "other"
    shutil.copytree(full / "checkpoints" / "step-5", other / "checkpoints" / "step-5")
    proc = launch(1, COMMON + ["--dtype", "fp64", "--output-dir", str(other), "--resume"])
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "was trained with --optimizer adam, this run has --optimizer sgd; resume with the "
            "optimizer it was trained with"
        )
    )


def test_fzoo_resumes_exactly_on_other_world_sizes_and_replays_to_its_export(tmp_path):
    # The checkpoint holds FZOO's pending coefficients c_j = N g_j, the seed log every
    # step's: a resume on 2 or 1 ranks goes on along the 4-rank trajectory, and a replay
    # of the log rebuilds the export bit for bit.
    flags = COMMON + ["--dtype", "fp64", "--estimator", "fzoo", "--num-queries", "3"]
    full = tmp_path / "full"
    proc = launch(4, flags + ["--save-steps", "5", "--output-dir", str(full)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    reference = Run(full)
    header = json.loads((full / "seedlog.jsonl").read_text().splitlines()[0])
    assert (header["estimator"], header["noise"]) == ("fzoo", "rademacher-v1")
    for nproc in (2, 1):
        resumed = tmp_path / f"resumed{nproc}"
        (resumed / "checkpoints").mkdir(parents=True)
        shutil.copytree(full / "checkpoints" / "step-5", resumed / "checkpoints" / "step-5")
        proc = launch(nproc, flags + ["--output-dir", str(resumed), "--resume"])
        assert proc.returncode == 0, proc.stderr[-2000:]
        for ours, theirs in zip(Run(resumed).metrics, reference.metrics[5:], strict=True):
            assert ours["projected_grads"] == pytest.approx(theirs["projected_grads"], rel=1e-9)
        assert_same_params(Run(resumed), reference, rel=1e-9)
    out = tmp_path / "replayed"
    proc = python_replay(["--log", str(full / "seedlog.jsonl"), "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    exported = load_file(str(full / "export" / "model.safetensors"))
    replayed = load_file(str(out / "model.safetensors"))
    assert exported.keys() == replayed.keys()
    assert all(torch.equal(exported[k], replayed[k]) for k in exported)
    # resuming it as an SPSA run is refused in one line, before any model
    proc = launch(1, COMMON + ["--dtype", "fp64", "--output-dir", str(full), "--resume"])
    assert proc.returncode == 2
    assert "--estimator fzoo -> spsa" in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]


def test_each_block_is_written_once_by_one_rank_and_a_sliced_checkpoint_reshards(tmp_path):
    # Five blocks over 4 ranks of one node (one shard group of 4): each block is gathered
    # and written by member i % 4 alone; resuming on 1 (naive) or 2 (sliced) ranks
    # continues the trajectory of the uninterrupted 4-rank run. A stored momentum's buffers
    # are sliced like the weights and gathered, written and resharded alike.
    tiny_opt(seed=4, num_hidden_layers=5).save_pretrained(tmp_path / "model")
    base = COMMON + [
        "--model",
        str(tmp_path / "model"),
        "--dtype",
        "fp64",
        "--lr",
        "1e-3",
        "--optimizer",
        "momentum",
        "--optimizer-state",
        "stored",
    ]
    flags = base + ["--dp", "2", "--pert", "2"]
    full = tmp_path / "full"
    proc = launch(
        4, flags + ["--transfer", "sliced", "--save-steps", "5", "--output-dir", str(full)]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    files = checkpoint_writers(full / "checkpoints" / "step-5")
    assert {k: v for k, v in files.items() if k.startswith("block/")} == {
        f"block/{i}": i % 4 for i in range(5)
    }
    assert {k: v for k, v in files.items() if k.startswith("momentum_buffer/block/")} == {
        f"momentum_buffer/block/{i}": i % 4 for i in range(5)
    }
    assert files["resident"] == files["momentum_buffer/resident"] == 0
    reference = Run(full)
    for nproc, extra in ((1, []), (2, ["--transfer", "sliced"])):
        resumed = tmp_path / f"resumed{nproc}"
        (resumed / "checkpoints").mkdir(parents=True)
        shutil.copytree(full / "checkpoints" / "step-5", resumed / "checkpoints" / "step-5")
        proc = launch(nproc, base + extra + ["--output-dir", str(resumed), "--resume"])
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert_same_params(Run(resumed), reference, rel=1e-6)
    # Naive: block i from rank i % world, read from the host copy with no device transfer.
    naive = tmp_path / "naive"
    assert launch(4, flags + ["--max-steps", "2", "--output-dir", str(naive)]).returncode == 0
    files = checkpoint_writers(naive / "checkpoints" / "step-2")
    assert {k: v for k, v in files.items() if k.startswith("block/")} == {
        f"block/{i}": i % 4 for i in range(5)
    }


def test_a_crash_during_an_asynchronous_save_leaves_the_previous_checkpoint(tmp_path):
    # The crashed run is 2 PertP ranks, which follow the single process bit for bit in
    # fp32; its checkpoint resumes in one process and ends on the uninterrupted one's weights.
    args = COMMON + ["--max-steps", "20", "--save-steps", "5", "--output-dir", str(tmp_path)]
    crashed = launch(2, args + ["--pert", "2"], env={"DISTZO_CRASH_IN_SAVE": "10"})
    assert crashed.returncode != 0
    checkpoints = tmp_path / "checkpoints"
    assert latest_checkpoint(checkpoints).name == "step-5"
    assert not (checkpoints / "step-10").exists()
    resumed = launch(1, args + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "step-5 at step 5" in resumed.stderr
    uninterrupted = tmp_path.parent / (tmp_path.name + "-full")
    assert (
        launch(1, COMMON + ["--max-steps", "20", "--output-dir", str(uninterrupted)]).returncode
        == 0
    )
    assert Run(tmp_path).grads == Run(uninterrupted).grads
    assert_same_params(Run(tmp_path), Run(uninterrupted))


def test_every_rank_resumes_from_rank_0s_checkpoint_where_a_node_lists_late(tmp_path):
    # A shared file system that shows rank 1's node the step-8 checkpoint late: each rank
    # listing its own, rank 0 loaded step 8 and rank 1 step 4, their collectives paired up
    # wrongly, and rank 0 published a step-12 checkpoint without rank 1's file. Rank 0's
    # choice is every rank's: both go on from step 8 and write step 12 together.
    run = tmp_path / "run"
    flags = COMMON[2:] + ["--dp", "2", "--save-steps", "4", "--no-save-async"]
    flags += ["--output-dir", str(run)]
    assert torchrun(2, flags + ["--max-steps", "8"]).returncode == 0
    resume = flags + ["--max-steps", "12", "--resume"]
    command = torchrun_command(2, resume, free_port(), module=LAGGING_TRAIN, preload=True)
    proc = run_python(command, child_env({"DISTZO_LAG": "1:4"}), 180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step-8'} at step 8" in proc.stderr
    assert set(checkpoint_writers(run / "checkpoints" / "step-12").values()) == {0, 1}


def test_export_loads_in_transformers_and_matches_the_engine(tmp_path):
    model = tiny_opt(seed=0, word_embed_proj_dim=16)
    engine = ZOEngine(model, ZOConfig(lr=1e-2, eps=1e-3, seed=0, device="cpu"))
    task = CountingTask(64, seed=0)
    for step in range(20):
        engine.step(task.batch(8, step))
    batch = random_batch(64, pad="left", seed=1)
    logits, _ = engine.forward(batch)
    export_hf(engine, tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        reference = loaded(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits
    assert (reference - logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("queries", ["2"])  # one query: the Adam world-size test replays too
def test_replay_of_the_seed_log_equals_the_export(tmp_path, queries):
    run = tmp_path / "run"
    flags = COMMON + [
        "--max-steps",
        "30",
        "--weight-decay",
        "0.1",
        "--num-queries",
        queries,
        "--output-dir",
        str(run),
    ]
    assert launch(1, flags).returncode == 0
    out = tmp_path / "replayed"
    proc = python_replay(
        ["--base", str(run / "base"), "--log", str(run / "seedlog.jsonl"), "--out", str(out)],
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    exported, replayed = (
        load_file(str(run / "export" / "model.safetensors")),
        load_file(str(out / "model.safetensors")),
    )
    assert exported.keys() == replayed.keys()
    for name in exported:
        assert torch.equal(exported[name], replayed[name]), name
    base = load_file(str(run / "base" / "model.safetensors"))
    assert any(not torch.equal(base[name], exported[name]) for name in base)  # it did train


@pytest.mark.parametrize(
    "log, message",
    [
        ('{"step": 0, "projected_grad": 1, "lr": 1}\n', "first line must be the run's header"),
        (
            '{"kind": "header"}\n{"step": 1, "projected_grad": 1, "lr": 1}\n',
            "expected the record of step 0",
        ),
        ('{"kind": "header"}\nnot json\n', "line 2: not JSON"),
    ],
)
def test_replay_rejects_a_malformed_log(tmp_path, log, message):
    path = tmp_path / "seedlog.jsonl"
    path.write_text(log)
    proc = main_in_process(
        "distzo.replay", ["--base", "x", "--log", str(path), "--out", str(tmp_path / "o")]
    )
    assert (
        proc.returncode == 2
        and message in proc.stderr
        and len(proc.stderr.strip().splitlines()) == 1
    )


HEADER = '"kind": "header", "run_seed": 1, "noise_chunk": 1024, "weight_decay": 0, "dtype": "fp32"'


@pytest.mark.parametrize(
    "field, message",
    [
        ('"transfer_dtype": "bf16"', "a bf16 transfer rounds stochastically on the host"),
        (
            '"optimizer": {"name": "adam", "state_dtype": "bf16"}',
            "the run's bf16 optimizer state rounds stochastically on the host",
        ),
    ],
)
def test_replay_refuses_a_log_whose_run_rounded_stochastically(tmp_path, field, message):
    # such a run's weights are not a function of its log: the export is the result
    path = tmp_path / "seedlog.jsonl"
    path.write_text(f'{{{HEADER}, "device_type": "cpu", {field}}}\n')
    proc = main_in_process(
        "distzo.replay", ["--base", "x", "--log", str(path), "--out", str(tmp_path / "o")]
    )
    assert proc.returncode == 2 and proc.stderr == (
        f"error: --log {path}: {message}, so its weights are not a function of the log; use "
        "the run's export/ instead\n"
    )


LOW_BIT = COMMON + ["--transfer-dtype", "bf16", "--compute-dtype", "fp32", "--eval-steps", "3"]


@pytest.fixture(scope="module")
def low_bit_legs(tmp_path_factory):
    """A low-bit run whole, and its first 4 steps (one buffer): each resume copies these."""
    full, cut = tmp_path_factory.mktemp("full"), tmp_path_factory.mktemp("cut")
    assert launch(1, LOW_BIT + ["--output-dir", str(full)]).returncode == 0
    assert launch(1, LOW_BIT + ["--max-steps", "4", "--output-dir", str(cut)]).returncode == 0
    return full, cut


@pytest.mark.parametrize("resumed_master", ["buffer", "double", "recompute"])
def test_low_bit_resume_through_the_cli_is_bitwise(tmp_path, low_bit_legs, resumed_master):
    # A flush moves a stochastic-rounding point, so the resumed leg must flush (evaluate)
    # exactly where the uninterrupted run does: not at step 4, where none is due. The
    # resumed leg may hold its block masters in two buffers, upcast and rounded beside the
    # compute, or rebuild them without a buffer: the same steps.
    full, cut = low_bit_legs[0], tmp_path / "cut"
    shutil.copytree(low_bit_legs[1], cut)
    resumed = ["--low-bit-master", resumed_master, "--output-dir", str(cut), "--resume"]
    proc = launch(1, LOW_BIT + resumed)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Run(cut).grads == Run(full).grads
    assert_same_params(Run(cut), Run(full))


def test_a_low_bit_run_stopped_where_it_evaluates_resumes_bitwise(tmp_path):
    # A run's last checkpoint is saved before the evaluation at its step (the final one of a
    # shorter run, or the periodic one a preemption comes before): the resumed leg makes that
    # evaluation's flush, as the uninterrupted run does there, and logs it once.
    args = LOW_BIT + ["--eval-steps", "2"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert launch(1, args + ["--output-dir", str(full)]).returncode == 0
    assert launch(1, args + ["--max-steps", "4", "--output-dir", str(cut)]).returncode == 0
    proc = launch(1, args + ["--output-dir", str(cut), "--resume"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Run(cut).grads == Run(full).grads
    assert_same_params(Run(cut), Run(full))

    def evaluations(run):
        return [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]

    assert [e["step"] for e in evaluations(cut)] == [0, 2, 4, 6, 8, 10]
    assert evaluations(cut) == evaluations(full)


def _sst2_rows(path: Path) -> Path:
    rows = ["a fine film\t1", "dull and long\t0", "warm and funny\t1", "a mess\t0"]
    path.write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize("task", ["counting", "sst2"])
def test_a_model_config_run_replays_without_a_base(tmp_path, task):
    """A shape reading text once exported OPT's special ids (eos 2, a byte of the byte
    tokenizer, where its ``</s>`` is 1) and its replay no tokenizer at all."""
    run = tmp_path / "run"
    rows = str(_sst2_rows(tmp_path / "rows.tsv"))
    text = ["--task", "sst2", "--train-file", rows, "--eval-file", rows] if task == "sst2" else []
    args = text + [
        "--model-config",
        "opt-125m",
        "--model-layers",
        "1",
        "--max-steps",
        "3",
        "--batch-size",
        "2",
        "--eval-batch-size",
        "4",
        "--lr",
        "1e-5",
        "--log-every",
        "0",
        "--output-dir",
        str(run),
    ]
    proc = launch(1, args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (run / "base").exists()  # the base is redrawn from the shape and its init seed
    out = tmp_path / "replayed"
    proc = python_replay(["--log", str(run / "seedlog.jsonl"), "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    exported, replayed = (
        load_file(str(run / "export" / "model.safetensors")),
        load_file(str(out / "model.safetensors")),
    )
    assert exported.keys() == replayed.keys() and all(
        torch.equal(exported[k], replayed[k]) for k in exported
    )
    ids = ("bos_token_id", "eos_token_id", "pad_token_id")
    for folder in (run / "export", out):
        config = json.loads((folder / "config.json").read_text())
        generation = json.loads((folder / "generation_config.json").read_text())
        if task == "counting":  # no tokenizer: the shape's own ids
            assert [config[k] for k in ids] == [2, 2, 1]
            assert not (folder / "tokenizer.json").exists()
        else:
            tokenizer = AutoTokenizer.from_pretrained(folder)
            assert tokenizer.eos_token == "</s>"
            expected = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
            assert [config[k] for k in ids] == [generation[k] for k in ids] == expected


def test_a_resumed_run_keeps_the_evaluation_at_its_resume_step(tmp_path):
    import json

    args = COMMON + [
        "--max-steps",
        "8",
        "--save-steps",
        "4",
        "--eval-steps",
        "2",
        "--output-dir",
        str(tmp_path),
    ]
    assert launch(1, args + ["--max-steps", "4"]).returncode == 0  # stops (and checkpoints) at 4
    assert launch(1, args + ["--resume"]).returncode == 0
    steps = [
        json.loads(line)["step"] for line in (tmp_path / "eval.jsonl").read_text().splitlines()
    ]
    assert steps == [0, 2, 4, 6, 8]


def test_noise_kinds_resume_and_replay_with_the_noise_they_were_drawn_with(tmp_path):
    import json

    full, cut = tmp_path / "full", tmp_path / "cut"
    flags = COMMON + ["--noise", "legacy", "--weight-decay", "0.1"]
    assert launch(1, flags + ["--output-dir", str(full)]).returncode == 0
    assert launch(1, flags + ["--max-steps", "4", "--output-dir", str(cut)]).returncode == 0
    # Resuming keeps the checkpoint's kind without being told; naming another is one line.
    wrong = launch(
        1,
        COMMON
        + ["--noise", "rademacher", "--weight-decay", "0.1", "--output-dir", str(cut)]
        + ["--resume"],
    )
    assert wrong.returncode == 2 and "--noise legacy -> rademacher would change" in wrong.stderr
    proc = launch(1, COMMON + ["--weight-decay", "0.1", "--output-dir", str(cut), "--resume"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Run(cut).grads == Run(full).grads
    assert_same_params(Run(cut), Run(full))
    assert Run(full).ranks[0]["noise"] == "legacy"

    # A seed log from before noise kinds (no "noise" in its header) replays as legacy.
    lines = (full / "seedlog.jsonl").read_text().splitlines()
    header = json.loads(lines[0])
    assert header["noise"] == "legacy"
    for name, identity in (("old", None), ("future", "gaussian-v99")):
        edited = {k: v for k, v in header.items() if k != "noise"} | (
            {"noise": identity} if identity else {}
        )
        log = tmp_path / f"{name}.jsonl"
        log.write_text("\n".join([json.dumps(edited), *lines[1:]]) + "\n")
        proc = python_replay(
            ["--base", str(full / "base"), "--log", str(log), "--out", str(tmp_path / name)],
            timeout=120,
        )
        if identity is None:
            assert proc.returncode == 0, proc.stderr[-2000:]
            replayed = load_file(str(tmp_path / name / "model.safetensors"))
            exported = load_file(str(full / "export" / "model.safetensors"))
            assert all(torch.equal(exported[k], replayed[k]) for k in exported)
        else:
            assert proc.returncode == 2 and "drew gaussian-v99 noise" in proc.stderr
            assert len(proc.stderr.strip().splitlines()) == 1


def test_a_run_of_the_first_version_resumes_onto_its_uninterrupted_trajectory(tmp_path):
    """The first versions (2026-11-22) wrote no objective in config.toml and no noise,
    optimizer, adapter or estimator in the seed log's header; their checkpoints hold the
    legacy noise. Such a run, cut after step 4 with its step-4 checkpoint, resumes with
    the options it started with, catches up with step 4 and ends on the uninterrupted run."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    flags = COMMON + ["--noise", "legacy", "--save-steps", "4", "--keep-checkpoints", "0"]
    assert launch(1, flags + ["--output-dir", str(full)]).returncode == 0
    shutil.copytree(full, cut, ignore=shutil.ignore_patterns("export", "step-8", "step-10"))
    config = (cut / "config.toml").read_text().replace(str(full), str(cut))
    (cut / "config.toml").write_text(config.replace('objective = "lm"\n', ""))
    header, *records = (full / "seedlog.jsonl").read_text().splitlines()
    first = {"run_seed", "noise_chunk", "weight_decay", "device_type", "dtype", "transfer_dtype"}
    old = {k: v for k, v in json.loads(header).items() if k in first | {"kind", "base"}}
    (cut / "seedlog.jsonl").write_text("\n".join([json.dumps(old), *records[:5]]) + "\n")
    proc = launch(1, COMMON + ["--save-steps", "4", "--output-dir", str(cut), "--resume"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Run(cut).grads == Run(full).grads
    assert_same_params(Run(cut), Run(full))


def test_a_lowrank_run_resumes_on_another_world_size_catches_up_and_replays(tmp_path):
    """LOZO's noise (V kept for 3 steps): cut at step 6, its step-6 checkpoint lost, the
    run resumes on two ranks from step 3's and the seed log's steps 3..5 (crossing into a
    new V window), onto the uninterrupted run; its seed log replays onto its export."""
    import json

    flags = COMMON + ["--dtype", "fp64", "--weight-decay", "0.1", "--noise", "lowrank"]
    flags += ["--lozo-rank", "1", "--lozo-interval", "3"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert launch(1, flags + ["--output-dir", str(full)]).returncode == 0
    proc = launch(1, flags + ["--max-steps", "6", "--save-steps", "3", "--output-dir", str(cut)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    shutil.rmtree(cut / "checkpoints" / "step-6")
    wrong = launch(1, flags + ["--lozo-rank", "2", "--output-dir", str(cut), "--resume"])
    assert wrong.returncode == 2 and "--lozo-rank 1 -> 2 would change" in wrong.stderr
    proc = launch(2, flags + ["--output-dir", str(cut), "--resume"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Run(cut).grads == Run(full).grads  # steps 3..5 caught up, not trained again
    assert_same_params(Run(cut), Run(full))
    header = json.loads((full / "seedlog.jsonl").read_text().splitlines()[0])
    assert header["noise"] == "lowrank-v1" and header["lowrank"] == {"rank": 1, "interval": 3}

    out = tmp_path / "replayed"
    proc = python_replay(
        ["--base", str(full / "base"), "--log", str(full / "seedlog.jsonl"), "--out", str(out)],
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    exported = load_file(str(full / "export" / "model.safetensors"))
    replayed = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(exported[k], replayed[k]) for k in exported)
