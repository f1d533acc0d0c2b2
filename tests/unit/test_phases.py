"""distzo.bench.phases: where a step's time goes, counted on the engine's own calls."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import OPTForCausalLM

from distzo import ZOConfig, ZOEngine
from distzo.bench import phases as phases_module
from distzo.bench.phases import (
    BOUND_WORDS,
    block_phases,
    bound_by,
    describe_phases,
    step_phases,
)
from distzo.models.tiny import tiny_opt_config
from distzo.offload.queue_model import modelled_period
from tests.helpers.launch import child_env


def engine(mode: str, queries: int) -> ZOEngine:
    torch.manual_seed(0)
    config = ZOConfig(mode=mode, device="cpu", num_queries=queries, lr=1e-3, eps=1e-3, seed=0)
    return ZOEngine(OPTForCausalLM(tiny_opt_config()), config)


@pytest.mark.parametrize("mode", ["offload", "resident"])
@pytest.mark.parametrize("queries", [1, 3])
def test_the_noise_calls_of_a_step_are_counted_per_block(mode, queries):
    e = engine(mode, queries)
    batch = {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))}
    e.step(batch)  # the next step carries this one's update into each block
    phases = step_phases(e, batch)
    # n-SPSA: each of the 2q passes perturbs every block once; the pending update is one
    # call carrying the q directions
    assert phases["perturbs_per_block"] == 2 * queries
    assert phases["updates_per_block"] == 1
    assert phases["noise_ms_per_block"] == pytest.approx(
        phases["perturb_ms_per_block"] + phases["update_ms_per_block"]
    )
    assert phases["noise_ms_per_block"] > 0 and phases["compute_ms_per_block"] > 0
    assert phases["resident_noise_ms"] > 0  # the embedding and the head, apart
    assert phases["model_ms_per_block"] >= max(
        phases[f"{p}_ms_per_block"] for p in ("upload", "compute", "offload")
    )
    # the instruments are gone: the next step runs the engine's own methods
    assert "perturb_into" not in vars(e.noise) and "apply" not in vars(e.update_rule)
    assert e.scheduler.timeline is None
    # the step: the prologue (embedding), the blocks, then the head; on CPU in sequence
    assert phases["blocks"] == 2 and phases["prologue_ms"] > 0
    assert phases["outside_blocks_ms"] > 0
    # on CPU the phases run one after another: the measured period is at least their sum
    in_sequence = sum(phases[f"{p}_ms_per_block"] for p in ("upload", "compute", "offload"))
    assert in_sequence <= phases["pipelined_ms_per_block"]
    assert phases["step_ms"] > phases["prologue_ms"] + phases["outside_blocks_ms"]


def test_a_rebuilt_masters_fused_kernels_are_its_noise(monkeypatch):
    """--low-bit-master recompute on CUDA: each pass's rebuild_perturb kernel is a
    perturbation and the write-back's rebuild_round kernel the update; a fused call that
    does not apply (returns False) is not counted. Stood in here: the kernels' calls,
    which on the CPU fall back to the pieces."""
    torch.manual_seed(0)
    config = ZOConfig(
        mode="offload", device="cpu", lr=1e-3, eps=1e-3, seed=0, transfer_dtype="bf16",
        low_bit_master="recompute",
    )  # fmt: skip
    e = ZOEngine(OPTForCausalLM(tiny_opt_config()), config)
    batch = {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))}
    e.step(batch)
    cls = type(e.noise)
    fused = {"rebuild_perturb_into": 0, "rebuild_round_into": 0}

    def stand_in(name):
        @functools.wraps(getattr(cls, name))  # its signature: the instrument reads block_id
        def call(self, *args, **kwargs):
            fused[name] += 1
            return fused[name] % 2 == 1  # every other call "runs", the rest fall back

        return call

    for name in fused:
        monkeypatch.setattr(cls, name, stand_in(name))
    phases = step_phases(e, batch)
    assert fused["rebuild_perturb_into"] > 0 and fused["rebuild_round_into"] > 0
    # block 1's calls that ran, plus those that fell back to the pieces (one piece each)
    assert phases["perturbs_per_block"] == 2
    assert phases["updates_per_block"] >= 1
    assert phases["noise_ms_per_block"] > 0


@pytest.mark.parametrize("repeats", [1, 3])
def test_the_measured_steps_train_like_any_other(repeats):
    """Phases are real steps (``repeats`` on the timeline, one for the noise): the
    trajectory is the one of as many plain steps."""
    batch = {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))}
    measured, plain = engine("offload", 1), engine("offload", 1)
    step_phases(measured, batch, repeats)
    for _ in range(repeats + 1):
        plain.step(batch)
    assert measured.step(batch).loss == plain.step(batch).loss


def test_of_several_timeline_steps_the_median_one_is_kept(monkeypatch):
    """A busy machine's outlier step does not become the profile: the step of the median
    time is, whole (its phases are one step's, not a mix)."""
    taken = iter([{"step_ms": 30.0, "n": 0}, {"step_ms": 10.0, "n": 1}, {"step_ms": 20.0, "n": 2}])
    monkeypatch.setattr(phases_module, "_timeline_step", lambda engine, batch, items: next(taken))
    assert block_phases(None, {}, repeats=3) == {"step_ms": 20.0, "n": 2}
    with pytest.raises(ValueError, match="at least one step, got repeats=0"):
        block_phases(None, {}, repeats=0)


@pytest.mark.parametrize(
    "transfer, moves, master",
    [("bf16", True, "buffer"), ("fp32", False, "buffer"), ("bf16", True, "double")],
    ids=["bf16-wire", "fp32-wire", "bf16-double"],
)
def test_the_master_buffers_upcast_and_rounding_are_timed_where_there_is_one(
    transfer, moves, master
):
    """A low-bit wire's master buffer is upcast before a block computes and rounded back
    after (the store's unpack and pack, once a step): timed per block apart from the
    noise; a store without the buffer reports none. Double-buffered, the upcast is the
    upload's and the rounding the offload's, not the compute's."""
    torch.manual_seed(0)
    config = ZOConfig(
        mode="offload",
        device="cpu",
        lr=1e-3,
        eps=1e-3,
        seed=0,
        transfer_dtype=transfer,
        low_bit_master=master,
    )
    e = ZOEngine(OPTForCausalLM(tiny_opt_config()), config)
    batch = {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))}
    e.step(batch)
    measured = step_phases(e, batch)
    assert "unpack" not in vars(e.scheduler.store) and "pack" not in vars(e.scheduler.store)
    line = describe_phases("distzo-offload", measured)
    double = master == "double"
    assert ("the master's upcast and rounding" in line) == (moves and not double)
    assert (measured["master_ms_per_block"] > 0) == (moves and not double)
    assert (measured["upload_upcast_ms"] > 0) == (measured["offload_rounding_ms"] > 0) == double
    assert ("(the master's upcast " in line) == ("(the master's rounding " in line) == double
    # on CPU nothing is queued: the host's time is the compute's, and never "host"-bound
    assert measured["async_streams"] == 0.0
    assert 0 < measured["host_ms_per_block"] <= measured["compute_ms_per_block"]
    assert "queued by the host" not in line and bound_by(measured) != "host"
    # the stream model replays the scheduler's queues with these times, the upcast and
    # the rounding apart from the copies beside them where two buffers hold the masters
    assert measured["double_buffered"] == float(double)
    phase = {p: measured[f"{p}_ms_per_block"] for p in ("upload", "compute", "offload")}
    if double:
        upcast, rounding = measured["upload_upcast_ms"], measured["offload_rounding_ms"]
        phase |= {"unpack": upcast, "pack": rounding}
        phase["upload"] = max(0.0, phase["upload"] - upcast)
        phase["offload"] = max(0.0, phase["offload"] - rounding)
    period = modelled_period(e.streamed_store.num_slots, double, phase)
    assert measured["model_ms_per_block"] == pytest.approx(period)
    assert period >= max(measured[f"{p}_ms_per_block"] for p in ("compute", "offload"))


