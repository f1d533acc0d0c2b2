"""The benchmarks run in their --quick form and write reports that match the schema."""

import functools
import json
import os
import re
import subprocess
import sys
import tarfile

import pytest
import torch

from distzo.bench import validate_report
from tests.helpers.launch import child_env, free_port, run_python
from tests.helpers.rows import SST2_SAMPLE, SST2_SAMPLE_MISSING


def run(args, nproc=1, timeout=240):
    if nproc == 1:
        command = [sys.executable, *args]
    else:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            *args,
        ]
    proc = run_python(command, child_env(), timeout)  # a fork server's child where it can be
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def load(path):
    data = json.loads(path.read_text())
    validate_report(data)
    assert path.with_suffix(".md").read_text().startswith(data["benchmark"])
    return data


@pytest.mark.parametrize("nproc", [2])  # rank 0 measures the one-rank layouts too
def test_bandwidth_quick_report(tmp_path, nproc):
    out = tmp_path / "bandwidth.json"
    run(["benchmarks/bandwidth.py", "--quick", "--out", str(out)], nproc)
    data = load(out)
    names = {
        (m["name"], m["params"].get("transfer"), m["params"]["dtype"]) for m in data["measurements"]
    }
    for dtype in ("fp32", "bf16"):
        assert ("engine_upload", "naive", dtype) in names and (
            "engine_offload",
            "naive",
            dtype,
        ) in names
    if nproc == 2:
        assert ("engine_upload", "sliced", "fp32") in names
        assert any(m["name"] == "all_gather" for m in data["measurements"])
    assert any(k.startswith("upload_vs_bare_h2d[") for k in data["derived"])
    assert any(k.startswith("slice_time_ratio[") for k in data["derived"])
    model = run(
        ["benchmarks/model.py", "--bandwidth", str(out), "--shape", "opt-13b", "--max-n", "4"]
    )
    assert "| 4 |" in model.stdout


@pytest.mark.parametrize("nproc", [2])  # rank 0 measures the one-rank layouts too
def test_throughput_quick_report(tmp_path, nproc):
    out = tmp_path / "throughput.json"
    run(["benchmarks/throughput.py", "--quick", "--out", str(out)], nproc)
    data = load(out)
    names = [m["name"] for m in data["measurements"]]
    assert names[:4] == ["resident", "offload_serial", "offload_2slots", "offload"]
    for m in data["measurements"]:
        assert m["metrics"]["tokens_per_s"] > 0 and 0 < m["metrics"]["eta"] <= 1.0001
        # on CPU the phases run in turn, so the stream model's period is never above the
        # measured one
        assert (
            0 < m["metrics"]["model_ms_per_block"] <= m["metrics"]["pipelined_ms_per_block"] * 1.05
        )
    assert {
        m["params"]["slots"] for m in data["measurements"] if m["name"].startswith("offload")
    } >= {1, 2, 3}
    assert "offload_vs_resident" in data["derived"] and "offload_vs_2slots" in data["derived"]
    if nproc == 2:
        assert {"pertp", "ddp"} <= set(names)
        assert "pertp_vs_1_rank" in data["derived"]


def test_throughput_sweep_reports_every_point_and_the_crossover(tmp_path):
    out = tmp_path / "throughput.json"
    run(
        [
            "benchmarks/throughput.py",
            "--quick",
            "--sweep",
            "1x8,2x16",
            "--num-queries",
            "2",
            "--optimizers",
            "sgd,adam",
            "--micro-batch-rows",
            "1",
            "--steps",
            "1",  # one timed step a layout: the --micro-batch-rows layout's cost back
            "--out",
            str(out),
        ]
    )
    data = load(out)
    # --micro-batch-rows 1: offload again, one row a micro-batch, against offload, at the
    # points it splits (a batch of one row is the whole batch again)
    rows1 = [m for m in data["measurements"] if m["name"] == "offload_rows1"]
    assert [(m["params"]["batch"], m["params"]["micro_batch_rows"]) for m in rows1] == [(2, 1)]
    assert "rows1_vs_offload[2x16]" in data["derived"]
    assert not any(key.endswith("[1x8]") for key in data["derived"] if key.startswith("rows1"))
    # the memory ratio where the whole batch's step grew the RSS at all (a ratio to 0 is none)
    whole = next(
        m for m in data["measurements"] if m["name"] == "offload" and m["params"]["batch"] == 2
    )
    grew = whole["metrics"]["step_extra_rss_gb"] > 0
    assert ("rows1_peak_memory_vs_offload[2x16]" in data["derived"]) == grew
    assert {m["params"]["queries"] for m in data["measurements"]} == {2}
    # Adam's two fp32 moments cross the link with every block: three times SGD's bytes
    assert data["derived"]["adam_link_bytes_vs_sgd[1x8]"] == pytest.approx(3.0)
    adam = next(m for m in data["measurements"] if m["name"] == "offload_adam")
    assert adam["params"]["optimizer"] == "adam" and adam["metrics"]["state_host_gb"] > 0
    points = {(m["name"], m["params"]["batch"], m["params"]["seq"]) for m in data["measurements"]}
    for name in ("resident", "offload_serial", "offload"):
        assert {(name, 1, 8), (name, 2, 16)} <= points
    assert {"offload_vs_resident[1x8]", "offload_vs_resident[2x16]"} <= set(data["derived"])
    ratios = [data["derived"][f"offload_vs_resident[{p}]"] for p in ("1x8", "2x16")]
    crossover = data["derived"].get("crossover_tokens_per_step")
    # The crossover is the first point (by tokens) from which every point reaches 0.95.
    expected = 8.0 if min(ratios) >= 0.95 else (32.0 if ratios[1] >= 0.95 else None)
    assert crossover == expected


