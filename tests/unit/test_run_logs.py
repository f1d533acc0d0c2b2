"""Rank 0's logs and the dashboard they feed: a resumed run's TensorBoard holds each step
once, as metrics.jsonl does, with the values of the run that went on."""

import sys
import threading

import pytest

from distzo.job.reporting import make_reporter
from distzo.job.run_logs import RunLogs, read_records


def session(run_dir, resume_step, steps, lr, eval_at):
    reporter = make_reporter("tensorboard", run_dir, {})
    logs = RunLogs(run_dir, run_dir, resume_step, {"seed": 0}, reporter=reporter)
    for step in steps:
        logs.write("metrics", {"step": step, "loss": 1.0 / (step + 1), "lr": lr})
        logs.write("seeds", {"step": step})
        if step + 1 in eval_at:
            logs.write_eval(step + 1, {"eval_loss": 0.5})
    logs.close()


def test_a_resumed_run_reports_each_step_once_with_the_values_it_kept(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # Logged steps 0..3 and an evaluation after 2 (a run diverged at step 4 keeps 2 steps,
    # the logs cut back), then resumed after 2 steps with another lr.
    session(tmp_path, 0, range(4), lr=1.0, eval_at={2})
    session(tmp_path, 2, range(2, 5), lr=0.5, eval_at=set())
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    lrs = [(e.step, e.value) for e in events.Scalars("train/lr")]
    assert lrs == [(0, 1.0), (1, 1.0), (2, 0.5), (3, 0.5), (4, 0.5)]  # steps 2, 3 were twice
    assert [r["step"] for r in read_records(tmp_path / "metrics.jsonl")] == list(range(5))
    assert [e.step for e in events.Scalars("eval/loss")] == [2]  # the kept one, not purged


def test_logs_that_fail_to_open_leave_no_thread_nor_file_open(tmp_path, monkeypatch):
    # The seed log's header on a full disk: its syncer thread, which holds the file, was
    # left running, one more with each Trainer retried in the same process.
    import os
    import threading
    from pathlib import Path

    from distzo.job import seed_log

    def full(path, mode="r"):  # the kernel's full disk
        return open("/dev/full" if Path(path).name == "seedlog.jsonl" else path, mode)

    def open_files() -> list[str]:
        names = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                names.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:  # the listing's own descriptor
                pass
        return [n for n in names if n == "/dev/full" or n.startswith(str(tmp_path))]

    monkeypatch.setattr(seed_log, "open", full, raising=False)
    threads, files = set(threading.enumerate()), open_files()
    with pytest.raises(OSError, match="No space left on device"):
        RunLogs(tmp_path, tmp_path, 0, {"seed": 0})
    assert [t.name for t in set(threading.enumerate()) - threads] == []
    assert open_files() == files


def test_a_steps_metrics_rate_its_tokens_and_link_bytes_by_its_wall_time(monkeypatch):
    """``tokens_per_s`` and ``link_gb_per_s`` are the step's tokens and the bytes it moved
    over the host link, each divided by the step's seconds (``step_s``)."""
    import torch

    from distzo.engine import StepResult
    from distzo.job import records

    meter = records.StepMeter("sft", link_bytes=5 * 10**9, device=torch.device("cpu"))
    clock = iter([100.0, 102.5])  # the step starts at 100 s and ends at 102.5 s
    monkeypatch.setattr(records.time, "perf_counter", lambda: next(clock))
    meter.start()
    result = StepResult(3, 1.0, 1.1, 0.9, 0.5, 1e-3, 640, (0.5,))
    record = meter.record(3, result, tokens=1000)
    assert record["step_s"] == 2.5
    assert record["tokens_per_s"] == pytest.approx(400.0)
    assert record["link_gb_per_s"] == pytest.approx(2.0)


def test_a_dashboard_closed_before_it_started_closes_quietly(tmp_path):
    pytest.importorskip("tensorboard")
    make_reporter("tensorboard", tmp_path, {}).close()  # a build failed before start
    assert not (tmp_path / "tensorboard").exists()


def test_a_wandb_run_is_the_run_directorys_however_named_and_logs_each_step(tmp_path, monkeypatch):
    import json
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "helpers" / "fake_wandb"))
    monkeypatch.setenv("FAKE_WANDB_LOG", str(tmp_path / "calls.jsonl"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    try:
        for named in (Path("run"), tmp_path / "run"):  # a resume may name it either way
            make_reporter("wandb", named, {}).log({"loss": 1.5}, step=7)
    finally:  # the stand-in leaves no module a later test would import as wandb
        for name in [n for n in sys.modules if n.partition(".")[0] == "wandb"]:
            del sys.modules[name]
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    inits = [c["id"] for c in calls if c["call"] == "init"]
    assert len(inits) == 2 and inits[0] == inits[1]
    assert [c["step"] for c in calls if c["call"] == "log"] == [7, 7]


def test_a_state_evaluated_again_otherwise_replaces_its_record_in_place(tmp_path):
    """A requeue that changes --max-new-tokens scores the finished run's final state again;
    eval.jsonl kept the older record of that step, so the summary drawn from it and the next
    requeue's report gave the stale figure. The newer record takes the old one's place."""
    from distzo.job.run_end import recorded_evals

    session(tmp_path, 0, range(4), lr=1.0, eval_at={2, 4})
    logs = RunLogs(tmp_path, tmp_path, 4, {"seed": 0})
    logs.write_eval(4, {"eval_loss": 0.5})  # the same figures: not repeated
    assert (tmp_path / "eval.jsonl").read_text().count('"step": 4') == 1
    logs.write_eval(4, {"eval_loss": 0.25})  # scored otherwise: replaced where it stood
    logs.write_eval(4, {"dev_loss": 0.75})  # another split of the step: a record of its own
    logs.close()
    assert read_records(tmp_path / "eval.jsonl") == [
        {"step": 2, "eval_loss": 0.5},
        {"step": 4, "eval_loss": 0.25},
        {"step": 4, "dev_loss": 0.75},  # written through the handle reopened on the new file
    ]
    assert recorded_evals(tmp_path / "eval.jsonl", 4, ("eval",)) == {"eval": {"eval_loss": 0.25}}
    assert not (tmp_path / "eval.jsonl.tmp").exists()
    assert (tmp_path / "eval.jsonl").read_text().count("\n\n") == 0  # no empty line added


def test_a_state_evaluated_twice_in_one_session_is_one_record(tmp_path):
    """--max-steps 0 evaluates step 0 before and after training: one record, and the
    later of two other figures in its place."""
    logs = RunLogs(tmp_path, tmp_path, 0, {"seed": 0})
    logs.write_eval(0, {"eval_loss": 0.5})
    logs.write_eval(0, {"eval_loss": 0.5})
    logs.write_eval(1, {"eval_loss": 0.5})
    logs.write_eval(1, {"eval_loss": 0.25})
    logs.close()
    assert read_records(tmp_path / "eval.jsonl") == [
        {"step": 0, "eval_loss": 0.5},
        {"step": 1, "eval_loss": 0.25},
    ]


def test_a_record_cut_from_the_log_by_hand_is_written_again_on_replacing(tmp_path):
    session(tmp_path, 0, range(4), lr=1.0, eval_at={2, 4})
    logs = RunLogs(tmp_path, tmp_path, 4, {"seed": 0})
    eval_log = tmp_path / "eval.jsonl"
    eval_log.write_text(eval_log.read_text().splitlines(keepends=True)[0])  # step 4's cut
    logs.write_eval(4, {"eval_loss": 0.25})
    logs.close()
    assert read_records(eval_log) == [{"step": 2, "eval_loss": 0.5}, {"step": 4, "eval_loss": 0.25}]


class DashboardStandIn:
    """A dashboard's points by metric as its reader shows them: a purging one (TensorBoard)
    drops its points from a session's start step on, as ``purge_step`` has its readers do."""

    def __init__(self, purges: bool) -> None:
        self.purges = purges
        self.points: dict[str, list[tuple[int, float]]] = {}

    def start(self, resume_step: int) -> None:
        if self.purges and resume_step:
            self.drop_from(resume_step)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.points.setdefault(name, []).append((step, value))

    def drop_from(self, step: int) -> None:
        self.points = {k: [p for p in v if p[0] < step] for k, v in self.points.items()}

    def close(self) -> None:
        pass


def _rescored(tmp_path, dashboard, new_figures):
    """A finished run of 4 steps (evaluated after 2 and 4), then a requeue that scores its
    final state again: with other figures (--max-new-tokens changed), or the same."""
    logs = RunLogs(tmp_path, tmp_path, 0, {"seed": 0}, reporter=dashboard)
    for step in range(4):
        logs.write("metrics", {"step": step, "loss": 1.0})
        if step + 1 in (2, 4):
            logs.write_eval(step + 1, {"eval_loss": 0.5})
    logs.close()
    logs = RunLogs(tmp_path, tmp_path, 4, {"seed": 0}, reporter=dashboard)
    logs.write_eval(4, new_figures)
    logs.close()


@pytest.mark.parametrize("figures", [{"eval_loss": 0.25}, {"eval_loss": 0.5}])
def test_a_rescored_state_is_one_point_of_the_latest_figures_on_tensorboard(tmp_path, figures):
    """The requeue reported step 4's kept figure when it began (its purge had dropped it),
    then the new one beside it: two points at step 4, the stale one first."""
    dashboard = DashboardStandIn(purges=True)
    _rescored(tmp_path, dashboard, figures)
    assert dashboard.points["eval/loss"] == [(2, 0.5), (4, figures["eval_loss"])]
    assert dashboard.points["train/loss"] == [(s, 1.0) for s in range(4)]


def test_wandb_keeps_its_logged_figure_of_a_rescored_state_and_a_warning_says_so(tmp_path, caplog):
    dashboard = DashboardStandIn(purges=False)  # wandb ignores a step below its last one
    with caplog.at_level("WARNING", logger="distzo.train"):
        _rescored(tmp_path, dashboard, {"eval_loss": 0.25})
    assert dashboard.points["eval/loss"] == [(2, 0.5), (4, 0.5)]  # not sent to be dropped
    assert (
        "--report-to: the dashboard keeps the earlier eval figures of step 4 (it cannot "
        "replace a logged step); eval.jsonl and summary.json hold the new ones"
    ) in caplog.text


def test_tensorboards_reader_shows_a_rescored_state_once_with_its_new_figure(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _rescored(tmp_path, make_reporter("tensorboard", tmp_path, {}), {"eval_loss": 0.25})
    # each session's reporter is started by its RunLogs; the first one's closed by its close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [(2, 0.5), (4, 0.25)]
    assert [e.step for e in events.Scalars("train/loss")] == [0, 1, 2, 3]


def test_wandb_is_not_warned_of_a_state_scored_again_with_the_same_figures(tmp_path, caplog):
    """Only a replaced figure is one the dashboard keeps stale; the same figures are no news."""
    dashboard = DashboardStandIn(purges=False)
    with caplog.at_level("WARNING", logger="distzo.train"):
        _rescored(tmp_path, dashboard, {"eval_loss": 0.5})
    assert "--report-to" not in caplog.text
    assert dashboard.points["eval/loss"] == [(2, 0.5), (4, 0.5)]


def test_tensorboard_dropping_a_step_closes_its_earlier_writer(tmp_path):
    """Each rescored state opens a new events file: the one before is flushed and closed,
    its writer thread ended, not left open to the run's end."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    threads = threading.active_count()
    reporter = make_reporter("tensorboard", tmp_path, {})
    assert reporter is not None
    reporter.start(0)
    reporter.log({"eval/loss": 0.5}, 1)
    [first_file] = (tmp_path / "tensorboard").iterdir()
    reporter.drop_from(2)
    first = EventAccumulator(str(first_file))
    first.Reload()  # the first file, written out whole before the second began
    assert [(e.step, e.value) for e in first.Scalars("eval/loss")] == [(1, 0.5)]
    reporter.close()
    assert threading.active_count() == threads
