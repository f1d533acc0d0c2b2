"""The benchmark scripts' options: defaults that match what the engine runs, and bad
values refused in one line before any measurement."""

import sys

import pytest

from distzo import ZOConfig
from tests.helpers.scripts import benchmark_script


def run_main(module, argv, monkeypatch):
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *argv])
    module.main()


def test_the_projection_pipelines_the_pieces_the_engine_stripes(monkeypatch, capsys):
    """The pipelined row models the engine's sliced upload: its default piece count is the
    engine's --transfer-chunks, not another one that flatters the projection."""
    chunks = ZOConfig().transfer_chunks
    with benchmark_script("model") as model:
        run_main(model, ["--b-h2d", "50", "--b-d2h", "50", "--shape", "opt-175b"], monkeypatch)
        rows = model.project(12 * 12288**2 * 4, 50, 50, 360, chunks, 8)
    out = capsys.readouterr().out
    assert f"; {chunks} chunks" in out
    eight = next(line for line in out.splitlines() if line.startswith("| 8 |"))
    assert eight.split("|")[4].strip() == f"{rows[7]['pipelined_up_s'] * 1e3:.1f}"


@pytest.mark.parametrize("flag", ["--chunks 0", "--max-n 0", "--b-allgather 0", "--b-h2d -5"])
def test_the_projection_refuses_a_count_or_rate_out_of_range(monkeypatch, capsys, flag):
    argv = ["--b-h2d", "50", "--b-d2h", "50", *flag.split()]
    with benchmark_script("model") as model, pytest.raises(SystemExit) as exit_info:
        run_main(model, argv, monkeypatch)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"model.py: error: argument {flag.split()[0]}: must be")
