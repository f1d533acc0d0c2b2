"""MeZO's sampled sets (--num-train, --num-dev, --num-eval, --train-set-seed): the rows
MeZO's run.py draws, the dev rows evaluated during training and logged apart from the
evaluation rows, and the errors for counts a file cannot give."""

import json
import logging
import os
import socket
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from distzo.config.job import resolve
from distzo.data.sampling import Sampling, mezo_draw, sample_sets
from distzo.data.task_data import load_task_rows
from distzo.job.evaluation import evaluate
from distzo.job.records import describe
from distzo.job.run_lock import DirectoryLocked, RunLock
from distzo.job.trainer import Trainer, TrainerCallback
from tests.helpers.rows import sst2_like, write_jsonl


def test_the_draw_is_mezos_permutation_of_numpys_seeded_generator():
    assert mezo_draw(10, 4, 0) == [2, 8, 4, 9]
    np.random.seed(7)  # MeZO's temp_seed(7), then np.random.permutation
    assert mezo_draw(30, 12, 7) == np.random.permutation(30)[:12].tolist()


def test_dev_rows_are_the_last_of_the_drawn_training_rows_and_eval_rows_share_the_seed():
    train, evals = list(range(12)), [f"e{i}" for i in range(10)]
    sampled = sample_sets(train, evals, Sampling(6, 4, 5, seed=3), "t", "e")
    drawn = [5, 4, 1, 2, 11, 6, 7, 0, 3, 9]  # permutation(12) under seed 3, first 10
    assert sampled == (drawn[:6], drawn[6:], [evals[i] for i in mezo_draw(10, 5, 3)])
    # --num-dev alone: every row drawn, the last 4 of them dev
    rest, dev, same = sample_sets(train, evals, Sampling(num_dev=4, seed=3), "t", "e")
    assert dev == mezo_draw(12, 12, 3)[-4:] and sorted(rest + dev) == train and same is evals
    # --num-eval alone leaves the training file's rows as they are
    assert sample_sets(train, evals, Sampling(num_eval=2), "t", "e")[0] is train