def test_a_malformed_sweep_is_one_clear_line():
    command = [sys.executable, "benchmarks/throughput.py", "--quick", "--sweep", "8by512"]
    proc = run_python(command, child_env(), 60)
    assert proc.returncode != 0 and "is not BATCHxSEQ" in proc.stderr


def test_the_gpu_session_script_refuses_an_unknown_stage_before_running_any(tmp_path):
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_session.sh", "tests", "throughpt"],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env({"OUT": str(tmp_path)}),
    )
    assert proc.returncode == 2 and "unknown stage throughpt" in proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing ran, nothing was packed


def test_a_dry_run_of_the_gpu_session_lists_each_runs_command_and_limit(tmp_path):
    # what a lease would run, at no device time: brief's stages one by one, then a peers stage
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_session.sh", "tests-brief", "noise-brief", "noise-rounding"]
        + ["peers-1.3b", "profile-qwen3", "optimizers-brief"],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env({"OUT": str(tmp_path), "DRY_RUN": "1"}),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = [line for line in proc.stdout.splitlines() if line.startswith("+ python3")]
    assert len(runs) == 6, proc.stdout[-2000:]
    assert runs[0].startswith("+ python3 -m pytest -m cuda")
    assert runs[0].endswith("(at most 200 s; dry run)")
    assert "benchmarks/noise.py" in runs[1] and "--warps 4,8,16,32" in runs[1]
    assert "--ops rounding,rounding-fp16,rounding-fp8,rebuild-round,update-fp16" in runs[2]
    assert "benchmarks/peers.py --shape opt-1.3b --batch 1 --seq 2048" in runs[3]
    # the kernels of the 0.97x-of-resident miss: into the archive's profiles folder
    assert "benchmarks/peers.py --shape qwen3-1.7b --batch 1 --seq 2048 --dtype fp16" in runs[4]
    assert "--systems distzo-resident,distzo-offload,distzo-offload-double" in runs[4]
    assert re.search(r"--distzo-profile-dir \S+/profiles-qwen3-1\.7b ", runs[4]), runs[4]
    # --micro-batch-rows's peak device memory beside the streamed moments, within its bound
    assert "--micro-batch-rows 2 " in runs[5] and runs[5].endswith("(at most 125 s; dry run)")
    stages = "tests-brief-noise-brief-noise-rounding-peers-1.3b-profile-qwen3-optimizers-brief"
    archive = tmp_path / f"results-{stages}.tgz"
    assert archive.is_file()
    assert not (tmp_path / "noise.json").exists()  # nothing ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="here the stage would run for real")
def test_the_gpu_session_script_packs_its_archive_when_a_stage_fails(tmp_path):
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_session.sh", "peers-1.3b"],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env({"OUT": str(tmp_path)}),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    with tarfile.open(tmp_path / "results-peers-1.3b.tgz") as archive:
        member = archive.extractfile("./peers.log")
        assert member is not None
        log = member.read().decode()
    assert "--device cuda, but torch sees no CUDA device" in log and "!! exit 1" in log
    assert (tmp_path / "peers.log").read_text() == log  # the log comes back beside it


