"""The Trainer in process: a few steps of the default tiny job, its state read back, and
a run stopped by a callback that a second Trainer resumes onto the uninterrupted run's
weights, bit for bit."""

import os
from pathlib import Path

import pytest
import torch

from distzo.config.job import resolve
from distzo.job.trainer import Trainer, TrainerCallback
from tests.helpers.rows import sst2_like, write_jsonl

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


def test_a_resume_keeps_no_parse_of_the_seed_log_once_caught_up(tmp_path):
    """A resume reads the whole seed log (its noise, the steps to catch up with) once, and
    only the steps past its checkpoint matter after that: the parse, a dict per step,
    stayed cached for the rest of the run (330 MB of host memory on a log of half a
    million steps)."""
    from distzo.job import seed_log

    out = tmp_path / "run"
    first = Trainer(job(out, "--save-steps", "4", "--no-save-async"), callbacks=[StopAt(6)])
    with first, pytest.raises(RuntimeError, match="stopped at step 6"):
        first.train()
    seed_log._read_seed_log_cached.cache_clear()  # an earlier test's read
    with Trainer(job(out, "--resume")) as second:
        second.build()  # the checkpoint of step 4, then steps 4-5 from the seed log
        assert second.step == 6
        assert seed_log._read_seed_log_cached.cache_info().currsize == 0


@pytest.mark.parametrize(
    "flags, environ, threads",
    [
        ([], {}, 1),
        (["--threads", "2"], {"OMP_NUM_THREADS": "1"}, 2),
        ([], {"OMP_NUM_THREADS": "3"}, 3),
    ],
)
def test_a_cpu_run_takes_one_thread_unless_told(
    tmp_path, monkeypatch, caplog, flags, environ, threads
):
    # PyTorch's own default is every core; a CPU run sets its count before any model, and
    # gives the caller's back when it closes (a notebook's later work ran on one thread).
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        with (
            caplog.at_level("INFO", logger="distzo.train"),
            Trainer(job(tmp_path, *flags)) as trainer,
        ):
            trainer.build()
            assert torch.get_num_threads() == threads
        assert torch.get_num_threads() == 4  # the caller's count again once closed
    finally:
        torch.set_num_threads(before)
    logged = [r.getMessage() for r in caplog.records if "CPU threads" in r.getMessage()]
    assert len(logged) == 1 and logged[0].startswith(f"CPU threads per rank: {threads} (")


def test_a_single_process_run_says_it_runs_as_one_rank(tmp_path, caplog):
    # every single-process run's third line said "1 ranks as dp 1 x pert 1"
    with caplog.at_level("INFO", logger="distzo.train"), Trainer(job(tmp_path)) as trainer:
        trainer.build()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run ")]
    assert said == [f"run {tmp_path}: seed 0; 1 rank as dp 1 x pert 1"]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_checkpoint_is_published_only_after_the_seed_log_reaches_it(
    tmp_path, monkeypatch, asynchronous
):
    """A power loss keeps what was synced: a checkpoint renamed into place before the seed
    log on disk held its steps would be refused by every resume (a checkpoint ahead of its
    log). With the log synced only at close, each rename must still find it synced."""
    from distzo.job import seed_log

    synced_steps = [0]
    real_fsync = seed_log.os.fsync

    def fsync(fd: int) -> None:  # os.fsync itself: DCP's writer syncs its files too
        real_fsync(fd)
        log = tmp_path / "run" / "seedlog.jsonl"
        if log.exists() and os.fstat(fd).st_ino == log.stat().st_ino:
            synced_steps.append(sum('"step"' in line for line in log.read_text().splitlines()))

    published: list[tuple[int, int]] = []
    real_rename = Path.rename

    def rename(self: Path, target):
        if self.name.startswith("step-") and self.name.endswith(".tmp"):
            published.append((int(Path(target).name.removeprefix("step-")), max(synced_steps)))
        return real_rename(self, target)

    monkeypatch.setattr(seed_log.os, "fsync", fsync)
    monkeypatch.setattr(Path, "rename", rename)
    save = ["--save-steps", "3", "--log-sync-steps", "1000"]
    save += [] if asynchronous else ["--no-save-async"]
    with Trainer(job(tmp_path / "run", *save)) as trainer:
        trainer.train()
    assert [steps for steps, _ in published] == [3, 6, STEPS]
    assert all(synced >= steps for steps, synced in published), published