@pytest.mark.parametrize(
    "sampling, message",
    [
        (
            Sampling(10, 4),
            "--num-train 10 and --num-dev 4 ask 14 rows, more than the 12 of --train-file "
            "t.jsonl; give --num-train 8 or less (MeZO's run.py takes the 12 there are: 8 to "
            "train, 4 dev)",
        ),
        (Sampling(num_dev=12), "--num-dev 12 leaves no training rows of the 12 of"),
        (  # one flag asks: "asks", as --num-eval's line says
            Sampling(20),
            "--num-train 20 asks 20 rows, more than the 12 of --train-file t.jsonl; give "
            "--num-train 12 or less (MeZO's run.py takes the 12 there are)$",
        ),
        (  # the dev rows alone fill the file: the fix is the dev count that fits
            Sampling(2, 14),
            "--num-train 2 and --num-dev 14 ask 16 rows, more than the 12 of --train-file "
            "t.jsonl; give --num-dev 10 or less (MeZO's run.py takes the 12 there are)$",
        ),
        (
            Sampling(12, 12),
            "--num-train 12 and --num-dev 12 ask 24 rows, more than the 12 of --train-file "
            "t.jsonl; give a --num-train and --num-dev that add up to 12 or less "
            "(MeZO's run.py takes the 12 there are)$",
        ),
        (Sampling(num_eval=11), "--num-eval 11 asks more rows than the 10 of --eval-file e"),
    ],
)
def test_counts_the_files_cannot_give_are_one_line_naming_their_rows(sampling, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        sample_sets(list(range(12)), list(range(10)), sampling, "t.jsonl", "e")


def test_num_eval_alone_draws_and_may_take_every_row_in_its_drawn_order():
    evals = [f"e{i}" for i in range(10)]
    train, _, drawn = sample_sets([1, 2], evals, Sampling(num_eval=10, seed=3), "t", "e")
    assert drawn == [evals[i] for i in mezo_draw(10, 10, 3)] and drawn != evals
    assert train == [1, 2]
    resolve(["--num-eval", "2", "--train-set-seed", "3"])  # the seed applies to its draw
    with pytest.raises(ValueError, match="^--task counting generates its data; --num-train"):
        load_task_rows("counting", None, None, Sampling(num_eval=2))


def test_sampled_rows_are_digested_as_drawn_so_another_draw_is_another_run(tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", sst2_like(12))
    whole = load_task_rows("sst2", data, data)
    assert whole is not None and set(whole.digests) == {"--train-file", "--eval-file"}
    drawn = load_task_rows("sst2", data, data, Sampling(6, 4, 5, seed=3))
    assert drawn is not None and drawn.dev == [whole.train[i] for i in [7, 0, 3, 9]]
    other = load_task_rows("sst2", data, data, Sampling(6, 4, 5, seed=4))
    assert other is not None and set(drawn.digests) == {"--train-file", "--eval-file", "--num-dev"}
    assert all(drawn.digests[flag] != other.digests[flag] for flag in drawn.digests)


def test_dev_rows_are_evaluated_during_training_and_logged_apart_from_the_eval_rows(
    tmp_path, caplog
):
    data = write_jsonl(tmp_path / "rows.jsonl", sst2_like(12))
    out = tmp_path / "run"
    flags = ["--task", "sst2", "--train-file", data, "--eval-file", data, "--device", "cpu"]
    flags += ["--max-steps", "4", "--eval-steps", "2", "--log-every", "0", "--batch-size", "2"]
    flags += ["--output-dir", str(out), "--num-train", "6", "--num-dev", "4", "--num-eval", "5"]
    with Trainer(resolve(flags + ["--train-set-seed", "3"])) as trainer:
        trainer.train()
        dev = evaluate(trainer.engine, trainer.data, trainer.parallel, split="dev")
        trainer.data.eval_examples = trainer.data.dev_examples  # the dev rows, evaluated
        as_eval = evaluate(trainer.engine, trainer.data, trainer.parallel)
    # the classification objective's loss first: MeZO's OPT runs keep its lowest dev step
    assert dev == {"dev_loss": as_eval["eval_loss"], "dev_accuracy": as_eval["eval_accuracy"]}
    records = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], *r) for r in records] == [
        (0, "step", "eval_loss", "eval_accuracy"),
        (2, "step", "dev_loss", "dev_accuracy"),
        (4, "step", "dev_loss", "dev_accuracy"),  # the dev rows' last, then the final evaluation
        (4, "step", "eval_loss", "eval_accuracy"),
    ]
    assert records[2] == {"step": 4, **dev}
    summary = json.loads((out / "summary.json").read_text())
    best = min(records[1:3], key=lambda r: r["dev_loss"])  # the earliest among equals
    assert summary["dev"]["best"] == {"by": "dev_loss", **best}
    assert summary["eval"]["last"] == records[3]
    # a requeue of the finished run says both final evaluations eval.jsonl records
    with caplog.at_level(logging.INFO, logger="distzo.train"):
        Trainer(resolve(flags + ["--train-set-seed", "3", "--resume"])).train()
    assert f"dev at step 4: {describe(dev)}" in caplog.text
    # another draw would train other rows: a resume with it is refused in one line
    with pytest.raises(ValueError, match="--train-set-seed 3 -> 4 would change the trajectory"):
        Trainer(resolve(flags + ["--train-set-seed", "4", "--resume"])).train()


def test_the_text_tasks_dev_rows_are_an_evaluation_set_of_their_own():
    from distzo.data.encoding import PromptEncoder
    from distzo.data.task_data import LoadedRows, TextData
    from distzo.models.tiny import byte_tokenizer

    encoder = PromptEncoder(byte_tokenizer(), max_length=12)
    dev = ["a fine film", "much too long for the limit here"]
    data = TextData(LoadedRows("text", ["some text"], ["ok then"], dev), encoder, 0, 2)
    assert data.dev_set is not None and data.dev_set.texts == dev
    assert data.longest == data.dev_set.width == 12  # the memory plan sees the dev rows
    assert data.cut_notices == (
        "--num-dev rows of --train-file: 1 of 2 rows are longer than 12 tokens "
        "(--max-length, or the model's positions): they lose tokens from the left; raise "
        "--max-length or shorten the rows",
    )


