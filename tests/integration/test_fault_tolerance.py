"""Fault tolerance: a checkpoint plus the seed log's later steps, applied in one pass
over the blocks, is the uninterrupted trajectory bit for bit (after a killed rank, a
preemption signal or a torn log); every rank stops after the same step on a signal; a
long run keeps flat memory and K checkpoints; the dashboard holds every step."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distzo.job.seed_log import SeedLogWriter, check_same_run, read_seed_log
from tests.helpers.engines import engine_for
from tests.helpers.launch import (
    FAULTY_TRAIN,
    RESUMABLE_RUN,
    Run,
    child_env,
    free_port,
    python_train,
    run_python,
    torchrun,
    torchrun_command,
    train_in_process,
)
from tests.helpers.models import base_model, random_batch


def counted_uploads(engine):
    moved = {"upload": 0, "offload": 0}
    store = engine.streamed_store

    def counting(name, original):
        def counted(index):
            moved[name] += 1
            original(index)

        return counted

    for name in moved:
        setattr(store, name, counting(name, getattr(store, name)))
    return moved


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(num_queries=2, optimizer="momentum", momentum_window=4),
        dict(optimizer="adam", lr=1e-3),
        dict(estimator="fzoo", num_queries=3, optimizer="momentum", momentum_window=4),
    ],
    ids=["sgd", "momentum", "adam", "fzoo"],
)
def test_catching_up_with_logged_steps_is_the_uninterrupted_trajectory_in_one_pass(options):
    def build():
        return engine_for(base_model("llama"), mode="offload", num_slots=2, **options)

    full = build()
    results = [full.step(random_batch(64, pad="left", seed=i)) for i in range(12)]
    expected = full.named_parameters()

    cut = build()
    for i in range(5):
        cut.step(random_batch(64, pad="left", seed=i))
    restarted = build()
    restarted.load_state_dict(cut.state_dict())  # the checkpoint at step 5
    moved = counted_uploads(restarted)
    restarted.catch_up(
        [(r.step, r.projected_grads, r.lr) for r in results[5:9]]
    )  # steps 5-8 from the log
    blocks = len(restarted.blocks)
    assert moved == {"upload": blocks, "offload": blocks}  # one pass for the four steps
    assert restarted.step_index == 9
    rest = [restarted.step(random_batch(64, pad="left", seed=i)) for i in range(9, 12)]
    assert [r.projected_grads for r in rest] == [r.projected_grads for r in results[9:]]
    values = restarted.named_parameters()
    assert all(torch.equal(values[n], expected[n]) for n in expected)


def test_catch_up_refuses_steps_that_do_not_follow():
    engine = engine_for(base_model("opt"))
    engine.step(random_batch(64, seed=0))
    with pytest.raises(ValueError, match="logged steps must run on from step 1 in order"):
        engine.catch_up([(2, (0.1,), 1e-2)])


def write_log(path, steps=3, **header):
    writer = SeedLogWriter(path, sync_every=2)
    writer.write({"kind": "header", "run_seed": 7, **header})
    for step in range(steps):
        writer.write({"step": step, "projected_grads": [0.5 * step], "lr": 1e-3})
    writer.close()


def test_a_torn_last_line_is_dropped_with_a_warning(tmp_path, caplog):
    path = tmp_path / "seedlog.jsonl"
    write_log(path)
    whole = path.read_text()
    path.write_text(whole[: len(whole) - 9])  # a crash mid-record: the last line cut short
    header, steps = read_seed_log(path)
    assert header["run_seed"] == 7 and [s["step"] for s in steps] == [0, 1]
    assert "dropped a torn last line (line 4, no newline)" in caplog.text
    path.write_text(
        whole.replace('"lr": 0.001}\n{"step": 2', '"lr": 0.001}\n{"step": 2, "proj\n{"step": 2')
    )
    with pytest.raises(
        ValueError, match="line 4: not JSON"
    ):  # a broken line that is not the last is an error
        read_seed_log(path)


def test_a_log_of_another_run_is_refused_in_one_line(tmp_path):
    path = tmp_path / "seedlog.jsonl"
    write_log(path, optimizer={"name": "sgd"})
    header, _ = read_seed_log(path)
    check_same_run(path, header, {"run_seed": 7, "optimizer": {"name": "sgd"}})
    with pytest.raises(
        ValueError, match=r"is the log of another run \(run_seed 7, this run has 8\)"
    ) as info:
        check_same_run(path, header, {"run_seed": 8, "optimizer": {"name": "sgd"}})
    assert "\n" not in str(info.value)
    assert json.loads(path.read_text().splitlines()[0])["kind"] == "header"
    # a header from before estimators is SPSA's: an FZOO run does not go on from it
    with pytest.raises(ValueError, match=r"another run \(estimator 'spsa', this run has 'fzoo'\)"):
        check_same_run(
            path, header, {"run_seed": 7, "optimizer": {"name": "sgd"}, "estimator": "fzoo"}
        )


def test_a_header_from_an_earlier_version_is_the_run_it_was(tmp_path):
    """Headers written before noise kinds, optimizers, Adam or prefix tuning lack fields
    (or fields of the optimizer's and adapter's records): each means what that version
    ran, so the log goes on with today's record of the same run, and not with another."""
    from distzo.adapters.peft_adapters import AdapterSpec
    from distzo.config.engine_options import ZOConfig, optimizer_record

    sgd = optimizer_record(ZOConfig())
    ours = {"run_seed": 7, "noise": "legacy", "optimizer": sgd, "peft": None}
    path = tmp_path / "first.jsonl"
    write_log(path)  # the first version's: no noise, optimizer or adapter
    check_same_run(path, read_seed_log(path)[0], ours)
    with pytest.raises(ValueError, match=r"noise 'legacy', this run has 'gaussian-v1'"):
        check_same_run(path, read_seed_log(path)[0], ours | {"noise": "gaussian-v1"})
    momentum = {"name": "momentum", "beta1": 0.9, "momentum_window": 8}  # before Adam
    path = tmp_path / "momentum.jsonl"
    write_log(path, noise="legacy", optimizer=momentum)
    recomputed = optimizer_record(ZOConfig(optimizer="momentum", momentum_window=8))
    check_same_run(path, read_seed_log(path)[0], ours | {"optimizer": recomputed})
    stored = optimizer_record(ZOConfig(optimizer="momentum", optimizer_state="stored"))
    with pytest.raises(ValueError, match=r"another run \(optimizer"):
        check_same_run(path, read_seed_log(path)[0], ours | {"optimizer": stored})
    lora = {"method": "lora", "r": 8, "alpha": 16.0, "targets": None}  # before prefix tuning
    path = tmp_path / "lora.jsonl"
    write_log(path, noise="legacy", peft=lora)
    spec = AdapterSpec.from_record(lora).record()
    check_same_run(path, read_seed_log(path)[0], ours | {"peft": spec})
    with pytest.raises(ValueError, match=r"another run \(peft"):
        check_same_run(path, read_seed_log(path)[0], ours | {"peft": spec | {"r": 4}})