def test_a_failed_trainer_says_so_when_trained_again(tmp_path):
    # It trained again from its first step with the engine where it had stopped: the seed
    # log held steps 0-1 twice and the engine ended 2 steps past --max-steps.
    failing = Trainer(job(tmp_path / "run", "--max-steps", "3"), callbacks=[StopAt(2)])
    with failing:
        with pytest.raises(RuntimeError, match="stopped at step 2"):
            failing.train()
        with pytest.raises(RuntimeError, match="run failed after 2 steps; make a new Trainer"):
            failing.train()
    assert failing.engine.step_index == 2


def test_a_closed_trainer_says_so_when_trained_again(tmp_path):
    with Trainer(job(tmp_path / "run", "--max-steps", "1")) as trainer:
        trainer.train()
    with pytest.raises(RuntimeError, match="run is closed after 1 step; make a new Trainer"):
        trainer.train()


class SaveAt(TrainerCallback):
    """Saves from inside the run, after ``step``: what a tool steering a run does."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict) -> None:
        if step == self.step:
            trainer.save()


def test_save_outside_a_running_trainer_is_one_line(tmp_path):
    """save() before build() was an AttributeError; after Diverged it wrote a checkpoint of
    the update that diverged, which the seed log (cut back) ends before: --resume then
    refused the run directory. Both refused; a callback's save inside the run still works."""
    from distzo.job.divergence import Diverged

    trainer = Trainer(job(tmp_path / "run", "--lr", "1e12", "--batch-size", "4"))
    with pytest.raises(RuntimeError, match=r"save\(\): this Trainer's run is not built") as early:
        trainer.save()
    # a fresh Trainer goes on with train(), not with a new Trainer (its advice once)
    assert "new Trainer" not in str(early.value) and "after train()" in str(early.value)
    with pytest.raises(AttributeError, match=r"Trainer.checkpointer: build\(\) makes it"):
        trainer.checkpointer.wait()  # not None's "has no attribute 'wait'"
    with trainer, pytest.raises(Diverged):
        trainer.train()
    with pytest.raises(RuntimeError, match=r"save\(\): this Trainer's run failed after 0 steps"):
        trainer.save()
    assert not list((tmp_path / "run" / "checkpoints").glob("step-*"))
    steered = Trainer(job(tmp_path / "steered", "--max-steps", "2"), callbacks=[SaveAt(0)])
    with steered:
        steered.train()
    assert (tmp_path / "steered" / "checkpoints" / "step-1").is_dir()
    with pytest.raises(RuntimeError, match="run is closed after 2 steps; make a new Trainer"):
        steered.save()


def test_a_failed_run_completes_a_save_however_long_its_write_takes(tmp_path, monkeypatch):
    """Closing a failed run waited 120 s for the save in flight, then deleted its
    ``step-N.tmp`` while the writer was still in it: a large model on a slow disk lost the
    checkpoint, and the process waited for the writer's thread at exit all the same. Here
    the bound (where it still exists) is cut to a fraction of the write."""
    import time

    from distzo.job import checkpoint
    from distzo.job import trainer as trainer_module

    write_data = checkpoint.HostStateWriter.write_data

    def slow(self, plan, planner):  # a write longer than the old bound
        time.sleep(1.0)
        return write_data(self, plan, planner)

    monkeypatch.setattr(checkpoint.HostStateWriter, "write_data", slow)
    monkeypatch.setattr(trainer_module, "CLOSE_SAVE_TIMEOUT_S", 0.1, raising=False)
    run = tmp_path / "run"
    failing = Trainer(job(run, "--save-steps", "4"), callbacks=[StopAt(5)])
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with failing:
            with pytest.raises(RuntimeError, match="stopped at step 5"):
                failing.train()
            assert failing.checkpointer.in_flight  # the save is still being written
            assert torch.get_num_threads() == 3  # the caller's threads back all the same
    finally:
        torch.set_num_threads(before)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-4"]
    assert not (run / ".distzo.lock").exists()