class _TrainedEngine(TrainerCallback):
    """Keeps a weak reference to the run's engine: whether the trained model is let go."""

    engine: weakref.ref | None = None
    parts: list[weakref.ref] = []  # its model and each of the model's tensors

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict) -> None:
        self.engine = weakref.ref(trainer.engine)
        model = trainer.engine.model
        self.parts = [weakref.ref(model), *map(weakref.ref, model.state_dict().values())]


def test_export_best_writes_the_best_dev_steps_model_as_a_run_of_that_many_steps(
    tmp_path, monkeypatch
):
    from safetensors.torch import load_file

    import distzo.replay
    from distzo.train import main

    data = write_jsonl(tmp_path / "rows.jsonl", sst2_like(12))
    flags = ["--task", "sst2", "--train-file", data, "--eval-file", data, "--device", "cpu"]
    flags += ["--eval-steps", "2", "--log-every", "0", "--batch-size", "2", "--lr", "0.1"]
    flags += ["--lr-schedule", "constant", "--num-train", "6", "--num-dev", "4"]
    out, trained, replayed = tmp_path / "run", _TrainedEngine(), []

    def replay_with_the_trained_engine_gone(run_dir: Path, options: dict, lock) -> None:
        # the replay builds the model again on the run's device: the trained one let go
        assert trained.engine is not None and trained.engine() is None
        assert trained.parts and all(part() is None for part in trained.parts)
        # the directory locked since the run began: no other job (a requeue) starts there
        with pytest.raises(DirectoryLocked):
            RunLock(run_dir).acquire()
        replayed.append(export_best(run_dir, options, lock))

    export_best = distzo.replay.export_best
    monkeypatch.setattr(distzo.replay, "export_best", replay_with_the_trained_engine_gone)
    flags_best = ["--max-steps", "4", "--output-dir", str(out), "--export-best"]
    assert main(flags + flags_best, [trained]) == 0 and replayed == [None]
    dev = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()][1:3]
    best = min(dev, key=lambda r: r["dev_loss"])["step"]  # the lowest dev loss (MeZO's OPT)
    assert best == 2  # not the run's end: the export compared is another step's
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dev"]["best"]["step"] == best
    assert summary["dev"]["export_best"] == str(out / "export-best")
    shorter = tmp_path / "shorter"
    assert main(flags + ["--max-steps", str(best), "--output-dir", str(shorter)]) == 0
    ours, theirs = (
        load_file(d / "model.safetensors") for d in (out / "export-best", shorter / "export")
    )
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    (out / "export-best" / "config.json").unlink()  # partly deleted: a kill while replaced
    (out / "export-best.tmp").mkdir()  # and a kill in a replay, before its rename
    (out / "export-best.tmp" / "model.safetensors").write_bytes(b"cut short")
    held = RunLock(out)  # another job in the directory meanwhile: none writes beside it
    held.acquire()
    monkeypatch.setattr(distzo.replay, "BEST_LOCK_WAIT_S", 0.0)
    with pytest.raises(ValueError) as refused:
        export_best(out, _OPTIONS)
    assert str(refused.value) == (
        f"--export-best: another job took {out} as this run ended (pid {os.getpid()} on "
        f"{socket.gethostname()}), so export-best/ was not written; once that job ends, "
        f"python -m distzo.replay --log {out / 'seedlog.jsonl'} --out {out / 'export-best'} "
        "--step N, with N its summary.json's dev.best.step, writes it"
    )
    held.release()
    export_best(out, _OPTIONS)  # the requeue's replay, over its own leftovers
    again = load_file(out / "export-best" / "model.safetensors")
    assert all(torch.equal(ours[k], again[k]) for k in ours)
    assert (out / "export-best" / "config.json").is_file()
    assert not (out / "export-best.tmp").exists()


