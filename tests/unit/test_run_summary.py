"""The run's summary.json and curves.png, in process through the Trainer: they hold the
run's own figures (those of eval.jsonl and metrics.jsonl), a resumed run's cover the
whole run, the picture is redrawn at each evaluation, the step line carries an ETA in a
log that is no terminal, the done line names both files, no DCP note is warned at a
save or a load, and ``--overwrite`` deletes both."""

import json
import logging
import time
from pathlib import Path

import pytest
from matplotlib import image

from distzo.config.job import resolve
from distzo.job.checkpoint import HostStateWriter
from distzo.job.run_dir import check_fresh, clear_run
from distzo.job.run_logs import read_records
from distzo.job.trainer import Trainer, TrainerCallback

STEPS = 8
DCP_NOTE = "torch.distributed is disabled"


def job(out: Path, *flags: str):
    return resolve(
        ["--max-steps", str(STEPS), "--device", "cpu", "--log-every", "2", "--eval-steps", "4"]
        + ["--output-dir", str(out), *flags]
    )


class Watch(TrainerCallback):
    """Keeps curves.png's bytes as each step starts; fails the run before ``stop_at``."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.stop_at = stop_at
        self.curves: dict[int, bytes | None] = {}

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        if step == self.stop_at:
            raise RuntimeError(f"stopped at step {step}")
        path = trainer.run_dir / "curves.png"
        self.curves[step] = path.read_bytes() if path.exists() else None


def check_png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = image.imread(path).shape
    assert width > height > 100  # one panel per figure side by side


def test_a_run_writes_its_summary_and_its_curves(tmp_path, caplog, capsys, recwarn):
    caplog.set_level(logging.INFO, logger="distzo.train")
    out = tmp_path / "run"
    watch = Watch()
    with Trainer(job(out, "--save-steps", "4"), callbacks=[watch]) as trainer:
        trainer.train()
    summary = json.loads((out / "summary.json").read_text())
    evals = read_records(out / "eval.jsonl")
    metrics = read_records(out / "metrics.jsonl")
    assert [e["step"] for e in evals] == [0, 4, 8]
    assert summary["steps"] == STEPS and summary["session"]["steps"] == STEPS
    assert summary["session"]["tokens_per_s"] > 0 and summary["session"]["seconds"] > 0
    assert summary["eval"]["first"] == evals[0] and summary["eval"]["last"] == evals[-1]
    best = min(evals, key=lambda e: e["eval_loss"])
    assert summary["eval"]["best"] == {"by": "eval_loss", **best}
    assert summary["train_loss"]["first"] == metrics[0]["loss"]
    assert summary["train_loss"]["last"] == metrics[-1]["loss"]
    assert summary["options"]["max_steps"] == STEPS and summary["options"]["device"] == "cpu"
    assert summary["export"] == str((out / "export").absolute())
    assert summary["checkpoint"] == str((out / "checkpoints" / "step-8").absolute())
    assert Path(summary["export"], "model.safetensors").is_file()
    assert Path(summary["checkpoint"], ".metadata").is_file()

    # Drawn at the evaluation after 4 steps (none before it), then again at the end.
    assert watch.curves[3] is None and watch.curves[4] is not None
    assert watch.curves[4] == watch.curves[7]
    assert (out / "curves.png").read_bytes() != watch.curves[7]
    check_png(out / "curves.png")

    lines = [r.getMessage() for r in caplog.records]
    assert trainer.progress.bar is None  # pytest's stderr is no terminal: no bar
    step_2 = next(line for line in lines if line.startswith("step 2/8 loss"))
    assert " steps/s, ETA 00:0" in step_2
    done = next(line for line in lines if line.startswith("done: 8 steps"))
    assert done.endswith(f"summary {out / 'summary.json'}, curves {out / 'curves.png'}")
    assert not [w for w in recwarn if DCP_NOTE in str(w.message)]  # async saves included
    assert "Writing model shards" not in capsys.readouterr().err  # the base/ save's bar


@pytest.fixture
def slow_async_save(monkeypatch):
    """The asynchronous save of step 4 still writing when the run fails at step 6, as on a
    loaded machine (the race that made the resumed-run test flaky, made certain)."""
    write_data = HostStateWriter.write_data

    def slowly(self, plan, planner):
        time.sleep(1.0)
        return write_data(self, plan, planner)

    monkeypatch.setattr(HostStateWriter, "write_data", slowly)


def test_a_failed_run_completes_the_save_it_had_started(tmp_path, slow_async_save):
    out = tmp_path / "run"
    first = Trainer(job(out, "--save-steps", "4"), callbacks=[Watch(stop_at=6)])
    with first, pytest.raises(RuntimeError, match="stopped at step 6"):
        first.train()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-4"]


def test_a_resumed_runs_summary_and_curves_cover_the_whole_run(tmp_path, recwarn, slow_async_save):
    out = tmp_path / "run"
    first = Trainer(job(out, "--save-steps", "4"), callbacks=[Watch(stop_at=6)])
    with first, pytest.raises(RuntimeError, match="stopped at step 6"):
        first.train()
    assert not (out / "summary.json").exists() and (out / "curves.png").is_file()
    first_loss = read_records(out / "metrics.jsonl")[0]["loss"]

    second = Trainer(job(out, "--resume"))  # loads the checkpoint of step 4
    second.train()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert summary["session"]["start_step"] == 6 and summary["session"]["steps"] == 2
    assert summary["train_loss"]["first"] == first_loss
    assert [e["step"] for e in read_records(out / "eval.jsonl")] == [0, 4, 8]
    assert summary["eval"]["first"]["step"] == 0 and summary["eval"]["last"]["step"] == 8
    check_png(out / "curves.png")
    assert not [w for w in recwarn if DCP_NOTE in str(w.message)]


def test_a_session_that_goes_on_drops_the_summary_of_the_one_before(tmp_path):
    """Once a finished run resumed with more steps and stopped kept the first session's
    summary.json, which said the run had ended at its steps."""
    out = tmp_path / "run"
    Trainer(job(out, "--max-steps", "4")).train()
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    going_on = Trainer(job(out, "--resume", "--max-steps", "8"), callbacks=[Watch(stop_at=6)])
    with going_on, pytest.raises(RuntimeError, match="stopped at step 6"):
        going_on.train()
    assert not (out / "summary.json").exists()
    done = Trainer(job(out, "--resume", "--max-steps", "8"))
    done.train()
    assert json.loads((out / "summary.json").read_text())["steps"] == 8


def test_a_run_of_no_steps_scores_once_saves_nothing_and_says_so(tmp_path, monkeypatch, caplog):
    """--max-steps 0 scores the model it loads (MeZO's zero-shot baseline): once, as the
    weights after training are those before; a checkpoint and an export of it were minutes
    and a copy of a large model on disk, for nothing the run did not load."""
    from distzo.job import trainer as trainer_module

    scored = []

    def counted(*args, **kwargs):
        scored.append(kwargs.get("split", args[4] if len(args) > 4 else "eval"))
        return evaluate(*args, **kwargs)

    evaluate = trainer_module.evaluate
    monkeypatch.setattr(trainer_module, "evaluate", counted)
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="distzo.train"):
        after = Trainer(job(out, "--max-steps", "0")).train()
    records = read_records(out / "eval.jsonl")
    assert [e["step"] for e in records] == [0] and scored == ["eval"]
    assert after == {k: v for k, v in records[0].items() if k != "step"}
    assert not (out / "export").exists() and not list((out / "checkpoints").glob("step-*"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["export"] is None and summary["checkpoint"] is None
    only = records[0]  # the one evaluation is the first, the last and the best; no dev rows
    assert summary["eval"] == {"first": only, "last": only, "best": {"by": "eval_loss", **only}}
    assert "dev" not in summary
    done = caplog.records[-1].getMessage()
    assert done.startswith("done: scored without training (--max-steps 0): eval loss ")
    assert "nothing was trained, so no checkpoint or export/ was written" in done


def test_a_requeue_of_a_finished_run_reports_its_recorded_final_evaluation(
    tmp_path, monkeypatch, caplog
):
    """A finished run resumed (a requeued job) evaluated its final state again: minutes on
    a large model, for the figures eval.jsonl holds. It reports those; it evaluates again
    only where a record is missing (the run died before writing it)."""
    from distzo.job import trainer as trainer_module
    from distzo.job.records import describe

    out = tmp_path / "run"
    finished = Trainer(job(out, "--max-steps", "4")).train()
    scored: list[int] = []
    evaluate = trainer_module.evaluate
    monkeypatch.setattr(
        trainer_module, "evaluate", lambda *a, **k: scored.append(1) or evaluate(*a, **k)
    )
    with caplog.at_level(logging.INFO, logger="distzo.train"):
        assert Trainer(job(out, "--max-steps", "4", "--resume")).train() == finished
    assert scored == []
    assert "its final evaluation is the one eval.jsonl records" in caplog.text
    assert f"(resumed at step 4) {describe(finished)}; model exported" in caplog.text
    records = read_records(out / "eval.jsonl")
    (out / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:-1]))
    assert Trainer(job(out, "--max-steps", "4", "--resume")).train() == finished
    assert scored == [1] and read_records(out / "eval.jsonl") == records
    from distzo.job.run_dir import evaluates_as_recorded

    again = job(out, "--max-steps", "4", "--resume")
    assert evaluates_as_recorded(again)
    again.data.max_new_tokens += 1  # a generation task's answers, scored at another length
    assert not evaluates_as_recorded(again)
    again.data.max_new_tokens -= 1
    (out / "config.toml").unlink()  # a checkpoint copied in alone: how it scored is unknown
    assert not evaluates_as_recorded(again)
    assert Trainer(job(out, "--max-steps", "4", "--resume")).train() == finished
    assert scored == [1, 1]  # evaluated again, not read off a record of unknown options


def test_a_requeue_with_dev_rows_reports_its_final_evaluation_only_with_both_splits(tmp_path):
    """A run with dev rows killed between the final dev and eval records left one of its
    two final evaluations: the requeue evaluates again rather than report half of it."""
    from distzo.job.run_end import recorded_final_evals
    from distzo.job.run_logs import RunLogs

    logs = RunLogs(tmp_path, tmp_path, 0, {"kind": "header"})
    logs.write("eval", {"step": 2, "eval_accuracy": 0.25})
    logs.write("eval", {"step": 4, "dev_accuracy": 0.5})
    assert recorded_final_evals(logs, 4, ("dev", "eval")) is None
    logs.write("eval", {"step": 4, "eval_accuracy": 0.75})
    logs.close()
    assert recorded_final_evals(logs, 4, ("dev", "eval")) == {
        "dev": {"dev_accuracy": 0.5},
        "eval": {"eval_accuracy": 0.75},
    }
    assert recorded_final_evals(None, 4, ("eval",)) is None  # not rank 0: no logs


def test_overwrite_deletes_the_summary_and_the_curves(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    (out / "curves.png").write_bytes(b"\x89PNG")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"already holds a run \(curves.png, summary.json\)"):
        check_fresh(resolve(["--output-dir", str(out)]))
    clear_run(resolve(["--output-dir", str(out), "--overwrite"]))
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_a_long_runs_curves_draw_the_loss_s_moving_mean_at_each_window_s_last_step(tmp_path):
    """From 100 steps on the loss panel adds a moving mean, each value drawn at the last
    step of its window: a run of 250 steps draws its 50-step means from step 4 on."""
    from matplotlib.figure import Figure

    from distzo.job import curves

    drawn = []
    original = Figure.subplots

    def keep_axes(self, *args, **kwargs):
        axes = original(self, *args, **kwargs)
        drawn.append(axes)
        return axes

    metrics = [{"step": s, "loss": float(s % 7)} for s in range(250)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Figure, "subplots", keep_axes)
        loss = curves.LossCurve.of(metrics)
        curves.draw_curves(tmp_path / "curves.png", loss.steps, loss.losses, [])
    assert image.imread(tmp_path / "curves.png").shape[0] > 0
    mean = drawn[0][0][0].get_lines()[1]
    window = 250 // curves.SMOOTH_POINTS
    assert list(mean.get_xdata()) == [float(s) for s in range(window - 1, 250)]
    assert mean.get_ydata()[0] == pytest.approx(sum(s % 7 for s in range(window)) / window)


def test_the_moving_mean_from_running_sums_is_the_windows_mean():
    """The loss's moving mean spans 1/50 of the steps: a convolution's steps x window
    (2e10 products and minutes for a million steps, at each evaluation's redraw) is what a
    long run paid; running sums give the same means in linear time (benchmarks measure
    speed; this checks the values)."""
    import numpy as np

    from distzo.job import curves

    losses = np.random.default_rng(0).random(50_000) * 4
    window = len(losses) // curves.SMOOTH_POINTS
    mean = curves._moving_mean(losses, window)
    assert mean.shape == (len(losses) - window + 1,)
    assert mean[0] == pytest.approx(losses[:window].mean(), rel=1e-9)
    assert mean[-1] == pytest.approx(losses[-window:].mean(), rel=1e-9)
    small = np.arange(10, dtype=float) % 3
    expected = np.convolve(small, np.ones(4) / 4, mode="valid")
    assert np.allclose(curves._moving_mean(small, 4), expected, rtol=0, atol=1e-12)


def test_each_evaluation_redraws_the_curves_without_reading_metrics_back(tmp_path, monkeypatch):
    """A periodic evaluation redraws curves.png from the loss the logs keep as they write
    it: reading metrics.jsonl back at each one cost a dict per step (1 GB and 13 s at
    each evaluation of a run of a million steps). The run's end draws and sums up that
    loss too, without reading the file back; a resumed run's logs start from the steps
    the file keeps."""
    from distzo.job import run_logs
    from distzo.job.run_logs import RunLogs

    reads: list[str] = []
    iter_records = run_logs.iter_records

    def counted(path):
        if path.name == "metrics.jsonl" and path.is_file():
            reads.append(path.name)
        return iter_records(path)

    monkeypatch.setattr(run_logs, "iter_records", counted)
    out = tmp_path / "run"
    with Trainer(job(out, "--eval-steps", "2")) as trainer:
        trainer.train()
    assert [e["step"] for e in read_records(out / "eval.jsonl")] == [0, 2, 4, 6, 8]
    assert reads == []  # the summary's losses are the logs' too
    summary = json.loads((out / "summary.json").read_text())
    losses = [r["loss"] for r in read_records(out / "metrics.jsonl")]
    assert summary["train_loss"] == {"first": losses[0], "last": losses[-1], "min": min(losses)}
    logs = RunLogs(out, out, 5, {"kind": "header"})
    # each record written from here on joins the curve the next evaluation draws; a loss
    # of 0.0 is a point like any other
    logs.write("metrics", {"step": 5, "loss": 0.0})
    logs.close()
    metrics = read_records(out / "metrics.jsonl")
    assert list(logs.loss_curve.steps) == [0, 1, 2, 3, 4, 5]
    assert list(logs.loss_curve.losses) == [r["loss"] for r in metrics]
    assert logs.loss_curve.losses[-1] == 0.0


def test_the_best_evaluation_is_the_highest_accuracy_and_the_lowest_loss():
    """A choice or generation task's best evaluation is its highest metric (only a loss is
    best lowest); of equals, the earliest."""
    from distzo.job.summary import best_eval

    accuracies = [{"step": 0, "eval_accuracy": 0.5}, {"step": 4, "eval_accuracy": 0.75}]
    accuracies.append({"step": 8, "eval_accuracy": 0.75})
    assert best_eval(accuracies) == {"by": "eval_accuracy", "step": 4, "eval_accuracy": 0.75}
    losses = [{"step": 0, "eval_loss": 2.0}, {"step": 4, "eval_loss": 1.5}]
    assert best_eval(losses) == {"by": "eval_loss", "step": 4, "eval_loss": 1.5}


def test_with_dev_rows_the_best_is_chosen_on_them_and_eval_best_is_its_test_score():
    """MeZO picks its step on the dev rows and reports the eval (test) rows' score of that
    step's model; the best of the eval rows' own scores (the base's, here) was a figure
    chosen on the rows it reports."""
    from distzo.job.summary import run_summary

    base = {"step": 0, "eval_accuracy": 0.9}
    end = {"step": 4, "eval_accuracy": 0.6}

    def summary_eval(dev_at_2: float, dev_at_4: float) -> dict:
        dev = [{"step": 2, "dev_accuracy": dev_at_2}, {"step": 4, "dev_accuracy": dev_at_4}]
        return run_summary({}, 4, {}, [], [base, *dev, end], {})["eval"]

    assert summary_eval(0.5, 0.75) == {
        "first": base,
        "last": end,
        "best": {"by": "dev_accuracy", **end},  # the end's model, chosen on dev
    }
    assert summary_eval(0.75, 0.5)["best"] is None  # step 2's model: the eval rows never scored it


def test_the_summary_names_its_files_by_absolute_path_and_its_resolved_lr(tmp_path, monkeypatch):
    """A relative --output-dir still gives paths that read from anywhere; the lr is the
    one the run used, also where a default gave it (``--lr`` not passed)."""
    from distzo.config.engine_options import ZOConfig
    from distzo.job.summary import key_options, run_summary

    monkeypatch.chdir(tmp_path)
    record = run_summary({}, 0, {}, [], [], {"export": Path("run/export"), "curves": None})
    assert record["export"] == str(tmp_path / "run" / "export") and record["curves"] is None
    flags = resolve(["--max-steps", "1", "--device", "cpu"])
    assert flags.optim.lr is None  # the engine's default decides it
    options = key_options(flags, ZOConfig(lr=3e-4), "loss", "whole", "cpu", 1)
    assert options["lr"] == 3e-4


def test_the_curves_draw_a_panel_per_metric_and_none_for_the_step():
    from distzo.job.curves import eval_metric_names

    evals = [{"step": 0, "eval_loss": 2.0}, {"step": 4, "eval_loss": 1.5, "eval_accuracy": 0.5}]
    assert eval_metric_names(evals) == ["eval_loss", "eval_accuracy"]


def test_a_metrics_record_without_a_numeric_step_or_loss_draws_nothing(tmp_path):
    """A damaged metrics.jsonl (a loss without a step, a step or loss that is no number)
    stopped a resume with KeyError 'step'; such a record draws nothing, the others do."""
    from distzo.job.run_logs import RunLogs

    lines = [
        {"loss": 1.0},
        {"step": 0, "loss": 2.0},
        {"step": True, "loss": 3.0},
        {"step": 1, "loss": "4"},
        {"step": 2, "loss": False},
        {"step": 3, "loss": 5},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    logs = RunLogs(tmp_path, tmp_path, 9, {"kind": "header"})
    logs.close()
    assert list(logs.loss_curve.steps) == [0.0, 3.0]
    assert list(logs.loss_curve.losses) == [2.0, 5.0]


@pytest.mark.parametrize(
    "text",
    [None, "", '{"steps": 0', "[" * 100_000, '["steps", 0]', "0"],
    ids=["missing", "empty", "cut-short", "nested-too-deep", "a-list", "a-number"],
)
def test_a_summary_missing_cut_short_or_not_an_object_reads_as_none(tmp_path, text):
    """A requeue judges a run by its summary (kept export, scoring record, export-best):
    one it cannot read reads as no summary, a finished run's end not vouched for, never
    a traceback of json or of a list's missing .get."""
    from distzo.job.summary import read_summary

    if text is not None:
        (tmp_path / "summary.json").write_text(text)
    assert read_summary(tmp_path) is None
    (tmp_path / "summary.json").write_text('{"steps": 0}')
    assert read_summary(tmp_path) == {"steps": 0}


@pytest.mark.parametrize("metric", ["mcc", "f1"])
@pytest.mark.parametrize("accuracy_first", [False, True])
def test_a_glue_tasks_best_dev_step_is_chosen_by_its_metric_not_its_accuracy(
    metric, accuracy_first
):
    """CoLA's dev steps are chosen by MCC, MRPC's and QQP's by F1, as MeZO's
    ``default_dev_objective`` chooses them, whatever order a record holds its metrics in:
    accuracy would choose step 2 here, the task's metric step 4."""
    from distzo.job.summary import best_eval, run_summary

    def dev(step: int, accuracy: float, score: float) -> dict:
        figures = [("dev_accuracy", accuracy), (f"dev_{metric}", score)]
        return {"step": step, **dict(figures if accuracy_first else figures[::-1])}

    records = [dev(2, 0.75, 0.1), dev(4, 0.7, 0.4), dev(6, 0.7, 0.4)]
    assert best_eval(records) == {"by": f"dev_{metric}", **records[1]}  # the earliest
    end = {"step": 4, "eval_accuracy": 0.6, f"eval_{metric}": 0.3}
    summary = run_summary({}, 4, {}, [], [records[0], records[1], end], {})
    assert summary["dev"]["best"]["by"] == f"dev_{metric}"
    assert summary["eval"]["best"] == {"by": f"dev_{metric}", **end}
    assert best_eval([end]) == {"by": f"eval_{metric}", **end}


def test_a_run_whose_first_dev_records_lack_the_metric_is_chosen_by_theirs():
    """A resumed run whose first session scored accuracy alone (an earlier distzo) keeps
    choosing by accuracy: a step chosen by MCC among the later records alone would skip
    the first session's steps."""
    from distzo.job.summary import best_eval

    records = [{"step": 2, "dev_accuracy": 0.8}, {"step": 4, "dev_mcc": 0.5, "dev_accuracy": 0.6}]
    assert best_eval(records) == {"by": "dev_accuracy", **records[0]}