def test_a_failed_run_whose_closing_fails_too_raises_its_own_failure(tmp_path, caplog):
    """The same full disk may fail the logs' close: said, not raised over the failure
    that stopped the run (which the caller must see)."""
    from distzo.job.run_logs import RunLogs

    failing = Trainer(job(tmp_path / "run"), callbacks=[StopAt(2)])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RunLogs, "close", lambda self: (_ for _ in ()).throw(OSError("disk full")))
        with pytest.raises(RuntimeError, match="stopped at step 2"):
            failing.train()
    assert "closing the failed run: disk full" in caplog.text
    failing.close()


def test_a_second_trainer_in_a_launched_process_is_refused_in_one_line(tmp_path):
    # Under torchrun, a second Trainer in the same process failed in build, with torch's
    # "trying to initialize the default process group twice!".
    import torch.distributed as dist

    from distzo.dist import LaunchEnv

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="under torchrun a process trains one job"):
            Trainer(job(tmp_path / "run"), env=LaunchEnv(launched=True))
    finally:
        dist.destroy_process_group()
    assert not (tmp_path / "run").exists()


def _seed_log_threads() -> int:
    import threading

    return sum(thread.name == "seedlog-fsync" for thread in threading.enumerate())


def test_a_failed_run_gives_the_process_back_without_close(tmp_path):
    """A notebook's Ctrl-C (or a sweep's diverged lr) left the trainer's logs open, the seed
    log's thread running and torch's CPU thread count at the run's 1 until close(): a sweep
    that went on ran every later cell on one thread, even after closing later trainers."""
    from distzo.job.divergence import Diverged

    class Interrupt(TrainerCallback):
        def on_step_end(self, trainer: Trainer, step: int, metrics: dict) -> None:
            raise KeyboardInterrupt

    before, threads = torch.get_num_threads(), _seed_log_threads()
    torch.set_num_threads(3)
    try:
        interrupted = Trainer(job(tmp_path / "interrupted"), callbacks=[Interrupt()])
        with pytest.raises(KeyboardInterrupt):
            interrupted.train()
        assert torch.get_num_threads() == 3
        assert interrupted.logs is not None and interrupted.logs.closed
        assert _seed_log_threads() == threads
        assert not (tmp_path / "interrupted" / ".distzo.lock").exists()
        diverging = Trainer(job(tmp_path / "diverged", "--lr", "1e12", "--batch-size", "4"))
        with pytest.raises(Diverged):
            diverging.train()
        assert torch.get_num_threads() == 3
        with Trainer(job(tmp_path / "next", "--max-steps", "1")) as trainer:
            trainer.train()
        assert torch.get_num_threads() == 3  # the caller's, not the diverged run's 1
    finally:
        torch.set_num_threads(before)