_OPTIONS = {"export_shard_size": "5GB", "merge_adapter": False}  # the run's export options


@pytest.mark.parametrize("fails", [False, True])
def test_export_best_lets_go_of_its_run_directory_however_its_replay_ends(
    tmp_path, monkeypatch, fails
):
    """export_best takes the run directory's lock again: a replay that ends, or fails, leaves
    no lock file and no lock held, so the next job (a requeue) starts there."""
    import distzo.replay

    held = []

    def replay_in_the_locked_directory(run_dir: Path, options: dict) -> None:
        held.append((run_dir / ".distzo.lock").is_file())
        if fails:
            raise OSError("no space left on device")

    monkeypatch.setattr(distzo.replay, "_export_best_locked", replay_in_the_locked_directory)
    tmp_path.joinpath("run").mkdir()
    if fails:
        with pytest.raises(OSError, match="no space left"):
            distzo.replay.export_best(tmp_path / "run", _OPTIONS)
    else:
        distzo.replay.export_best(tmp_path / "run", _OPTIONS)
    assert held == [True] and not (tmp_path / "run" / ".distzo.lock").exists()
    following = RunLock(tmp_path / "run")
    following.acquire()  # the next job's: not refused
    following.release()


def test_a_requeue_of_a_finished_export_best_run_keeps_its_export_best_as_it_is(
    tmp_path, monkeypatch
):
    """Rewriting export-best/ replays the whole seed log (minutes on a large model): a
    requeue keeps the one the summary records, complete, of the same best step and export
    options; it replays where the options changed, or the record is of another step."""
    import distzo.replay
    from distzo.train import main

    data = write_jsonl(tmp_path / "rows.jsonl", sst2_like(12))
    out = tmp_path / "run"
    flags = ["--task", "sst2", "--train-file", data, "--eval-file", data, "--device", "cpu"]
    flags += ["--eval-steps", "2", "--log-every", "0", "--batch-size", "2", "--lr", "0.1"]
    flags += ["--lr-schedule", "constant", "--num-train", "6", "--num-dev", "4"]
    flags += ["--max-steps", "4", "--output-dir", str(out), "--export-best"]
    assert main(flags) == 0
    first = json.loads((out / "summary.json").read_text())
    assert first["export_best_written"]["step"] == first["dev"]["best"]["step"] == 2
    weights = out / "export-best" / "model.safetensors"
    written = weights.stat().st_mtime_ns
    replayed, replay = [], distzo.replay.replay
    monkeypatch.setattr(
        distzo.replay, "replay", lambda *a, **k: replayed.append(k["step"]) or replay(*a, **k)
    )
    assert main(flags + ["--resume"]) == 0 and replayed == []
    assert weights.stat().st_mtime_ns == written  # the folder as it was
    again = json.loads((out / "summary.json").read_text())
    assert again["dev"]["export_best"] == str(out / "export-best")
    assert again["export_best_written"] == first["export_best_written"]
    # another --export-shard-size: written again, with it (as the run's export/ is)
    assert main(flags + ["--resume", "--export-shard-size", "100KB"]) == 0 and replayed == [2]
    shards = sorted(p.name for p in (out / "export-best").glob("*.safetensors"))
    assert len(shards) > 1 and (out / "export-best" / "model.safetensors.index.json").is_file()
    # a record of another step (an earlier session's best) does not describe this one's
    summary = json.loads((out / "summary.json").read_text())
    summary["export_best_written"]["step"] = 4
    (out / "summary.json").write_text(json.dumps(summary))
    distzo.replay.export_best(out, {"export_shard_size": "100KB", "merge_adapter": False})
    assert replayed == [2, 2]