def test_a_killed_rank_restarts_the_job_which_catches_up_from_the_seed_log(tmp_path):
    # Rank 2 of 4 dies (SIGKILL) at step 37 of 45; torchrun restarts the job, which loads
    # the step-20 checkpoint, applies steps 20-36 from the seed log in one pass and trains
    # on: its export is the uninterrupted run's bit for bit (sliced transfer, 2 queries).
    flags = [
        "--max-steps",
        "45",
        *RESUMABLE_RUN,
        "--eval-batch-size",
        "8",
        "--save-steps",
        "20",
        "--transfer",
        "sliced",
        "--num-queries",
        "2",
    ]
    full, killed = tmp_path / "full", tmp_path / "killed"
    proc = torchrun(4, flags + ["--output-dir", str(full)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = torchrun(
        4,
        flags + ["--output-dir", str(killed)],
        env={"DISTZO_KILL_AT": "2:37"},
        max_restarts=1,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "killing rank 2 at step 37" in proc.stderr
    assert (
        "caught up with steps 20-36 from the seed log in one pass; training from step 37"
        in proc.stderr
    )
    assert Run(killed).grads == Run(full).grads  # metrics.jsonl holds every step once
    assert [
        json.loads(line)["step"] for line in (killed / "seedlog.jsonl").read_text().splitlines()[1:]
    ] == list(range(45))
    assert all(torch.equal(Run(killed).params[k], v) for k, v in Run(full).params.items())


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step_and_the_run_resumes_exactly(
    tmp_path,
):
    # Rank 1 of 2 gets SIGTERM before step 5: its stop vote rides on step 5's all-reduce,
    # both ranks stop after it, write a checkpoint (--save-on-signal) and exit 143; the
    # resumed run ends where an uninterrupted one does. Every save here is synchronous,
    # written from the live host copy (--no-save-async, and the one on the signal).
    flags = [
        "--max-steps",
        "12",
        *RESUMABLE_RUN,
        "--eval-batch-size",
        "8",
        "--dp",
        "2",
        "--save-steps",
        "4",
        "--no-save-async",
    ]
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    assert torchrun(2, flags + ["--output-dir", str(full)]).returncode == 0
    proc = torchrun(
        2,
        flags + ["--output-dir", str(stopped), "--save-on-signal"],
        env={"DISTZO_SIGNAL_AT": "1:5"},
        preload=False,
    )
    assert proc.returncode != 0
    assert "SIGTERM received: stopping after the step under way" in proc.stderr
    assert (
        "preempted: stopped after step 5 on a signal to another rank; 6 steps done" in proc.stderr
    )
    assert "exitcode  : 143" in proc.stderr
    assert [
        json.loads(line)["step"] for line in (stopped / "metrics.jsonl").read_text().splitlines()
    ] == list(range(6))
    assert sorted(p.name for p in (stopped / "checkpoints").iterdir()) == ["step-4", "step-6"]
    assert not (stopped / "export").exists()
    proc = torchrun(2, flags + ["--output-dir", str(stopped), "--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert Run(stopped).grads == Run(full).grads
    assert all(torch.equal(Run(stopped).params[k], v) for k, v in Run(full).params.items())


def test_a_signal_after_the_final_checkpoint_stops_before_the_evaluation_and_the_export(
    tmp_path,
):
    # Rank 1 gets SIGTERM once the final checkpoint is written: every rank stops there (the
    # vote is gathered after it), exits 143 with no export, and the resume evaluates and
    # exports. The stop was ignored until the run's end: the evaluation and the export ran
    # on into the cluster's kill deadline, and the job exited 0, never requeued.
    flags = ["--max-steps", "8", "--batch-size", "8", "--eval-batch-size", "8", "--dp", "2"]
    flags += ["--log-every", "0", "--seed", "5", "--output-dir", str(tmp_path)]
    proc = torchrun(2, flags, env={"DISTZO_SIGNAL_AFTER_SAVE": "1:8"})
    assert proc.returncode != 0
    assert "stopped after step 7 on a signal to another rank; 8 steps done" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-8"]
    assert not (tmp_path / "export").exists() and not (tmp_path / "summary.json").exists()
    proc = torchrun(2, flags + ["--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 0 steps" in proc.stderr and (tmp_path / "export").is_dir()
    evals = [
        json.loads(line)["step"] for line in (tmp_path / "eval.jsonl").read_text().splitlines()
    ]
    assert evals == [0, 8]


def test_a_signalled_run_with_a_torn_log_and_no_checkpoint_resumes_from_the_log_alone(tmp_path):
    # SIGTERM before step 6 of 10, no --save-on-signal and no --save-steps: the run stops
    # after step 6 (exit 143) with its seed log alone. Its last record is then torn (as a
    # crash mid-write would leave it): the resumed run drops it, catches up with steps 0-5
    # from the initial weights, trains 6-9 and ends where an uninterrupted run does.
    # A log whose header is another run's is refused in one line.
    flags = [
        "--max-steps",
        "10",
        *RESUMABLE_RUN,
        "--eval-batch-size",
        "8",
    ]
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    assert python_train(flags + ["--output-dir", str(full)]).returncode == 0
    command = [sys.executable, "-m", FAULTY_TRAIN, *flags, "--output-dir", str(stopped)]
    proc = run_python(command, child_env({"DISTZO_SIGNAL_AT": "0:6"}), 120)
    assert proc.returncode == 143 and not (stopped / "checkpoints").exists()
    log = stopped / "seedlog.jsonl"
    text = log.read_text()
    log.write_text(text[: len(text) - 20])  # step 6's record cut mid-line
    proc = python_train(flags + ["--output-dir", str(stopped), "--resume", "auto"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("dropped a torn last line") == 1  # the resume reads the log once
    assert (
        "caught up with steps 0-5 from the seed log in one pass; training from step 6"
        in proc.stderr
    )
    assert all(torch.equal(Run(stopped).params[k], v) for k, v in Run(full).params.items())

    header, *steps = log.read_text().splitlines()
    log.write_text("\n".join([header.replace('"run_seed": 5', '"run_seed": 6'), *steps]) + "\n")
    proc = train_in_process(flags + ["--output-dir", str(stopped), "--resume"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {log} is the log of another run (run_seed 6, this run has 5); resume with the "
        "options it was written with, or use a fresh --output-dir"
    )


def test_the_slurm_script_stops_at_the_time_limit_notice_requeues_and_the_requeued_job_goes_on(
    tmp_path,
):
    # launch/slurm.sbatch as sbatch runs it, with tests/helpers/fake_slurm's srun (which becomes its
    # task, as a signal to srun reaches the task) and scontrol (this host; requeues recorded):
    # the time-limit notice (SIGTERM to the batch shell alone, --signal=B:TERM) reaches both
    # ranks through srun and torchrun, the job stops after a step and requeues itself; the
    # requeued job (same id, same directory, --resume auto) ends where an uninterrupted run does.
    import signal
    import time

    repo = Path(__file__).resolve().parents[2]
    out, log = tmp_path / "slurm-out", tmp_path / "slurm.log"
    env = child_env(
        {
            "PATH": f"{repo / 'tests' / 'helpers' / 'fake_slurm'}:{os.environ['PATH']}",
            "FAKE_SLURM_LOG": str(log),
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": "node0",
            "SLURM_NNODES": "1",
            "SLURM_GPUS_ON_NODE": "2",
            "SLURM_SUBMIT_DIR": str(repo),
            "OUTPUT_DIR": str(out),
            "RDZV_PORT": str(free_port()),
        }
    )
    flags = (
        "--max-steps 100 --batch-size 8 --eval-batch-size 8 --log-every 0 --seed 5 "
        "--lr-schedule constant"
    ).split()
    job = subprocess.Popen(
        ["bash", str(repo / "launch" / "slurm.sbatch"), *flags, "--pert", "2"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while (
        not (out / "metrics.jsonl").exists()
        or len((out / "metrics.jsonl").read_text().splitlines()) < 3
    ):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    stdout, stderr = job.communicate(timeout=120)
    assert job.returncode != 0, stderr[-3000:]
    assert "stopped before the time limit" in stdout and "requeueing 4242" in stdout
    assert "preempted: stopped after step" in stderr
    stopped_after = len((out / "metrics.jsonl").read_text().splitlines())
    assert 3 <= stopped_after < 100 and not (out / "export").exists()
    assert log.read_text().splitlines()[-1] == "scontrol requeue 4242"

    requeued = subprocess.run(
        ["bash", str(repo / "launch" / "slurm.sbatch"), *flags, "--pert", "2"],
        cwd=tmp_path,
        env=dict(env, SLURM_RESTART_COUNT="1"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert f"training from step {stopped_after}" in requeued.stderr
    assert log.read_text().count("requeue") == 1
    full = tmp_path / "full"
    assert (
        python_train(flags + ["--output-dir", str(full)]).returncode == 0
    )  # 2 PertP ranks are 1 process in fp32
    assert Run(out).grads == Run(full).grads
    assert all(torch.equal(Run(out).params[k], v) for k, v in Run(full).params.items())


def test_old_checkpoints_are_deleted_oldest_first_never_a_save_in_flight(tmp_path):
    from distzo.job.checkpoint import latest_checkpoint, prune_checkpoints

    for name in ("step-10", "step-20", "step-5", "step-30", "step-40.tmp"):
        (tmp_path / name).mkdir()
    deleted = prune_checkpoints(tmp_path, keep=2)
    assert [p.name for p in deleted] == ["step-5", "step-10"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-20", "step-30", "step-40.tmp"]
    assert latest_checkpoint(tmp_path).name == "step-30"
    assert prune_checkpoints(tmp_path, keep=0) == [] and len(list(tmp_path.iterdir())) == 3


def test_the_default_4_rank_job_learns_with_flat_memory_and_at_most_k_checkpoints(tmp_path):
    # `torchrun --nproc_per_node=4 -m distzo.train`, as a user runs it (./runs/<timestamp>),
    # with a checkpoint every 100 of its 2,000 steps: it learns (accuracy from ~0 to >= 0.3,
    # loss down >= 1.5 nats; measured 4.18 -> 1.26, 0.65 on a 2-core x86-64 CPU), rank 0's
    # resident memory (VmRSS) stays within 2 % from step 200 on, and 2 checkpoints are left.
    command = torchrun_command(4, ["--save-steps", "100"], free_port())
    proc = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=child_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = list((tmp_path / "runs").iterdir())
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    first, last = evals[0], evals[-1]
    assert first["step"] == 0 and last["step"] == 2000
    assert last["eval_accuracy"] >= 0.3 and first["eval_accuracy"] < 0.1, (first, last)
    assert last["eval_loss"] < first["eval_loss"] - 1.5, (first, last)
    assert (run_dir / "export" / "model.safetensors").exists() and (
        run_dir / "config.toml"
    ).exists()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(2000))
    rss = [m["host_rss_gb"] for m in metrics[200:]]
    assert max(rss) <= 1.02 * min(rss), (min(rss), max(rss))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-1900", "step-2000"]


def test_tensorboard_holds_every_step_and_every_evaluation(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    proc = python_train(
        [
            "--max-steps",
            "6",
            "--eval-steps",
            "3",
            "--log-every",
            "0",
            "--report-to",
            "tensorboard",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "train/loss",
        "train/projected_grad",
        "train/lr",
        "train/tokens_per_s",
        "train/host_rss_gb",
        "train/link_gb_per_s",
        "eval/loss",
        "eval/accuracy",
    } <= tags
    assert [e.step for e in events.Scalars("train/loss")] == list(range(6))
    assert [e.step for e in events.Scalars("eval/accuracy")] == [0, 3, 6]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(
        [m["loss"] for m in metrics], rel=1e-6
    )


def test_a_dashboard_that_is_not_installed_is_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    proc = train_in_process(["--report-to", "wandb"])
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: --report-to wandb needs the wandb package: pip install 'distzo[wandb]', "
        "or drop --report-to"
    )


def test_wandb_gets_every_step_and_evaluation_and_a_resumed_run_continues_its_wandb_run(tmp_path):
    # tests/helpers/fake_wandb stands in for the package (wandb is not installed in CI): it records
    # the calls. A real wandb 0.31 in offline mode ran the same command by hand (docs/training.md).
    calls = tmp_path / "wandb-calls.jsonl"
    env = {
        "PYTHONPATH": str(Path(__file__).parents[1] / "helpers" / "fake_wandb"),
        "FAKE_WANDB_LOG": str(calls),
    }
    args = [
        "--max-steps",
        "4",
        "--eval-steps",
        "2",
        "--log-every",
        "0",
        "--report-to",
        "wandb",
        "--save-steps",
        "2",
        "--output-dir",
        str(tmp_path / "run"),
    ]
    for extra in ([], ["--max-steps", "6", "--resume"]):
        # both from one fork server started with the stand-in's path (tests.helpers.fork_server)
        command = [sys.executable, "-m", "distzo.train", *args, *extra]
        proc = run_python(command, child_env(env), 120)
        assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in calls.read_text().splitlines()]
    inits = [r for r in records if r["call"] == "init"]
    assert len(inits) == 2 and inits[0]["id"] == inits[1]["id"] and inits[0]["resume"] == "allow"
    assert inits[0]["dir"] == str(tmp_path / "run") and inits[0]["has_config"]
    train_steps = [r["step"] for r in records if r["call"] == "log" and "train/loss" in r["data"]]
    eval_steps = [r["step"] for r in records if r["call"] == "log" and "eval/accuracy" in r["data"]]
    assert train_steps == [0, 1, 2, 3, 4, 5] and eval_steps == [0, 2, 4, 6]
    assert [r["call"] for r in records].count("finish") == 2


def test_a_wandb_run_that_cannot_start_is_one_line_before_any_model(tmp_path):
    # wandb installed but not logged in: wandb.init's UsageError was a traceback, raised
    # after the model and the engine were built.
    env = {
        "PYTHONPATH": str(Path(__file__).parents[1] / "helpers" / "fake_wandb"),
        "FAKE_WANDB_LOG": str(tmp_path / "wandb-calls.jsonl"),
        "FAKE_WANDB_NO_KEY": "1",
    }
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "distzo.train", "--report-to", "wandb", "--output-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(env),
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.rstrip().splitlines()[-1] == (
        "error: --report-to wandb could not start its run (No API key configured. Use `wandb "
        "login` to log in.): log in (wandb login), set WANDB_MODE=offline, or drop --report-to"
    )
    assert "memory plan" not in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()  # a fresh run that never started leaves nothing to resume
