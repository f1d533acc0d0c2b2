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


@pytest.mark.parametrize(
    "script, argv, message",
    [
        ("bandwidth", ["--quick", "--repeats", "-1"], "argument --repeats: must be >= 1, got -1"),
        ("bandwidth", ["--quick", "--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
        ("bandwidth", ["--quick", "--bytes", "64M"], "--bytes: '64M' is not a size"),
        ("bandwidth", ["--quick", "--bytes", "2"], "--bytes: '2' holds no fp32 element"),
        ("throughput", ["--quick", "--steps", "-1"], "argument --steps: must be >= 1, got -1"),
        ("throughput", ["--quick", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
        ("throughput", ["--quick", "--slots", "0"], "argument --slots: must be >= 1, got 0"),
        ("throughput", ["--quick", "--layers", "0"], "argument --layers: must be >= 1, got 0"),
        ("throughput", ["--quick", "--threads", "0"], "argument --threads: must be >= 1, got 0"),
        ("throughput", ["--num-queries", "0"], "argument --num-queries: must be >= 1, got 0"),
        ("throughput", ["--quick", "--grad-accum", "2,0"], "--grad-accum: must be >= 1, got 0"),
        ("throughput", ["--quick", "--grad-accum", "8"], "--grad-accum counts must be at most"),
        ("throughput", ["--micro-batch-rows", "4,x"], "--micro-batch-rows: 'x' is not an integer"),
        ("throughput", ["--micro-batch-rows", "0"], "--micro-batch-rows: must be >= 1, got 0"),
        ("noise", ["--quick", "--repeats", "-1"], "argument --repeats: must be >= 1, got -1"),
        ("noise", ["--quick", "--elements", "-5"], "argument --elements: must be >= 1, got -5"),
        ("noise", ["--quick", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
        ("noise", ["--quick", "--warps", "4,x"], "--warps: 'x' is not an integer"),
        ("noise", ["--quick", "--warps", "0"], "--warps: must be >= 1, got 0"),
    ],
)
def test_a_bad_count_is_one_line_before_any_measurement(monkeypatch, capsys, script, argv, message):
    """A count of 0 or less was taken for the default (0) or failed after the first
    measurements with a traceback (-1: no median of no samples)."""
    with benchmark_script(script) as module, pytest.raises(SystemExit) as exit_info:
        entry = module.parse_args if hasattr(module, "parse_args") else module.main
        monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
        entry()
    assert exit_info.value.code not in (0, None)
    err = capsys.readouterr().err.strip().splitlines()
    text = str(exit_info.value.code) if isinstance(exit_info.value.code, str) else err[-1]
    assert message in text and "Traceback" not in "\n".join(err)


def test_sizes_read_decimal_and_binary_units():
    from distzo.bench.arguments import byte_size

    assert [byte_size(t) for t in ("64MB", "1GB", "1GiB", "4096", "1.5kb")] == [
        64 * 10**6,
        10**9,
        2**30,
        4096,
        1500,
    ]
    for bad in ("64M", "1 TB", "-3MB", "", "GB"):
        with pytest.raises(ValueError, match="is not a size"):
            byte_size(bad)