def test_export_best_drops_its_record_before_a_replay_replaces_the_folder(tmp_path, monkeypatch):
    """The record of export-best/ no longer describes the folder a replay replaces: it
    leaves the summary first, so a replay killed part-way leaves no record that a later
    requeue of that step could keep a folder of other weights by."""
    import distzo.replay

    run = tmp_path / "run"
    (run / "export-best").mkdir(parents=True)
    (run / "export-best" / "model.safetensors").write_bytes(b"step 4's weights")
    written = {"step": 4, **_OPTIONS, "files": {"model.safetensors": 16}}
    best = {"step": 2, "by": "dev_accuracy", "dev_accuracy": 0.75}
    summary = {"dev": {"best": best}, "export_best_written": written}
    (run / "summary.json").write_text(json.dumps(summary))

    def killed(*args, **kwargs) -> None:
        raise KeyboardInterrupt  # the job stopped while the replay ran

    monkeypatch.setattr(distzo.replay, "replay", killed)
    with pytest.raises(KeyboardInterrupt):
        distzo.replay.export_best(run, _OPTIONS)
    assert json.loads((run / "summary.json").read_text()) == {"dev": {"best": best}}


def test_export_best_of_a_run_whose_log_cannot_replay_is_refused_before_training(tmp_path):
    from distzo.config.checks import check_best_replayable

    job = resolve(["--num-dev", "2", "--export-best", "--transfer-dtype", "bf16"])
    with pytest.raises(
        ValueError,
        match="^--export-best replays the seed log to the best dev "
        "step, but --transfer-dtype bf16 rounds stochastically on the host",
    ):
        check_best_replayable(job)
    lora = resolve(
        ["--num-dev", "2", "--export-best", "--transfer-dtype", "bf16", "--peft", "lora"]
    )
    check_best_replayable(lora)  # an adapter's base was rounded to nearest once: replayable
    state = resolve(["--num-dev", "2", "--export-best", "--state-dtype", "bf16"])
    with pytest.raises(ValueError, match="^--export-best .* but --state-dtype bf16 rounds"):
        check_best_replayable(state)  # the optimizer's 16-bit state rounds stochastically too
    scoring = resolve(["--num-dev", "2", "--export-best", "--max-steps", "0"])
    with pytest.raises(ValueError, match="^--export-best with --max-steps 0: nothing is trained"):
        check_best_replayable(scoring)


def test_export_best_of_a_resume_from_a_copied_checkpoint_is_refused_before_training(tmp_path):
    """Its seed log begins at the checkpoint's step, which the replay at the run's end
    refused after all the training; the resume is refused as it starts."""
    data = write_jsonl(tmp_path / "rows.jsonl", sst2_like(12))
    out = tmp_path / "run"
    flags = ["--task", "sst2", "--train-file", data, "--eval-file", data, "--device", "cpu"]
    flags += ["--log-every", "0", "--batch-size", "2", "--num-train", "6", "--num-dev", "4"]
    flags += ["--output-dir", str(out)]
    with Trainer(resolve(flags + ["--max-steps", "2"])) as trainer:
        trainer.train()
    (out / "seedlog.jsonl").unlink()  # the checkpoint alone, as copied into a directory
    with pytest.raises(
        ValueError,
        match=r"^--export-best replays the seed log from step 0, but the run in .* went on "
        r"from a checkpoint copied in at step 2 \(its seed log begins there\); drop --export-best",
    ):
        Trainer(resolve(flags + ["--max-steps", "4", "--resume", "--export-best"]))


def test_export_best_goes_on_with_a_seed_log_from_step_0_and_refuses_one_begun_later(tmp_path):
    """Only the log's first step matters: a resume after 4 steps of a log begun at step 0
    replays; a log an earlier session began at step 1 (a checkpoint copied in) cannot."""
    from distzo.job.run_logs import RunLogs
    from distzo.job.validation import check_log_from_step_zero

    whole, copied = tmp_path / "whole", tmp_path / "copied"
    for run_dir, first in ((whole, 0), (copied, 1)):
        RunLogs(run_dir, run_dir, first, {"kind": "header"}).close()
    check_log_from_step_zero(whole, 4)
    check_log_from_step_zero(tmp_path / "fresh", 0)  # no log yet, nothing done
    with pytest.raises(ValueError, match="copied in at step 1 \\(its seed log begins there\\)"):
        check_log_from_step_zero(copied, 4)