def test_a_trainer_retried_after_a_refused_start_gives_the_callers_threads_back(tmp_path):
    """A start refused in build() (the directory held by an earlier Trainer of this process)
    kept the run's count: retried once the holder closed, it took that count for the
    caller's, and the notebook ran on one thread after both were closed."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        holder = Trainer(job(tmp_path / "run"))
        # made before the holder builds: its validation, which refuses a held directory at
        # once, passes, and the build finds the directory taken
        second = Trainer(job(tmp_path / "run", "--overwrite", "--max-steps", "1"))
        holder.build()
        with pytest.raises(ValueError, match="another Trainer of this process holds it"):
            second.train()
        holder.close()
        assert torch.get_num_threads() == 3
        with second:
            second.train()
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("phase", ["_plan_memory", "_evaluate"])
def test_a_preemption_before_the_first_step_stops_at_once(tmp_path, monkeypatch, caplog, phase):
    """SIGTERM while the model is built (or evaluated before training) stopped the job only
    after the build, the evaluation and a first step; it now stops it there, and a fresh
    run leaves no directory that the same command would be refused for."""
    import signal

    from distzo.job.preemption import EXIT_PREEMPTED
    from distzo.job.run_build import _Build
    from distzo.train import main

    owner = _Build if phase == "_plan_memory" else Trainer  # the build's, or the trainer's
    original = getattr(owner, phase)
    reached = []

    def signalled(self, *args):
        signal.raise_signal(signal.SIGTERM)
        reached.append("after the signal")  # what a deferred stop would go on to
        return original(self, *args)

    monkeypatch.setattr(owner, phase, signalled)
    out = tmp_path / "run"
    flags = ["--max-steps", "2", "--device", "cpu", "--output-dir", str(out)]
    assert main(flags) == EXIT_PREEMPTED
    assert reached == []
    assert (
        "preempted: stopped before training on SIGTERM; no step was trained in this "
        "session; the same command starts it again" in caplog.text
    )
    assert not out.exists()
    monkeypatch.setattr(owner, phase, original)
    assert main(flags) == 0  # the same command


def _wait_for_abandoned_saves(timeout: float = 60.0) -> None:
    """Let a save abandoned by a second Ctrl-C finish writing: a later test's in-process
    ``main()`` would otherwise exit the test process at once (tests/conftest.py)."""
    import time

    from distzo.job import checkpoint

    deadline = time.monotonic() + timeout
    while checkpoint.saves_being_written() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_ctrl_c_while_close_waits_for_a_save_still_gives_the_run_back(tmp_path, monkeypatch):
    """In a notebook, a run stopped by Ctrl-C leaves its asynchronous save for close(); a
    second Ctrl-C during that wait left the seed log open (unsynced), the directory locked
    and torch's thread count at the run's. The save is abandoned (its step-N.tmp never
    counts), the rest given back, and a new Trainer resumes from the seed log."""
    import signal
    import threading
    import time

    from distzo.job import checkpoint

    write_data = checkpoint.HostStateWriter.write_data

    def slow(self, plan, planner):  # a large model's write, longer than the user's patience
        time.sleep(2.0)
        return write_data(self, plan, planner)

    class Interrupt(TrainerCallback):
        def on_step_end(self, trainer: Trainer, step: int, metrics: dict) -> None:
            if step == 5:
                raise KeyboardInterrupt

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.HostStateWriter, "write_data", slow)
    previous = signal.signal(signal.SIGUSR2, interrupt)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    run = tmp_path / "run"
    try:
        stopped = Trainer(job(run, "--save-steps", "4"), callbacks=[Interrupt()])
        with pytest.raises(KeyboardInterrupt):
            stopped.train()
        assert stopped.checkpointer.in_flight and not stopped.closed  # left for close()
        main = threading.main_thread().ident
        assert main is not None
        threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGUSR2)).start()
        with pytest.raises(KeyboardInterrupt):
            stopped.close()
        assert stopped.logs is not None and stopped.logs.closed
        assert not (run / ".distzo.lock").exists()
        assert torch.get_num_threads() == 3
    finally:
        signal.signal(signal.SIGUSR2, previous)
        torch.set_num_threads(before)
        _wait_for_abandoned_saves()
    monkeypatch.undo()
    resumed = Trainer(job(run, "--resume", "auto"))
    with resumed:
        resumed.train()
    assert resumed.start_step == 6  # the seed log's six steps, no checkpoint completed


def test_logs_that_fail_to_close_still_give_the_callers_threads_back(tmp_path):
    """close() on a full disk: the logs' close raised, and torch's thread count stayed the
    run's for everything the notebook ran after."""
    from distzo.job.run_logs import RunLogs

    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        trainer = Trainer(job(tmp_path / "run"))
        trainer.build()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(RunLogs, "close", lambda self: (_ for _ in ()).throw(OSError("full")))
            with pytest.raises(OSError, match="full"):
                trainer.close()
        assert torch.get_num_threads() == 3 and trainer.closed
        assert not (tmp_path / "run" / ".distzo.lock").exists()
    finally:
        torch.set_num_threads(before)