def phases(upload: float, compute: float, offload: float, noise: float, slots: int = 3):
    return {
        "upload_ms_per_block": upload,
        "compute_ms_per_block": compute,
        "offload_ms_per_block": offload,
        "noise_ms_per_block": noise,
        "model_ms_per_block": max(upload, compute, offload, (upload + compute + offload) / slots),
        "pipelined_ms_per_block": 1.1 * max(upload, compute, offload),
        "eta": 0.9,
        "perturbs_per_block": 2,
        "updates_per_block": 1,
        "step_ms": 100.0,
        "blocks": 4,
        "prologue_ms": 3.0,
        "outside_blocks_ms": 20.0,
        "resident_noise_ms": 6.0,
    }


def test_a_block_the_host_queues_no_faster_than_the_device_runs_it_is_host_bound():
    """On a device's streams: where queueing a block's compute takes 90 % or more of the
    device's compute span, the device waited for the host's launches."""
    queued = phases(1, 5, 1, 1) | {"async_streams": 1.0, "host_ms_per_block": 4.6}
    assert bound_by(queued) == "host"
    assert "; queued by the host in 4.6 ms), offload 1 ms" in describe_phases("x", queued)
    assert bound_by(queued | {"host_ms_per_block": 4.0}) == "compute"  # the host ran ahead
    assert bound_by(queued | {"async_streams": 0.0}) == "compute"  # CPU: nothing queued
    # the host only bounds a compute-bound block: an upload-bound one stays so
    assert bound_by(phases(6, 5, 1, 1) | {"async_streams": 1.0, "host_ms_per_block": 5}) == (
        "upload"
    )