@pytest.mark.skipif(torch.cuda.is_available(), reason="here nvidia-smi names the real card")
@pytest.mark.parametrize("card_mib", [None, 143771])
def test_the_qwen3_peers_stage_interleaves_8b_only_on_a_card_that_holds_it(tmp_path, card_mib):
    """Without nvidia-smi (or on an 80 GB card) the 8B peers run one at a time; on a card
    of 100 GB or more (an H200's 143771 MiB, from a stand-in nvidia-smi) they interleave.
    A dry run: the stage's choice is in the commands it lists (running them on a CPU only
    failed each in a fresh interpreter; a run that fails is packed's test, above)."""
    env = {"OUT": str(tmp_path / "out"), "DRY_RUN": "1"}
    if card_mib is not None:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\necho {card_mib}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
        env["PATH"] = f"{bin_dir}:{os.environ['PATH']}"
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_session.sh", "peers-qwen3"],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(env),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = [line for line in proc.stdout.splitlines() if line.startswith("+ python3")]
    assert len(runs) == 2, proc.stdout[-2000:]
    small, eight = runs
    assert "--shape qwen3-1.7b --batch 1 --seq 2048 --dtype fp16" in small
    assert "--one-at-a-time" not in small
    # where compute >= transfer, the master's upcast and rounding off the compute stream
    assert "distzo-resident,distzo-offload,distzo-offload-double" in small
    assert "--shape qwen3-8b --batch 1 --seq 2048 --dtype fp16" in eight
    assert ("--one-at-a-time" in eight) == (card_mib is None)
    assert (tmp_path / "out" / "results-peers-qwen3.tgz").is_file()


def test_schema_rejects_a_broken_report(tmp_path):
    out = tmp_path / "bandwidth.json"
    run(["benchmarks/bandwidth.py", "--quick", "--dtypes", "fp32", "--out", str(out)])
    data = json.loads(out.read_text())
    data["measurements"][0]["median_s"] = data["measurements"][0]["max_s"] * 2
    with pytest.raises(ValueError, match="min <= median <= max"):
        validate_report(data)
    with pytest.raises(ValueError, match="schema_version"):
        validate_report(dict(data, schema_version=0))
    first = data["measurements"][0]
    first["median_s"] = first["min_s"]
    assert len(first["samples_s"]) == first["repeats"]  # every repeat's time, kept
    validate_report(data)
    first["samples_s"] = first["samples_s"][1:]
    with pytest.raises(ValueError, match=r"samples_s must be one time >= 0 per repeat"):
        validate_report(data)


def test_throughput_compares_the_head_at_labels_with_the_full_head(tmp_path):
    out = tmp_path / "head.json"
    run(["benchmarks/throughput.py", "--quick", "--compare-head", "--out", str(out)])
    data = load(out)
    names = {m["name"] for m in data["measurements"]}
    assert names == {"step_at_labels", "step_full", "eval_full", "eval_at_labels"}
    assert data["derived"]["step_full_over_at_labels"] > 0
    peaks = {
        m["name"]: m["metrics"]["eval_peak_extra_gb"]
        for m in data["measurements"]
        if m["name"].startswith("eval")
    }
    # the full float32 log-softmax is never smaller
    assert peaks["eval_full"] >= peaks["eval_at_labels"]


def test_noise_benchmark_compares_old_and_new_paths(tmp_path):
    out = tmp_path / "noise.json"
    run(["benchmarks/noise.py", "--quick", "--out", str(out)])
    data = load(out)
    names = {m["name"] for m in data["measurements"]}
    ops = ("perturb", "update", "update-tiled", "window", "momentum", "momentum-tiled", "adam")
    ops += ("rebuild-perturb",)
    ops += ("rebuild-perturb-tiled", "rebuild-round", "rebuild-round-tiled")
    ops += ("perturb-fp16", "perturb-fp16-chunked", "update-fp16", "update-fp16-chunked")
    ops += ("rounding", "rounding-fp16", "rounding-fp8")
    assert names == {f"{op}_{path}" for op in ops for path in ("old", "new", "torch")} | {
        "step_old",
        "step_new",
    }
    assert all(
        m["metrics"]["elements_per_s"] > 0 for m in data["measurements"] if "op" in m["params"]
    )
    backends = {
        m["name"]: m["params"]["noise_backend"]
        for m in data["measurements"]
        if m["name"].startswith("step")
    }
    assert backends["step_old"] == "legacy" and backends["step_new"] in ("c", "torch")
    assert {f"{op}_new_over_old_speed" for op in (*ops, "step")} == data["derived"].keys()