def test_a_save_that_fails_to_complete_on_close_is_said_not_raised(caplog):
    """A save whose write fails as close() completes it (a full disk: an OSError) is said;
    the logs still close and the run is given back, the failure under way (if any) the one
    raised."""
    from types import SimpleNamespace

    from distzo.job.run_resources import RunResources

    def wait() -> None:
        raise OSError(28, "No space left on device")

    held = RunResources()
    held.checkpointer = SimpleNamespace(in_flight=True, wait=wait)
    with caplog.at_level("WARNING", logger="distzo.train"):
        held.close()
    assert held.closed
    assert "could not be completed: [Errno 28] No space left on device" in caplog.text


def test_logs_that_fail_to_close_still_follow_the_save_they_wait_for():
    """close() on a full disk: the save in flight is completed before the logs close, so
    logs whose close raises still leave the checkpoint renamed into place, not its
    ``step-N.tmp`` with a writer still in it."""
    from types import SimpleNamespace

    from distzo.job.run_resources import RunResources

    done: list[str] = []

    def close() -> None:
        done.append("logs")
        raise OSError(28, "No space left on device")

    held = RunResources()
    held.checkpointer = SimpleNamespace(in_flight=True, wait=lambda: done.append("save"))
    held.logs = SimpleNamespace(close=close)
    with pytest.raises(OSError, match="No space left"):
        held.close()
    assert done == ["save", "logs"] and held.closed


def test_the_run_directory_stays_locked_until_its_summary_is_written(tmp_path, monkeypatch):
    """A finished run unlocked its directory only after its summary and curves: another job
    taking it sooner would find a run without them (or race their write)."""
    from distzo.job import run_finish

    run, seen = tmp_path / "run", []
    report = run_finish.report_run_end

    def spying(*args, **kwargs):
        seen.append(((run / ".distzo.lock").exists(), (run / "rank0.json").exists()))
        return report(*args, **kwargs)

    monkeypatch.setattr(run_finish, "report_run_end", spying)
    with Trainer(job(run, "--max-steps", "2")) as trainer:
        trainer.train()
        assert seen == [(True, True)]
        assert not (run / ".distzo.lock").exists() and (run / "summary.json").exists()


def test_a_build_that_fails_closes_the_dashboard_it_started(tmp_path, monkeypatch):
    """A run whose memory plan refuses it (after rank 0's dashboard started) closes the
    dashboard: a wandb run left open would show a live run that never logs, and the next
    Trainer in the process would log into it."""
    from distzo.job import run_build

    closed = []

    class Dashboard:
        def start(self, resume_step: int) -> None: ...

        def log(self, scalars: dict, step: int) -> None: ...

        def close(self) -> None:
            closed.append(True)

    def refused(*_args):
        raise ValueError("does not fit")

    monkeypatch.setattr(run_build, "make_reporter", lambda *_args: Dashboard())
    monkeypatch.setattr(run_build, "check_fits", refused)
    trainer = Trainer(job(tmp_path / "run", "--report-to", "tensorboard"))
    with pytest.raises(ValueError, match="does not fit"):
        trainer.build()
    assert closed == [True]
    assert not (tmp_path / "run").exists()  # a fresh run's directory is given back


def test_a_drawn_seed_is_the_one_config_toml_records(tmp_path):
    """``--seed -1`` has rank 0 draw the run seed; config.toml, which ``--config`` repeats a
    run from, records the seed drawn, not -1 (which would draw another)."""
    run = tmp_path / "run"
    trainer = Trainer(job(run, "--seed", "-1", "--max-steps", "1"))
    with trainer:
        trainer.build()
    assert trainer.seed != -1
    assert f"\nseed = {trainer.seed}\n" in (run / "config.toml").read_text()