@pytest.mark.parametrize(
    "given, bound",
    [
        (phases(5, 2, 1, 0.5), "upload"),
        (phases(1, 2, 5, 0.5), "offload"),
        (phases(1, 5, 1, 1), "compute"),
        (phases(1, 5, 1, 3), "noise"),  # most of the compute draws z
        (phases(4, 4, 4, 1, slots=2), "waits"),  # 12 ms over 2 slots: 6 > 4
    ],
)
def test_the_bound_names_the_phase_that_sets_the_period(given, bound):
    assert bound_by(given) == bound
    line = describe_phases("distzo-offload", given)
    words = BOUND_WORDS.get(bound, bound)
    assert f"bound by {words}. Of the step's 100 ms, the 4 blocks take" in line
    assert "2 perturbations and 1 update)" in line
    assert line.endswith(
        "the prologue 3 (the resident bucket's noise 6, over the step), the head and the rest 20"
    )


def test_a_peer_without_phases_refuses_the_request_in_one_line():
    peer = textwrap.dedent(
        """
        import sys
        import torch
        from distzo.bench.peer_protocol import protocol_parser, serve

        class Plain:
            parameters = 1
            def step(self):
                return 0.0

        args = protocol_parser("plain").parse_args(sys.argv[1:])
        sys.exit(serve(lambda a: (Plain(), torch.device("cpu")), args))
        """
    )
    flags = ["--system", "plain", "--shape", "opt-125m", "--batch", "1", "--seq", "8"]
    flags += ["--dtype", "fp32", "--device", "cpu"]
    proc = subprocess.run(
        [sys.executable, "-c", peer, *flags],
        input='{"steps": 1}\n{"phases": true}\n',
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 1
    assert lines[0]["ready"] and len(lines[1]["step_s"]) == 1
    assert lines[2] == {"error": "plain: ValueError: this peer does not report phases"}