def test_each_noise_op_times_what_its_name_says(monkeypatch):
    """``rounding-fp16`` once timed the update of a model held in fp16 (its name holds
    "-fp16"): each rounding op rounds a float32 bucket into its own format, the write-backs
    round into their bf16 blocks, and no other op rounds; an op without a runner is refused."""
    from benchmarks import noise

    rounded = []
    real = noise.round_keyed_

    def spy(dst, src, *args):
        rounded.append((dst.dtype, src.dtype, src.numel()))
        return real(dst, src, *args)

    monkeypatch.setattr(noise, "round_keyed_", spy)
    n = 4096
    for op in noise.BYTES:
        rounded.clear()
        noise.op_runner(op, "new", torch.device("cpu"), n, 1000)()
        if op in noise.WIRE:
            expected = [(noise.WIRE[op], torch.float32, n)]
        elif op.startswith("rebuild-round"):  # the CPU's write-back: upcast, update, round
            expected = [(torch.bfloat16, torch.float32, n)]
        else:
            expected = []
        assert rounded == expected, op
    with pytest.raises(ValueError, match="no runner for op 'rounding-fp32'"):
        noise.op_runner("rounding-fp32", "new", torch.device("cpu"), n, 1000)


def test_noise_benchmark_times_the_named_ops_alone(tmp_path):
    # --ops: those ops and no step (a lease's minute for the rounding kernels); a name that
    # is no op is refused before any work, nothing written
    out = tmp_path / "noise.json"
    run(["benchmarks/noise.py", "--quick", "--ops", "rounding-fp16", "--out", str(out)])
    names = {m["name"] for m in load(out)["measurements"]}
    assert names == {f"rounding-fp16_{path}" for path in ("old", "new", "torch")}
    command = [sys.executable, "benchmarks/noise.py", "--quick", "--ops", "rounding,roundng"]
    command += ["--out", str(tmp_path / "bad.json")]
    proc = run_python(command, child_env(), 120)
    assert proc.returncode == 2
    assert "--ops: no op roundng; pick from perturb, update" in proc.stderr
    assert not (tmp_path / "bad.json").exists()


def test_noise_benchmark_times_launch_shapes_only_on_a_gpu(tmp_path):
    # --warps times the Triton kernels' launches: on a CPU it is refused before any work
    command = [sys.executable, "benchmarks/noise.py", "--quick", "--warps", "8,16"]
    command += ["--device", "cpu", "--out", str(tmp_path / "noise.json")]
    proc = run_python(command, child_env(), 120)
    assert proc.returncode == 2
    assert "--warps times the Triton kernels' launches on a GPU" in proc.stderr
    assert not (tmp_path / "noise.json").exists()


@pytest.mark.slow
@pytest.mark.skipif(not (SST2_SAMPLE / "train.tsv").is_file(), reason=SST2_SAMPLE_MISSING)
def test_the_learning_recipe_runs_and_reports_its_curve(tmp_path, smollm2_dir):
    out = tmp_path / "learning.json"
    proc = run(
        [
            "benchmarks/learning.py",
            "--quick",
            "--objectives",
            "classification",
            "--model-dir",
            str(smollm2_dir),
            "--data",
            str(SST2_SAMPLE),
            "--out",
            str(out),
        ],
        timeout=600,
    )
    data = load(out)
    steps = [m["params"]["step"] for m in data["measurements"]]
    assert steps == [0, 2, 4] and {m["params"]["objective"] for m in data["measurements"]} == {
        "classification"
    }
    assert all(0 <= m["metrics"]["eval_accuracy"] <= 1 for m in data["measurements"])
    assert "--objective classification" in data["measurements"][0]["params"]["command"]
    assert "held-out accuracy" in proc.stdout


def test_throughput_with_an_adapter_uploads_the_base_and_offloads_nothing(tmp_path):
    out = tmp_path / "throughput.json"
    run(
        [
            "benchmarks/throughput.py",
            "--quick",
            "--peft",
            "lora-fa",
            "--dual-forward",
            "--out",
            str(out),
        ]
    )
    data = load(out)
    offloaded = [m for m in data["measurements"] if m["params"]["mode"] == "offload"]
    assert offloaded and all(
        m["params"]["peft"] == "lora-fa" and m["params"]["dual_forward"] for m in offloaded
    )
    assert all(
        m["metrics"]["offload_ms_per_block"] == 0 and m["metrics"]["upload_ms_per_block"] > 0
        for m in offloaded
    )