@pytest.mark.parametrize("at", [2, 4], ids=["periodic", "final"])
def test_a_signal_during_an_evaluation_stops_it_at_its_next_batch_and_the_run_resumes_exactly(
    tmp_path, monkeypatch, caplog, at
):
    """An evaluation of a long eval set (minutes at scale) ran to its end after a SIGTERM,
    past a cluster's grace period, so the kill cut the run off unrequeued; it now stops
    before its next forward call, logs nothing, and a resume evaluates there again and
    reaches the uninterrupted run's evaluations and weights bit for bit."""
    import json
    import signal

    from distzo.engine import ZOEngine
    from distzo.job.preemption import EXIT_PREEMPTED
    from distzo.train import main

    data = write_jsonl(tmp_path / "rows.jsonl", sst2_like(12))
    common = ["--task", "sst2", "--train-file", data, "--eval-file", data, "--eval-batch-size", "2"]
    common += ["--batch-size", "4", "--max-steps", "4", "--eval-steps", "2", "--device", "cpu"]
    common += ["--log-every", "0", "--save-on-signal"]
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    assert main([*common, "--output-dir", str(full)]) == 0
    original, calls = ZOEngine.evaluate, []

    def signalled(self, measure):
        if self.step_index == at:
            calls.append(self.step_index)
            if len(calls) == 1:
                signal.raise_signal(signal.SIGTERM)
        return original(self, measure)

    monkeypatch.setattr(ZOEngine, "evaluate", signalled)
    assert main([*common, "--output-dir", str(stopped)]) == EXIT_PREEMPTED
    assert len(calls) == 1  # the call under way; the old code made all 12
    assert "SIGTERM received: stopping the " in caplog.text
    assert "before its next batch" in caplog.text

    def evals(run: Path) -> list[dict]:
        return [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]

    assert [e["step"] for e in evals(stopped)] == [0, 2][: 1 + (at == 4)]
    monkeypatch.setattr(ZOEngine, "evaluate", original)
    assert main([*common, "--output-dir", str(stopped), "--resume", "yes"]) == 0
    assert evals(stopped) == evals(full)
    exported = (full / "export" / "model.safetensors").read_bytes()
    assert (stopped / "export" / "model.safetensors").read_bytes() == exported


def test_a_signal_during_the_final_evaluations_last_batch_stops_before_the_export(
    tmp_path, monkeypatch
):
    """A signal in the last forward call of the final evaluation, past every vote the
    evaluation takes: the vote after it stops the run before the export (minutes at scale),
    which a resume writes."""
    import signal

    from distzo.engine import ZOEngine
    from distzo.job.preemption import EXIT_PREEMPTED
    from distzo.train import main

    data = write_jsonl(tmp_path / "rows.jsonl", sst2_like(12))  # an evaluation of 12 engine calls
    flags = ["--task", "sst2", "--train-file", data, "--eval-file", data, "--eval-batch-size"]
    flags += ["2", "--batch-size", "4", "--max-steps", "2", "--device", "cpu", "--log-every"]
    flags += ["0", "--output-dir", str(tmp_path / "run")]
    original, calls = ZOEngine.evaluate, []

    def signalled(self, measure):
        calls.extend([self.step_index] if self.step_index == 2 else [])
        if len(calls) == 12:  # the last
            signal.raise_signal(signal.SIGTERM)
        return original(self, measure)

    monkeypatch.setattr(ZOEngine, "evaluate", signalled)
    assert main(flags) == EXIT_PREEMPTED
    assert len(calls) == 12 and not (tmp_path / "run" / "export").exists()


class SaveLog(TrainerCallback):
    """Records each save's step count."""

    def __init__(self) -> None:
        self.saves: list[int] = []

    def on_save(self, trainer: Trainer, step: int, asynchronous: bool) -> None:
        self.saves.append(step)


def test_a_run_whose_last_step_is_a_save_step_saves_it_once(tmp_path):
    """The final save holds the last step: a periodic one there too wrote the whole model
    twice (minutes at scale), step-4 "written" twice in the log."""
    log = SaveLog()
    flags = ("--max-steps", "4", "--save-steps", "2", "--no-save-async", "--eval-steps", "0")
    with Trainer(job(tmp_path, *flags), callbacks=[log]) as trainer:
        trainer.train()
    assert log.saves == [2, 4]


