"""benchmarks/peers.py without ZO2: distzo's peers and two stand-ins speaking the protocol.

The stand-ins (tests/helpers/stand_in_peer.py) log every request on arrival and every
reply's step times, so the order the harness asked in and its statistics are checked
against what the peers actually did."""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, OPTConfig, Qwen3Config

from benchmarks import peers
from distzo.bench import validate_report
from distzo.bench.peer_protocol import END, PHASES, read_request
from tests.helpers.launch import child_env, run_python

ROOT = Path(__file__).resolve().parents[2]
BATCH, SEQ = 1, 8
TINY = ["--shape", "opt-125m", "--layers", "1", "--hidden", "64", "--batch", str(BATCH)]
TINY += ["--seq", str(SEQ), "--device", "cpu", "--threads", "1"]


def stand_in(name: str, log: Path, step_ms: float, *flags: str) -> str:
    command = [sys.executable, "-m", "tests.helpers.stand_in_peer", "--step-ms", str(step_ms)]
    return f"{name}=" + " ".join([*command, "--log", str(log), *flags])


def harness(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """``python benchmarks/peers.py ARGS``: a fork server's child where it can be."""
    return run_python([sys.executable, "benchmarks/peers.py", *args], child_env(), timeout)


def events(log: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == kind]


def assert_gone(pids: list[int]) -> None:
    """Every process ended (reaped, or at worst a zombie awaiting its parent)."""
    deadline = time.monotonic() + 10
    for pid in pids:
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                break
            time.sleep(0.1)
        else:
            assert not Path(f"/proc/{pid}").exists(), f"process {pid} outlived the harness"


def test_peers_interleave_and_report_zo2s_statistic(tmp_path):
    log, out = tmp_path / "requests.log", tmp_path / "peers.json"
    rounds, per_round = 3, 2
    proc = harness(
        *TINY,
        "--systems",
        "distzo-resident,distzo-offload,fast,slow",
        "--peer",
        stand_in("fast", log, 1),
        "--peer",
        stand_in("slow", log, 20),
        "--ratio",
        "fast/slow",
        "--warmup",
        "1",
        "--rounds",
        str(rounds),
        "--steps-per-round",
        str(per_round),
        "--out",
        str(out),
        "--distzo-profile-dir",
        str(tmp_path / "profiles"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    validate_report(data)
    assert data["benchmark"] == "peers"
    assert [m["name"] for m in data["measurements"]] == [
        "distzo-resident",
        "distzo-offload",
        "fast",
        "slow",
    ]
    assert any("ZO2 was not given" in note for note in data["notes"])
    assert "Where this differs from ZO2's own harness" in out.with_suffix(".md").read_text()

    # The rounds alternate: warm-up fast, slow, then each round fast, slow (k steps each).
    requests = sorted(events(log, "request"), key=lambda e: e["t"])
    assert [(e["system"], e["steps"]) for e in requests] == [("fast", 1), ("slow", 1)] + [
        ("fast", per_round),
        ("slow", per_round),
    ] * rounds

    # ZO2's statistic: the mean of the per-step tokens/s over the last half of the timed steps.
    by_name = {m["name"]: m for m in data["measurements"]}
    speed = {}
    for name in ("fast", "slow"):
        timed = [
            s
            for e in events(log, "reply")
            if e["system"] == name and e["n"] > 1
            for s in e["step_s"]
        ]
        assert len(timed) == rounds * per_round
        last = timed[len(timed) // 2 :]
        speed[name] = statistics.fmean(BATCH * SEQ / s for s in last)
        m = by_name[name]
        assert m["metrics"]["tokens_per_s"] == pytest.approx(speed[name], rel=1e-12)
        assert m["metrics"]["s_per_step"] == pytest.approx(statistics.fmean(last), rel=1e-12)
        assert m["median_s"] == pytest.approx(statistics.median(last), rel=1e-12)
        assert m["samples_s"] == pytest.approx(last, rel=1e-12)  # each, in the order run
        assert m["params"]["statistic_steps"] == len(last) and m["params"]["interleaved"]
    assert data["derived"]["fast_vs_slow"] == pytest.approx(speed["fast"] / speed["slow"])
    assert data["derived"]["fast_vs_slow"] > 1  # 1 ms of sleep against 20

    resident, offload = by_name["distzo-resident"], by_name["distzo-offload"]
    assert data["derived"]["distzo-offload_vs_distzo-resident"] == pytest.approx(
        offload["metrics"]["tokens_per_s"] / resident["metrics"]["tokens_per_s"]
    )
    # distzo's peers said where their step goes (the stand-ins were never asked: the
    # request log above holds step requests only); MeZO's step: 2 perturbations, 1 update
    for name in ("distzo-resident", "distzo-offload"):
        metrics = by_name[name]["metrics"]
        assert metrics["perturbs_per_block"] == 2 and metrics["updates_per_block"] == 1
        # timed in another step than the compute (each call between two syncs): at this
        # size, microseconds that a loaded machine can stretch, so no order between them
        assert metrics["noise_ms_per_block"] > 0 and metrics["compute_ms_per_block"] > 0
        assert metrics["model_ms_per_block"] >= metrics["compute_ms_per_block"]
        assert any(note.startswith(f"{name} per block: upload") for note in data["notes"])
    assert "perturbs_per_block" not in by_name["fast"]["metrics"]
    # ... and, asked to, profiled one more step each: their kernels side by side
    profiles = tmp_path / "profiles"
    assert sorted(p.name for p in profiles.iterdir()) == [
        "distzo-offload.kernels.json",
        "distzo-offload.trace.json",
        "distzo-resident.kernels.json",
        "distzo-resident.trace.json",
        "kernels.md",
    ]
    kernels = (profiles / "kernels.md").read_text()
    assert "| stream | kernel | distzo-offload ms (count) | distzo-resident ms (count) |" in kernels
    assert "| cpu | `aten::linear` |" in kernels
    assert f"its kernels per stream side by side: {profiles / 'kernels.md'}" in "".join(
        data["notes"]
    )
    # both built ZO2's model of the shape: untied head, positions for the sequence alone
    config = OPTConfig(
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=1,
        ffn_dim=256,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        expected = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert resident["metrics"]["parameters"] == offload["metrics"]["parameters"] == expected
    assert all(0 < m["metrics"]["loss"] < 20 for m in (resident, offload))
    assert_gone([e["pid"] for e in events(log, "start")])
    assert {e["system"] for e in events(log, "exit")} == {"fast", "slow"}  # EOF ended them


@pytest.mark.parametrize(
    "flag, says",
    [
        (
            "--die-at",
            "closed its stdout (exit code 3) before answering; its last stderr line: "
            "stand-in slow: dying at request 2",
        ),
        ("--garbage-at", 'printed a non-protocol line: "this line is not the protocol\'s"'),
    ],
)
def test_a_broken_peer_stops_every_peer_with_one_line(tmp_path, flag, says):
    log, out = tmp_path / "requests.log", tmp_path / "peers.json"
    args = [
        *TINY,
        "--peer",
        stand_in("fast", log, 1),
        "--peer",
        stand_in("slow", log, 1, flag, "2"),
    ]
    with pytest.raises(SystemExit) as stopped:  # the harness in this process: one import less
        peers.main([*args, "--systems", "fast,slow", "--rounds", "3", "--out", str(out)])
    line = str(stopped.value.code)
    assert line.startswith("peers.py: peer slow ") and says in line and "\n" not in line, line
    assert not out.exists()
    assert_gone([e["pid"] for e in events(log, "start")])


def test_one_at_a_time_measures_each_peer_alone_and_keeps_a_partial_report(tmp_path):
    log, out = tmp_path / "requests.log", tmp_path / "peers.json"
    args = [
        *TINY,
        "--peer",
        stand_in("fast", log, 1),
        "--peer",
        stand_in("slow", log, 1, "--die-at", "3"),
    ]
    with pytest.raises(SystemExit, match="peer slow closed its stdout"):
        peers.main(
            [*args, "--systems", "fast,slow", "--one-at-a-time", "--rounds", "4", "--warmup", "1"]
            + ["--out", str(out)]
        )
    starts = [e["system"] for e in events(log, "start")]
    assert starts == ["fast", "slow"]  # slow started once fast had ended
    fast = [e for e in events(log, "request") if e["system"] == "fast"]
    slow = [e for e in events(log, "request") if e["system"] == "slow"]
    assert len(fast) == 5 and max(e["t"] for e in fast) < min(e["t"] for e in slow)
    # what fast measured is on disk, said to be partial
    data = json.loads(out.read_text())
    validate_report(data)
    assert [m["name"] for m in data["measurements"]] == ["fast"]
    assert not data["measurements"][0]["params"]["interleaved"]
    assert any("one at a time" in note for note in data["notes"])
    assert any(note == "Partial report: slow not measured yet" for note in data["notes"])


def stop_when(proc: subprocess.Popen, says: str, timeout: float = 120) -> str:
    """The harness's stderr up to the line that holds ``says``; then SIGINT, as
    ``timeout --signal=INT`` stops a device command's run at its limit."""
    assert proc.stderr is not None
    seen, deadline = [], time.monotonic() + timeout
    for line in proc.stderr:
        seen.append(line)
        if says in line or time.monotonic() > deadline:
            break
    assert says in seen[-1], "".join(seen)[-3000:]
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=60)[1]
    return "".join(seen) + rest


def popen_harness(*args: str, ignore_sigint: bool = False) -> subprocess.Popen:
    """The harness; ``ignore_sigint``: started with SIGINT ignored, as a background command
    of a script is (pytest run that way starts it so too)."""
    handler = signal.SIG_IGN if ignore_sigint else signal.SIG_DFL
    return subprocess.Popen(
        [sys.executable, "benchmarks/peers.py", *args],
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
        preexec_fn=lambda: signal.signal(signal.SIGINT, handler),
    )


def test_a_run_stopped_while_peers_build_says_which_were_built(tmp_path):
    """A large model's run cut at its device command's limit says in its last line which
    peers were built (and in how long) and which were still building, and ends them all."""
    log, out = tmp_path / "requests.log", tmp_path / "peers.json"
    proc = popen_harness(
        *TINY,
        "--peer", stand_in("quick", log, 1, "--build-s", "0.5"),
        "--peer", stand_in("huge", log, 1, "--build-s", "600"),
        "--systems", "quick,huge", "--out", str(out),
    )  # fmt: skip
    stderr = stop_when(proc, "quick is ready (built in 0.5 s")
    assert proc.returncode == 1
    last = stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"peers\.py: Stopped \(SIGINT\) \d+ s into the run\. Built: quick in 0 s; still "
        r"building: huge; nothing measured",
        last,
    ), last
    assert not out.exists()  # a report holds measurements: the log's last line is the record
    assert_gone([e["pid"] for e in events(log, "start")])
    assert not events(log, "request")  # the built peer never stepped alone


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_a_run_stopped_while_peers_step_keeps_what_they_measured(tmp_path, sigint):
    # "ignored": as a script's background command (`cmd &`) starts, where Python raises no
    # KeyboardInterrupt; the harness then ran all 100 rounds past `timeout --signal=INT`
    log, out = tmp_path / "requests.log", tmp_path / "peers.json"
    proc = popen_harness(
        *TINY,
        "--peer", stand_in("fast", log, 1),
        "--peer", stand_in("slow", log, 300),
        "--systems", "fast,slow", "--warmup", "0", "--rounds", "100", "--out", str(out),
        ignore_sigint=sigint == "ignored",
    )  # fmt: skip
    assert proc.stderr is not None
    while len(events(log, "reply") if log.exists() else []) < 5:  # two rounds and more
        time.sleep(0.1)
    stderr = stop_when(proc, "", timeout=1)
    assert proc.returncode == 1, stderr[-2000:]
    data = json.loads(out.read_text())
    validate_report(data)
    assert {m["name"] for m in data["measurements"]} == {"fast", "slow"}
    assert all(m["params"]["timed_steps"] >= 2 for m in data["measurements"])
    stop = [n for n in data["notes"] if n.startswith("Stopped (SIGINT)")]
    # built in the order their ready lines came, which is either
    assert stop and re.search(
        r"Built: (fast in 0 s, slow in 0 s|slow in 0 s, fast in 0 s); steps not finished: "
        r"fast, slow$",
        stop[0],
    ), stop
    assert_gone([e["pid"] for e in events(log, "start")])


def test_a_bad_zo2_checkout_is_one_line_before_any_peer_starts(tmp_path):
    log = tmp_path / "requests.log"
    proc = harness(*TINY, "--peer", stand_in("fast", log, 1), "--zo2", str(tmp_path))
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"peers.py: --zo2 {tmp_path} is not a ZO2 checkout (no "
        f"{tmp_path}/zo2/optimizer/mezo_sgd/zo2.py); clone liangyuwang/zo2 and pass its folder"
    )
    assert not log.exists()  # no peer started


@pytest.mark.parametrize(
    "args, says",
    [
        (["--systems", "zo2-mezo"], "--systems zo2-mezo needs --zo2 PATH"),
        (["--systems", "fast,nope"], "unknown system 'nope'"),
        (["--systems", "fast,fast"], "names a system twice"),
        (["--ratio", "fast/nope"], "--ratio 'fast/nope' is not A/B of two systems that run"),
        (["--hidden", "100"], "--hidden 100 must be a multiple of 64"),
        (
            ["--shape", "qwen3-0.6b", "--hidden", "192"],
            "--hidden 192 must be a multiple of 128 (qwen3: 128-wide heads)",
        ),
        (["--zo2-python", "python3"], "--zo2-python and --zo2-pythonpath need --zo2 PATH"),
    ],
)
def test_bad_input_stops_before_any_peer_starts(tmp_path, args, says):
    log = tmp_path / "requests.log"
    with pytest.raises(SystemExit, match=re.escape(says)):
        peers.main([*TINY, "--peer", stand_in("fast", log, 1), *args])
    assert not log.exists()


def test_a_profile_directory_of_another_run_is_refused_before_any_peer_starts(tmp_path):
    log, profiles = tmp_path / "requests.log", tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "distzo-offload.kernels.json").write_text("{}")
    with pytest.raises(SystemExit, match="already holds profiles of another run: name a new"):
        peers.main(
            [*TINY, "--peer", stand_in("fast", log, 1), "--distzo-profile-dir", f"{profiles}"]
        )
    assert not log.exists()
    assert (profiles / "distzo-offload.kernels.json").read_text() == "{}"


def test_the_protocol_reader_refuses_a_malformed_request():
    assert read_request(io.StringIO('\n{"steps": 3}\n')) == 3
    assert read_request(io.StringIO("")) == END
    assert read_request(io.StringIO('{"phases": true}\n')) == PHASES
    with pytest.raises(ValueError, match="is not"):
        read_request(io.StringIO("steps 3\n"))
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        read_request(io.StringIO('{"steps": 0}\n'))


def qwen3_parameters(hidden: int, layers: int, seq: int) -> int:
    """ZO2's Qwen3 speed-test model at the harness's --hidden override, counted on meta."""
    config = Qwen3Config(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=hidden // 128,
        head_dim=128,
        intermediate_size=3 * hidden,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def test_a_qwen3_shape_reaches_every_peer_and_its_report(tmp_path):
    log, out = tmp_path / "requests.log", tmp_path / "peers.json"
    args = ["--shape", "qwen3-0.6b", "--layers", "1", "--hidden", "128", "--batch", "1"]
    args += ["--seq", str(SEQ), "--device", "cpu", "--threads", "1", "--warmup", "0"]
    proc = harness(
        *args,
        "--rounds",
        "2",
        "--systems",
        "distzo-offload,fast",
        "--peer",
        stand_in("fast", log, 1),
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (start,) = events(log, "start")
    assert (start["shape"], start["layers"], start["hidden"]) == ("qwen3-0.6b", 1, 128)
    data = json.loads(out.read_text())
    validate_report(data)
    by_name = {m["name"]: m for m in data["measurements"]}
    offload = by_name["distzo-offload"]
    # one 128-wide head (kv too), ffn 3 x 128, the 151,936-token vocabulary, untied
    assert offload["metrics"]["parameters"] == qwen3_parameters(128, 1, SEQ)
    assert abs(offload["metrics"]["loss"] - math.log(151936)) < 0.5  # near-uniform at init
    for m in by_name.values():
        assert m["params"]["shape"] == "qwen3-0.6b" and m["params"]["hidden"] == 128
        assert (m["params"]["layers"], m["params"]["heads"], m["params"]["kv_heads"]) == (1, 1, 1)
    assert "fast" in by_name and data["derived"] == {}  # no built-in pair ran both sides


ZO2 = Path(os.environ.get("ZO2_CHECKOUT", ROOT / ".peers" / "zo2"))
ZO2_PYTHON = Path(os.environ.get("ZO2_PYTHON", ROOT / ".peers" / "venv" / "bin" / "python"))


@pytest.mark.slow
@pytest.mark.skipif(
    not (ZO2 / "zo2" / "model" / "huggingface" / "qwen3").is_dir() or not ZO2_PYTHON.is_file(),
    reason="no ZO2 checkout with Qwen3 and its interpreter (ZO2_CHECKOUT, ZO2_PYTHON; "
    "default .peers/zo2 and .peers/venv, benchmarks/README.md)",
)
def test_zo2s_own_qwen3_runs_through_the_harness(tmp_path):
    """ZO2's MeZO step on its Qwen3 model, under its own interpreter, beside distzo's."""
    out = tmp_path / "peers.json"
    proc = harness(
        "--shape", "qwen3-0.6b", "--layers", "2", "--hidden", "128", "--batch", "1",
        "--seq", "32", "--device", "cpu", "--threads", "1", "--warmup", "0", "--rounds", "2",
        "--systems", "zo2-mezo,distzo-offload", "--zo2", str(ZO2),
        "--zo2-python", str(ZO2_PYTHON), "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    validate_report(data)
    by_name = {m["name"]: m for m in data["measurements"]}
    expected = qwen3_parameters(128, 2, 32)  # both built the same model
    for name in ("zo2-mezo", "distzo-offload"):
        m = by_name[name]
        assert m["metrics"]["parameters"] == expected, name
        assert m["params"]["timed_steps"] == 2, name
        assert abs(m["metrics"]["loss"] - math.log(151936)) < 0.5, name
    assert data["derived"]["distzo-offload_vs_zo2-mezo"] > 0


def test_a_missed_target_names_the_phase_that_bounds_the_offloaded_step():
    from tests.unit.test_phases import phases

    def run(name: str, p: dict | None) -> peers.Run:
        return peers.Run(peers.System(name, []), {}, phases=p)

    runs = [run("zo2-mezo", None), run("distzo-offload", phases(1, 5, 1, 3))]
    notes = peers.phase_notes(runs, {"distzo-offload_vs_zo2-mezo": 1.5})
    assert notes[0].startswith("distzo-offload per block: upload 1 ms, compute 5 ms (noise 3")
    assert notes[1] == (
        "distzo-offload runs at 1.50x zo2-mezo's tokens/s, below the 2x target: its period "
        "per block is bound by noise (the phases above)"
    )
    assert peers.phase_notes(runs, {"distzo-offload_vs_zo2-mezo": 2.3}) == [
        notes[0],
        "distzo-offload runs at 2.30x zo2-mezo's tokens/s: the 2x target is met",
    ]


def test_a_compute_bound_miss_against_resident_says_what_the_compute_adds():
    """Offload below 0.97x resident with both compute-bound: the note puts the two
    computes per block side by side, split into the noise, the master buffer's upcast and
    rounding, and the rest (the H200 run at Qwen3-1.7B, 2026-11-27)."""
    from tests.unit.test_phases import phases

    def run(name: str, p: dict) -> peers.Run:
        return peers.Run(peers.System(name, []), {}, phases=p)

    offload = run("distzo-offload", phases(1.99, 2.63, 1.91, 0.925) | {"master_ms_per_block": 0.3})
    resident = run("distzo-resident", phases(0.01, 2.2, 0.01, 1.04))
    derived = {"distzo-offload_vs_distzo-resident": 0.87}
    assert peers.phase_notes([resident, offload], derived, "cuda")[-1] == (
        "distzo-offload runs at 0.87x distzo-resident's tokens/s, below the 0.97x target: its "
        "period per block is bound by compute (the phases above); its compute per block 2.63 "
        "ms against distzo-resident's 2.2 (+0.43 ms: noise -0.115, the master's upcast and "
        "rounding +0.3, the forwards and the rest +0.245)"
    )
    # double-buffered, the compute runs neither the upcast nor the rounding: not named
    master = {"master_ms_per_block": 0.0, "upload_upcast_ms": 0.1, "offload_rounding_ms": 0.2}
    double = run("distzo-offload-double", phases(2.1, 2.3, 2.2, 0.925) | master)
    derived = {"distzo-offload-double_vs_distzo-resident": 0.94}
    assert peers.phase_notes([resident, double], derived, "cuda")[-1].endswith(
        "(+0.1 ms: noise -0.115, the forwards and the rest +0.215)"
    )


def test_a_profile_unlike_the_timed_steps_is_said_so():
    """The phases come from a step apart from the timed ones; where its time strays more
    than 15 % from the timed steps' mean, a note says they describe that step alone."""
    from tests.unit.test_phases import phases

    timed = [0.200, 0.200, 0.095, 0.095]  # the statistic's half: 95 ms
    run = peers.Run(peers.System("distzo-resident", []), {}, timed, phases=phases(0, 4, 0, 1))
    run.phases["step_ms"] = 142.0
    assert (
        "distzo-resident's profiled step took 142 ms against its timed steps' mean of 95 ms: "
        "its phases describe that step, not the table's"
    ) in peers.phase_notes([run], {}, "cuda")
    run.phases["step_ms"] = 100.0  # within 15 %
    assert not any("profiled step" in note for note in peers.phase_notes([run], {}, "cuda"))


def test_gpu_targets_are_zo2_offloads_speed_and_memory_and_resident():
    # the figures of the H100 run at OPT-1.3B, 1 x 2048, fp16
    from tests.unit.test_phases import phases

    offload = peers.Run(peers.System("distzo-offload", []), {}, phases=phases(2, 2.7, 1.9, 2))
    derived = {
        "distzo-offload_vs_zo2-mezo": 1.27,
        "distzo-offload_vs_zo2-offload": 2.07,
        "distzo-offload_vs_zo2-offload_peak_device": 1.78,
        "distzo-offload_vs_distzo-resident": 0.86,
    }
    notes = peers.phase_notes([offload], derived, "cuda")
    assert notes[1:] == [
        "distzo-offload runs at 2.07x zo2-offload's tokens/s: the 1.2x target is met",
        "distzo-offload runs at 0.86x distzo-resident's tokens/s, below the 0.97x target: its "
        "period per block is bound by noise (the phases above)",
        "distzo-offload's peak device memory is 1.78x zo2-offload's: above the target (1x)",
    ]
    transfer_bound = peers.Run(offload.system, {}, phases=phases(4, 2.7, 1.9, 1))
    derived["distzo-offload_vs_zo2-offload_peak_device"] = 0.9
    notes = peers.phase_notes([transfer_bound], derived, "cuda")
    assert notes[2].endswith(
        "bound by upload (the phases above); the target holds where compute >= transfer, "
        "which it is not here"
    )
    assert notes[3].endswith("0.90x zo2-offload's: the target (at most 1x) is met")
    # a missed memory target names where the peer's plan puts its memory (the H200 run at
    # OPT-6.7B, fp16 masters), beside the measured peak
    plan = {"plan_resident_gb": 1.27, "plan_slots_gb": 1.21, "plan_scratch_gb": 0.43}
    plan |= {"plan_masks_gb": 0.001, "plan_activations_gb": 0.50, "plan_gb": 3.411}
    replies = [{"peak_device_bytes": 3.1e9}, {"peak_device_bytes": 3.16e9}]
    half = peers.Run(peers.System("distzo-offload-half", []), {}, [], replies)
    half.phases = phases(8.62, 5.09, 7.82, 3.44) | plan
    derived = {"distzo-offload-half_vs_zo2-offload_peak_device": 1.23}
    assert peers.phase_notes([half], derived, "cuda")[1] == (
        "distzo-offload-half's peak device memory is 1.23x zo2-offload's: above the target "
        "(1x); its plan 3.41 GB (resident 1.27, slots 1.21, scratch 0.43, activations 0.50 GB), "
        "its measured peak 3.16 GB (0.93x)"
    )
    half.phases = phases(8.62, 5.09, 7.82, 3.44)  # a peer that reports no plan: the verdict
    assert peers.phase_notes([half], derived, "cuda")[1].endswith("above the target (1x)")


def test_distzo_at_zo2s_precision_holds_its_masters_in_the_dtype(tmp_path):
    """distzo-offload-half: the model in --dtype as ZO2 holds it (no float32 masters), and
    distzo-offload-recompute: distzo-offload's steps without the block-sized master, beside
    distzo-offload in one interleaved run; each refused in one line where it would be the
    same as distzo-offload."""
    from benchmarks import peer_distzo

    def built(system: str, scope: str = "block", like=None) -> peer_distzo.DistzoSystem:
        args = dict(shape="opt-125m", layers=1, hidden=64, batch=1, seq=SEQ, dtype="bf16")
        args.update(system=system, device="cpu", seed=0, threads=1, transfer_dtype=None)
        args.update(perturb_scope=scope, like=like)
        return peer_distzo.build(argparse.Namespace(**args))[0]

    half, full = built("distzo-offload-half"), built("distzo-offload")
    assert half.engine.resident_master.dtype == torch.bfloat16
    assert full.engine.resident_master.dtype == torch.float32
    assert half.engine.store.host_bytes == full.engine.store.host_bytes  # bf16 at rest in both
    assert half.engine.resident_master.nbytes * 2 == full.engine.resident_master.nbytes
    assert math.isfinite(half.step())

    # the block's float32 master rebuilt a chunk at a time: the same steps, one float32
    # block less on the device
    rebuilt = built("distzo-offload-recompute")
    assert rebuilt.engine.rebuilt is not None and full.engine.rebuilt is None
    biggest = max(full.engine.store.padded)
    assert full.engine.store.device_bytes - rebuilt.engine.store.device_bytes == biggest * 4
    # (the third step's losses read the rounding of the second's update)
    reference = [full.step() for _ in range(3)]
    assert [rebuilt.step() for _ in range(3)] == reference
    # the upcast and rounding off the compute stream: the same steps, one float32 block more
    double = built("distzo-offload-double")
    assert double.engine.store.double_buffered and not full.engine.store.double_buffered
    assert double.engine.store.device_bytes - full.engine.store.device_bytes == biggest * 4
    assert [double.step() for _ in range(3)] == reference
    # each peer's plan is its own system's (taken from the skeleton: a built engine's
    # modules hold compute-dtype views that a plan would read as bf16 masters)
    assert full.plan["plan_resident_gb"] == 2 * half.plan["plan_resident_gb"]
    for system in (full, double):  # K slots and one or two float32 master buffers
        assert system.plan["plan_slots_gb"] * 1e9 == pytest.approx(
            system.engine.store.device_bytes, rel=1e-9
        )
    # each block perturbed module by module: the same steps, a smaller scratch
    by_module, whole = built("distzo-offload-half", "module"), built("distzo-offload-half")
    assert by_module.engine.config.perturb_scope == "module"
    assert by_module.engine.block_scratch.numel() < whole.engine.block_scratch.numel()
    assert [by_module.step() for _ in range(2)] == [whole.step() for _ in range(2)]
    # a variant of a built-in system under a name of its own (a --peer beside it)
    variant = built("distzo-offload-module", "module", like="distzo-offload-half")
    assert variant.engine.resident_master.dtype == torch.bfloat16
    assert variant.engine.config.perturb_scope == "module"
    with pytest.raises(ValueError, match="--system NAME --like one of those"):
        built("distzo-offload-module", "module")

    out = tmp_path / "peers.json"
    bf16 = [*TINY, "--dtype", "bf16", "--warmup", "0", "--distzo-perturb-scope", "module"]
    names = "distzo-offload,distzo-offload-recompute,distzo-offload-double,distzo-offload-half"
    proc = harness(*bf16, "--systems", names, "--rounds", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    validate_report(data)
    assert {m["params"]["perturb_scope"] for m in data["measurements"]} == {"module"}
    assert any("--distzo-perturb-scope module" in note for note in data.get("notes", [])), data
    assert data["derived"]["distzo-offload-half_vs_distzo-offload"] > 0
    assert data["derived"]["distzo-offload-recompute_vs_distzo-offload"] > 0
    assert data["derived"]["distzo-offload-double_vs_distzo-offload"] > 0
    # the double-buffered master's upcast and rounding are the upload's and the offload's
    double = next(n for n in data["notes"] if n.startswith("distzo-offload-double per block"))
    assert "(the master's upcast " in double and "(the master's rounding " in double, double
    assert "the master's upcast and rounding" not in double, double
    with pytest.raises(SystemExit, match="distzo-offload-half keeps the masters in --dtype"):
        peers.main([*TINY, "--systems", "distzo-offload-half", "--out", str(out)])
    for system in ("distzo-offload-recompute", "distzo-offload-double"):
        with pytest.raises(SystemExit, match=f"{system} places the master of a block"):
            peers.main([*TINY, "--systems", system, "--out", str(out)])