def test_throughput_compares_full_tuning_with_lora_fa_and_its_batched_passes(tmp_path):
    out = tmp_path / "adapters.json"
    run(
        [
            "benchmarks/throughput.py",
            "--quick",
            "--compare-adapters",
            "--num-queries",
            "2",
            "--sweep",
            "1x8,2x8",
            "--steps",
            "1",
            "--out",
            str(out),
        ]
    )
    data = load(out)
    layouts = {(m["name"], m["params"]["batch"]): m["params"] for m in data["measurements"]}
    names = ["full", "lora_fa", "lora_fa_dual", "lora_fa_queries", "lora_fa_dual_queries"]
    assert sorted(layouts) == sorted((name, b) for name in names for b in (1, 2))
    full, dual_queries = layouts[("full", 1)], layouts[("lora_fa_dual_queries", 1)]
    assert full["peft"] == "none" and not full["dual_forward"] and not full["batch_queries"]
    assert (
        dual_queries["peft"] == "lora-fa"
        and dual_queries["dual_forward"]
        and dual_queries["batch_queries"]
    )
    assert all(p["queries"] == 2 for p in layouts.values())
    # B alone is trained
    assert 0 < layouts[("lora_fa", 1)]["trained_params"] < full["trained_params"]
    for point in ("1x8", "2x8"):
        for ratio in (
            "lora_fa_vs_full",
            "dual_vs_lora_fa",
            "queries_vs_lora_fa",
            "dual_queries_vs_lora_fa",
        ):
            assert data["derived"][f"{ratio}[{point}]"] > 0


def test_compare_adapters_refuses_layout_flags_of_its_own(tmp_path):
    command = [sys.executable, "benchmarks/throughput.py", "--quick", "--compare-adapters"]
    proc = run_python([*command, "--peft", "lora"], child_env(), 120)
    assert proc.returncode != 0 and "--compare-adapters runs its own layouts" in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(not (SST2_SAMPLE / "train.tsv").is_file(), reason=SST2_SAMPLE_MISSING)
def test_the_time_to_accuracy_race_reports_and_continues(tmp_path, smollm2_dir):
    out = tmp_path / "race.json"
    command = [
        "benchmarks/learning.py",
        "--quick",
        "--time-to-accuracy",
        "--recipes",
        "lora-fa",
        "--seeds",
        "0",
        "--no-sweep",
        "--thresholds",
        "0.0,1.01",
        "--model-dir",
        str(smollm2_dir),
        "--data",
        str(SST2_SAMPLE),
        "--out",
        str(out),
    ]
    run(command, timeout=600)
    data = load(out)
    assert [m["params"]["step"] for m in data["measurements"]] == [0, 2, 4]
    assert [m["metrics"]["forward_passes"] for m in data["measurements"]] == [0, 4, 8]
    assert "--peft lora-fa" in data["measurements"][0]["params"]["command"]
    derived = data["derived"]
    # every accuracy is >= 0.0, none is >= 1.01: reached at step 0 by the one seed, never
    assert derived["reached_0.00[lora-fa]"] == 1 and derived["passes_to_0.00[lora-fa]"] == 0
    assert derived["reached_1.01[lora-fa]"] == 0 and "passes_to_1.01[lora-fa]" not in derived
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    # a second race reads the finished run instead of training again
    again = run(command, timeout=120)
    assert "finished before, read" in again.stdout and "+ " not in again.stdout
    assert load(out)["derived"] == derived


def test_a_ratio_to_a_step_that_grew_no_memory_is_left_out():
    """A small step's RSS may not grow at all: its ratio was a ZeroDivisionError that ended
    the whole sweep (the whole-batch offload at 2 x 16 under --micro-batch-rows 1)."""
    from types import SimpleNamespace

    from benchmarks.throughput import Bench
    from distzo.bench import BenchReport, Measurement

    def measured(**metrics: float) -> Measurement:
        return Measurement("offload", {}, 1, 1.0, 1.0, 1.0, 0.0, metrics)

    bench = SimpleNamespace(report=BenchReport("throughput", "cpu", 1), points=[(2, 16), (4, 16)])
    bench.ratio_key = functools.partial(Bench.ratio_key, bench)
    base = {
        (2, 16): measured(tokens_per_s=100.0, step_extra_rss_gb=0.0),
        (4, 16): measured(tokens_per_s=100.0, step_extra_rss_gb=0.5),
    }
    runs = {point: measured(tokens_per_s=90.0, step_extra_rss_gb=0.25) for point in base}
    ratios = {"rows1_vs_offload": "tokens_per_s", "rows1_memory": "step_extra_rss_gb"}
    Bench.derive_against(bench, base, runs, ratios)
    assert bench.report.derived == {
        "rows1_vs_offload[2x16]": 0.9,
        "rows1_vs_offload[4x16]": 0.9,
        "rows1_memory[4x16]": 0.5,
    }