class SignalAt(TrainerCallback):
    """Sends this process SIGTERM as step ``step`` starts."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        if step == self.step:
            import signal

            signal.raise_signal(signal.SIGTERM)


@pytest.mark.parametrize("after", [["--save-steps", "2", "--no-save-async"], ["--eval-steps", "2"]])
def test_a_signal_in_a_step_after_a_save_or_evaluation_says_it_waits_for_the_step(
    tmp_path, caplog, after
):
    """Once a periodic save or evaluation is over, a signal's line is the step's again."""
    from distzo.job.preemption import Preempted, StopSignals

    flags = ("--max-steps", "4", "--eval-steps", "0", *after)
    with Trainer(job(tmp_path, *flags), callbacks=[SignalAt(2)]) as trainer:
        with StopSignals() as signals, pytest.raises(Preempted, match="after step 2"):
            trainer.train(signals)
    assert "SIGTERM received: stopping after the step under way" in caplog.text


class SignalInFinalSave(TrainerCallback):
    """Sends this process SIGTERM as the final checkpoint (a synchronous one) is saved."""

    def on_save(self, trainer: Trainer, step: int, asynchronous: bool) -> None:
        if step == trainer.job.optim.max_steps:
            import signal

            signal.raise_signal(signal.SIGTERM)


def test_a_signal_in_the_final_save_stops_before_the_final_evaluation(tmp_path, caplog):
    from distzo.job.preemption import Preempted, StopSignals

    with Trainer(job(tmp_path, "--max-steps", "2"), callbacks=[SignalInFinalSave()]) as trainer:
        with StopSignals() as signals, pytest.raises(Preempted, match="after step 1"):
            trainer.train(signals)
    assert trainer.eval_after is None and not (tmp_path / "export").exists()
    assert "SIGTERM received: stopping once the final checkpoint is written (a resume " in (
        caplog.text
    )


def test_a_signal_during_the_export_says_the_run_ends_once_it_is_written(
    tmp_path, monkeypatch, caplog
):
    """Past the last vote nothing stops the run: its line says so, not "after the step"."""
    import signal

    from distzo.job.preemption import StopSignals
    from distzo.job.run_finish import RunFinish

    summary = RunFinish._write_rank_summary

    def signalled(self, after):
        signal.raise_signal(signal.SIGTERM)
        return summary(self, after)

    monkeypatch.setattr(RunFinish, "_write_rank_summary", signalled)
    with Trainer(job(tmp_path, "--max-steps", "2")) as trainer, StopSignals() as signals:
        trainer.train(signals)
    assert (tmp_path / "export" / "model.safetensors").is_file()
    assert "SIGTERM received: the run ends once its export is written" in caplog.text


def test_a_signal_during_a_save_stops_after_it_without_another_step_or_save(
    tmp_path, monkeypatch, caplog
):
    """A SIGTERM while a checkpoint of minutes was written let the run take one more step
    and, with --save-on-signal, write a second checkpoint: twice the write in the grace
    period. The save under way holds every step done: the run now stops right after it."""
    import signal

    from distzo.job import checkpoint
    from distzo.job.preemption import EXIT_PREEMPTED
    from distzo.train import main

    write_data = checkpoint.HostStateWriter.write_data

    def signalled(self, plan, planner):
        signal.raise_signal(signal.SIGTERM)
        return write_data(self, plan, planner)

    monkeypatch.setattr(checkpoint.HostStateWriter, "write_data", signalled)
    out = tmp_path / "run"
    flags = ["--max-steps", "6", "--save-steps", "2", "--no-save-async", "--save-on-signal"]
    flags += ["--device", "cpu", "--log-every", "0", "--output-dir", str(out)]
    assert main(flags) == EXIT_PREEMPTED
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]
    assert "SIGTERM received: stopping once the checkpoint under way is written" in caplog.text
    assert "stopped after step 1 on SIGTERM; 2 steps done" in caplog.text


def test_main_ends_the_process_only_for_a_save_its_own_run_abandoned(monkeypatch):
    """``main()`` ends the process at once when its run left a save being written (a second
    Ctrl-C): the interpreter would otherwise join the writer at exit. Called again from
    Python, a later ``main()`` (here one refused at once) took an earlier run's save for its
    own and ended the process (a notebook's kernel, pytest) with its exit code."""
    from concurrent.futures import Future

    from distzo import train
    from distzo.job import checkpoint

    def ended(code):
        raise AssertionError(f"main() ended the process with {code}")

    monkeypatch.setattr(train, "_exit_at_once", ended)
    earlier = Future()  # an earlier run's save, still being written
    checkpoint._ASYNC_SAVES.add(earlier)
    try:
        assert train.main(["--lr", "-1"]) == 2  # bad input: one line, exit code 2
    finally:
        earlier.set_result(None)


@pytest.mark.parametrize("task", ["text", "squad"])
def test_a_signal_stops_a_text_or_generation_evaluation_at_its_next_batch(
    tmp_path, monkeypatch, task
):
    """The language-model and the generation evaluations take the stop vote too, not only
    the multiple-choice one: a signal in the final evaluation's first call stops it there."""
    import json
    import signal

    from distzo.engine import ZOEngine
    from distzo.job.preemption import EXIT_PREEMPTED
    from distzo.train import main

    if task == "text":
        rows = [{"text": f"row {i} says {'yes' if i % 2 else 'no'} to it"} for i in range(12)]
    else:
        rows = [
            {"title": "T", "context": f"Code {i}.", "question": "What?", "answers": [f"code {i}"]}
            for i in range(12)
        ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    flags = ["--task", task, "--train-file", str(data), "--eval-file", str(data)]
    flags += ["--eval-batch-size", "2", "--batch-size", "4", "--max-steps", "2"]
    flags += ["--device", "cpu", "--log-every", "0"]
    original, calls = ZOEngine.evaluate, []

    def counted(self, measure):
        if self.step_index == 2:  # the final evaluation's
            calls.append(1)
            if signalled and len(calls) == 1:
                signal.raise_signal(signal.SIGTERM)
        return original(self, measure)

    monkeypatch.setattr(ZOEngine, "evaluate", counted)
    signalled = False
    assert main([*flags, "--output-dir", str(tmp_path / "full")]) == 0
    whole, calls[:] = len(calls), []
    signalled = True
    assert main([*flags, "--output-dir", str(tmp_path / "stopped")]) == EXIT_PREEMPTED
    assert whole >= 6 and len(calls) < whole / 2, (whole, len(calls))


def test_a_handed_over_lock_is_the_callers_alone_and_a_let_go_one_is_none(tmp_path):
    """--export-best's replay holds the run directory's lock handed over at the run's end:
    the run's resources closing after that must not unlock the directory under the replay;
    a lock already let go is not handed over, so that the replay locks the directory again."""
    from distzo.job.run_claim import RunClaim
    from distzo.job.run_lock import DirectoryLocked, RunLock
    from distzo.job.run_resources import RunResources

    assert RunResources().hand_over_lock() is None  # a run that never claimed its directory
    lock = RunLock(tmp_path)
    lock.acquire()
    held = RunResources()
    held.claim = RunClaim(tmp_path, resolve([]), 0, False, lock)
    assert held.hand_over_lock() is lock
    held.release()  # the resources let go of what they hold: no longer this lock
    with pytest.raises(DirectoryLocked):
        RunLock(tmp_path).acquire()
    lock.release()
    assert held.hand_over_lock() is None
    held.claim = RunClaim(tmp_path, resolve([]), 0, False, lock)  # held no more
    assert held.hand_over_lock() is None


def test_the_trainer_declares_each_part_a_build_gives_it_with_the_parts_type():
    # build() copies RunParts' fields onto the trainer with setattr, which mypy does not
    # see: the trainer's own annotations are what it checks trainer.engine and the rest
    # against, so they must stay those of RunParts (a part added or retyped in one only
    # would leave the other wrong, silently).
    import dataclasses

    from distzo.job.run_build import RunParts

    parts = {field.name: field.type for field in dataclasses.fields(RunParts)}
    declared = {name: Trainer.__annotations__.get(name) for name in parts}
    assert declared == parts
