"""Counts in the lines a user reads take the singular for one: a one-step run's last line
said "done: 1 steps", its replay "replayed 1 steps"."""

import logging

from distzo.job.run_end import Session, report_run_end
from distzo.job.run_logs import RunLogs
from distzo.runtime.units import counted


def test_one_is_singular_and_every_other_count_plural():
    assert [counted(n, "step") for n in (0, 1, 2)] == ["0 steps", "1 step", "2 steps"]
    assert counted(1, "launched rank") == "1 launched rank"


def test_a_one_step_runs_last_line_says_1_step(tmp_path, caplog):
    logs = RunLogs(tmp_path, tmp_path, 0, {"seed": 0})
    logs.write("metrics", {"step": 0, "loss": 1.0})
    logs.write_eval(1, {"eval_loss": 0.5})
    logs.close()
    evals = ({"eval_loss": 0.75}, {"eval_loss": 0.5})
    session = Session(start_step=0, steps=1, seconds=0.5, tokens=100)
    with caplog.at_level(logging.INFO, logger="distzo.train"):
        report_run_end(tmp_path, logs, {}, session, evals, tmp_path / "export", {})
    done = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("done:"))
    assert done.startswith("done: 1 step in 0.5 s (200 tokens/s); eval loss 0.7500")


def test_a_one_gpu_one_row_plan_and_a_one_block_engine_say_it_in_the_singular():
    """``plan_report --nproc 1`` headed its plan "1 GPUs on one node ... (1 ranks)", and a
    one-block engine's line said "1 blocks"."""
    import torch

    from distzo import ZOConfig, ZOEngine
    from distzo.engine.parts import describe
    from distzo.job import plan_report
    from tests.helpers.models import tiny_opt

    argv = "--model-config opt-125m --nproc 1 --batch-size 1 --eval-batch-size 1 --seq-len 64"
    head = plan_report.report(plan_report._parser().parse_args(argv.split())).splitlines()
    assert head[0].startswith("opt-125m, 1 GPU on one node, ")
    assert "1 row x 64 tokens per forward" in head[0]
    assert "host, per node (1 rank):" in head
    engine = ZOEngine(tiny_opt(seed=0, num_hidden_layers=1), ZOConfig(device="cpu", seed=0))
    assert ", 1 block, 3 slots, " in describe(engine, torch.float32)
