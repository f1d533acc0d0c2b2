"""Integration tests as a table of real launches: torchrun + gloo on CPU, through the CLI.

Trajectories are compared in float64 masters: splitting the batch over dp reassociates
the loss sums, and g = (L+ - L-) / (2 eps) magnifies that by 1/(2 eps) = 500, so in
float32 DDP and single agree only to ~1e-4 relative in g, while in float64 the same
reassociation is ~1e-12. PertP splits nothing and is checked bitwise in float32 too.
"""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from distzo.job.run_dir import run_contents
from tests.helpers import faults
from tests.helpers.launch import (
    FAULTY_TRAIN,
    TRAIN,
    Run,
    checkpoint_writers,
    child_env,
    free_port,
    max_relative_difference,
    python_train,
    torchrun,
    torchrun_command,
    train_in_process,
)
from tests.helpers.models import build, save_multimodal, tiny_opt

REPO = Path(__file__).resolve().parents[2]  # where ``tests`` is a package

COMMON = ["--max-steps", "10", "--batch-size", "8", "--log-every", "0", "--seed", "3"]
FP64 = COMMON + ["--dtype", "fp64"]
LOWRANK = ["--noise", "lowrank", "--lozo-interval", "4"]
LOZO_M = [*LOWRANK, "--optimizer", "momentum", "--optimizer-state", "lowrank"]
FZOO = ["--estimator", "fzoo", "--num-queries", "3"]

LAUNCHES = {
    # name: (processes, flags)
    "single": (1, FP64),
    "pertp": (2, FP64 + ["--pert", "2"]),
    "2d": (4, FP64 + ["--dp", "2", "--pert", "2"]),
    "2d_sliced": (4, FP64 + ["--dp", "2", "--pert", "2", "--transfer", "sliced"]),
    "single_q3": (1, FP64 + ["--num-queries", "3"]),
    "2d_sliced_q3": (
        4,
        FP64 + ["--dp", "2", "--pert", "2", "--transfer", "sliced", "--num-queries", "3"],
    ),
    # LOZO's noise, its V kept for 4 steps of the 10
    "single_lowrank": (1, FP64 + LOWRANK),
    "2d_sliced_lowrank": (
        4,
        FP64 + LOWRANK + ["--dp", "2", "--pert", "2", "--transfer", "sliced"],
    ),
    # LOZO-M: its factors whole on every rank, each updating the whole gathered block
    "single_lozo_m": (1, FP64 + LOZO_M),
    "2d_sliced_lozo_m": (4, FP64 + LOZO_M + ["--dp", "2", "--pert", "2", "--transfer", "sliced"]),
    # FZOO's 3 one-sided passes and its unperturbed one: 2 + 2 over a pert pair
    "single_fzoo": (1, FP64 + FZOO),
    "pertp_fzoo": (2, FP64 + FZOO + ["--pert", "2"]),
    # pert groups past a pair: FZOO's 4 passes one per rank; n-SPSA's 6 passes two per rank
    "pertp4_fzoo": (4, FP64 + FZOO + ["--pert", "4"]),
    "pertp3_q3": (3, FP64 + ["--num-queries", "3", "--pert", "3"]),
    "2d_sliced_fzoo": (
        4,
        FP64 + FZOO + ["--dp", "2", "--pert", "2", "--transfer", "sliced", "--grad-accum", "2"],
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, (nproc, flags) in LAUNCHES.items():
        path = tmp_path_factory.mktemp(name)
        args = flags + ["--output-dir", str(path)]
        proc = python_train(args) if nproc == 1 else torchrun(nproc, args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = Run(path)
    return out


# (DDP alone: test_objective_layouts; here dp is 2 inside the 2D layouts)
@pytest.mark.parametrize("name", ["pertp", "2d", "2d_sliced"])
def test_every_strategy_follows_the_single_process_trajectory(runs, name):
    g_diff, param_diff = max_relative_difference(runs[name], runs["single"])
    assert len(runs[name].metrics) == 10
    assert g_diff <= 1e-9 and param_diff <= 1e-9, (g_diff, param_diff)


def test_multi_query_2d_sliced_follows_the_single_process_trajectory(runs):
    # n-SPSA keeps one all-reduce per step: 2 x 3 losses, each rank's passes in their slots.
    multi, single = runs["2d_sliced_q3"], runs["single_q3"]
    g_diff, param_diff = max_relative_difference(multi, single)
    assert g_diff <= 1e-9 and param_diff <= 1e-9, (g_diff, param_diff)
    per_query = [
        (a, b)
        for m, s in zip(multi.metrics, single.metrics, strict=True)
        for a, b in zip(m["projected_grads"], s["projected_grads"], strict=True)
    ]
    assert len(per_query) == 30 and all(
        abs(a - b) <= 1e-9 * max(abs(b), 1e-12) for a, b in per_query
    )
    assert (
        max_relative_difference(single, runs["single"])[1] > 1e-3
    )  # three queries took another path


def test_low_rank_noise_on_a_2d_sliced_mesh_follows_the_single_process_trajectory(runs):
    """Each rank draws its passes' and its share's U V^T from the keys alone."""
    g_diff, param_diff = max_relative_difference(runs["2d_sliced_lowrank"], runs["single_lowrank"])
    assert g_diff <= 1e-9 and param_diff <= 1e-9, (g_diff, param_diff)
    assert runs["single_lowrank"].ranks[0]["noise"] == "lowrank-v1"
    assert max_relative_difference(runs["single_lowrank"], runs["single"])[1] > 1e-3


def test_lozo_m_on_a_2d_sliced_mesh_follows_the_single_process_trajectory(runs):
    """The data ranks' and the pert ranks' steps, and the sliced transfer's gathered blocks,
    advance the same factors: the single process's g and weights (by hand, --dp 2 and
    --pert 2 alone followed it too, to 4.2e-12 and bit for bit)."""
    mesh, single = runs["2d_sliced_lozo_m"], runs["single_lozo_m"]
    g_diff, param_diff = max_relative_difference(mesh, single)
    assert g_diff <= 1e-9 and param_diff <= 1e-9, (g_diff, param_diff)
    assert max_relative_difference(single, runs["single_lowrank"])[1] > 1e-3  # not LOZO's


def test_fzoo_splits_its_passes_over_the_pert_ranks_and_follows_one_process(runs):
    single, pertp, mesh = runs["single_fzoo"], runs["pertp_fzoo"], runs["2d_sliced_fzoo"]
    # PertP splits the passes, nothing else: bitwise
    assert [m["projected_grads"] for m in pertp.metrics] == [
        m["projected_grads"] for m in single.metrics
    ]
    assert all(torch.equal(pertp.params[k], v) for k, v in single.params.items())
    # DDP x PertP, sliced, micro-batches: the loss sums reassociate, to 1e-9 in fp64
    per_query = [
        (a, b)
        for m, s in zip(mesh.metrics, single.metrics, strict=True)
        for a, b in zip(m["projected_grads"], s["projected_grads"], strict=True)
    ]
    assert len(per_query) == 30
    assert all(abs(a - b) <= 1e-9 * max(abs(b), 1e-12) for a, b in per_query)
    assert max_relative_difference(mesh, single)[1] <= 1e-9
    # FZOO reports L(theta), the loss its differences start from
    assert all(m["loss"] == m["loss_minus"] for m in single.metrics)
    assert max_relative_difference(single, runs["single_q3"])[1] > 1e-3  # not SPSA's path


def test_a_pert_group_of_any_size_is_bitwise_one_process(runs):
    for wide, single in (("pertp4_fzoo", "single_fzoo"), ("pertp3_q3", "single_q3")):
        wide, single = runs[wide], runs[single]
        assert [m["projected_grads"] for m in wide.metrics] == [
            m["projected_grads"] for m in single.metrics
        ]
        assert all(torch.equal(wide.params[k], v) for k, v in single.params.items())
    ranks = runs["pertp4_fzoo"].ranks
    assert [ranks[r]["mesh_coordinates"] for r in range(4)] == [[0, 0], [0, 1], [0, 2], [0, 3]]


def test_device_mesh_places_ranks_row_major(runs):
    ranks = runs["2d"].ranks
    assert [ranks[r]["mesh_coordinates"] for r in range(4)] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert all(r["mesh_coordinates"] == r["formula_coordinates"] for r in ranks.values())


def test_perturbation_parallel_is_bitwise_single(runs):
    assert runs["pertp"].grads == runs["single"].grads


def test_sliced_equals_naive_and_holds_a_quarter_of_the_host_copy(runs):
    naive, sliced = runs["2d"], runs["2d_sliced"]
    assert sliced.grads == naive.grads
    for name in naive.params:
        assert (sliced.params[name] == naive.params[name]).all(), name
    assert {r["transfer"] for r in naive.ranks.values()} == {"naive"}
    assert {r["transfer"] for r in sliced.ranks.values()} == {"sliced"}
    for rank in range(4):
        share = sliced.ranks[rank]["host_bytes"] / naive.ranks[rank]["host_bytes"]
        assert 0.25 <= share <= 0.28, (
            share
        )  # 1/4, plus padding that aligns each of the 4 pieces per rank


def start_two_nodes(
    node0: list[str],
    node1: list[str],
    port: int,
    nproc: int = 1,
    cwds: tuple[Path | None, Path | None] = (None, None),
    env: dict[str, str] | None = None,
) -> list[subprocess.Popen]:
    """Two torchrun agents of ``nproc`` ranks each, as nodes 0 and 1 of one job on this
    machine, each started with its own command line (in its own directory, ``cwds``: a
    relative path names each node's own copy of a file; ``env``: a fault to inject,
    ``tests.helpers.faults``)."""
    module = FAULTY_TRAIN if faults.injects(env) else TRAIN
    # ``python -m tests.helpers...`` from another directory finds the tests through the path
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return [
        subprocess.Popen(
            torchrun_command(
                nproc, args, port, nnodes=2, node_rank=node, module=module, preload=True
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env({**(env or {}), "PYTHONPATH": path}),
            cwd=cwd,
        )
        for node, (args, cwd) in enumerate(zip((node0, node1), cwds, strict=True))
    ]


def test_two_nodes_form_two_shard_groups_and_follow_the_same_trajectory(runs, tmp_path):
    port = free_port()
    args = FP64 + [
        "--dp",
        "2",
        "--pert",
        "2",
        "--transfer",
        "sliced",
        "--output-dir",
        str(tmp_path),
    ]
    agents = start_two_nodes(args, args, port, nproc=2)
    outputs = [agent.communicate(timeout=180) for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], [err[-2000:] for _, err in outputs]
    two_nodes = Run(tmp_path)
    assert {r: two_nodes.ranks[r]["shard_group"] for r in range(4)} == {
        0: [0, 1],
        1: [0, 1],
        2: [2, 3],
        3: [2, 3],
    }
    # Each node writes its share of the checkpoint's blocks: block i from node i % 2.
    files = checkpoint_writers(tmp_path / "checkpoints" / "step-10")
    assert {k: v for k, v in files.items() if k.startswith("block/")} == {
        "block/0": 0,
        "block/1": 2,
    }
    half = runs["2d"].ranks[0]["host_bytes"] / 2
    assert all(abs(r["host_bytes"] - half) / half < 0.05 for r in two_nodes.ranks.values())
    g_diff, param_diff = max_relative_difference(two_nodes, runs["single"])
    assert g_diff <= 1e-9 and param_diff <= 1e-9, (g_diff, param_diff)


@pytest.mark.parametrize(
    "node1_flags, message",
    [
        # a node's own disk: each rank's part of every checkpoint would land apart
        (["--output-dir", "{tmp}/node1"], "must be on a filesystem every node shares"),
        # a node's own options: it would wait for steps node 0 never takes
        (["--max-steps", "6"], "rank 1 was started with --max-steps 6, rank 0 with --max-steps 3"),
    ],
)
def test_a_node_with_its_own_run_directory_or_options_is_refused_at_once(
    tmp_path, node1_flags, message
):
    port, started = free_port(), time.monotonic()
    args = COMMON + ["--max-steps", "3", "--save-steps", "2", "--output-dir", str(tmp_path / "a")]
    own = [flag.format(tmp=tmp_path) for flag in node1_flags]
    agents = start_two_nodes(args, args + own, port)
    errors = [agent.communicate(timeout=100)[1] for agent in agents]
    assert [agent.returncode for agent in agents] == [1, 1], [e[-2000:] for e in errors]
    assert all(message in err for err in errors), [e[-2000:] for e in errors]
    assert time.monotonic() - started < 60
    assert not run_contents(tmp_path / "a") and not (tmp_path / "node1").exists()


def test_a_node_that_refuses_its_own_input_ends_the_other_nodes_at_once(tmp_path):
    # Node 1 alone names a model folder it does not have: it refuses before the process
    # group forms, which node 0's ranks used to wait for the whole --dist-timeout (300 s).
    port, started = free_port(), time.monotonic()
    args = COMMON + ["--output-dir", str(tmp_path / "a")]
    missing = ["--model", str(tmp_path / "no-model")]
    agents = start_two_nodes(args, args + missing, port)
    try:
        errors = [agent.communicate(timeout=90)[1] for agent in agents]
    finally:  # torchrun passes SIGTERM on to its ranks
        for agent in agents:
            agent.terminate()
            agent.wait(30)
    assert [agent.returncode for agent in agents] == [1, 1], [e[-2000:] for e in errors]
    assert f"error: rank 1 on node 1 refused its input: --model {missing[1]}: no such " in errors[0]
    assert time.monotonic() - started < 60
    assert not run_contents(tmp_path / "a")


def test_a_node_whose_model_folder_is_another_model_ends_every_node_at_once(tmp_path):
    # Node 1's copy of --model holds a config.json its weights disagree with: its rank
    # refused it after the process group formed, and node 0's rank said only "another rank
    # failed or went silent", 10 s later, with nothing of the cause.
    for node in ("node0", "node1"):
        tiny_opt().save_pretrained(tmp_path / node / "model")
    config = tmp_path / "node1" / "model" / "config.json"
    config.write_text(config.read_text().replace('"ffn_dim": 64', '"ffn_dim": 48'))
    port, started = free_port(), time.monotonic()
    args = COMMON + ["--model", "model", "--output-dir", str(tmp_path / "a")]
    agents = start_two_nodes(args, args, port, cwds=(tmp_path / "node0", tmp_path / "node1"))
    line = "error: rank 1 read another model from --model model than rank 0: its config.json"
    # each node's log says it, and node 1's ranks do not wait 10 s for a torchrun that
    # never learns of rank 0's exit
    ended = both_fail_saying(agents, started, line)
    assert abs(ended[0] - ended[1]) < 5, ended
    assert not run_contents(tmp_path / "a")


def test_nodes_reading_their_own_copies_of_the_data_train_resume_and_record_rank_0s(tmp_path):
    # torchtitan's and DeepSpeed's users stage the data on each node's local disk, at a
    # path of that node's: refused as another --train-file, although the rows were equal
    rows = "".join(f"row {i} of the corpus\n" for i in range(8))
    copies = (tmp_path / "node0/data/train.txt", tmp_path / "node1/local/t.txt")
    for copy in copies:
        copy.parent.mkdir(parents=True)
        copy.write_text(rows)
    run = ["--task", "text", "--batch-size", "4", "--eval-batch-size", "4", "--log-every", "0"]

    def launch(run_dir: str, steps: str, *resume: str) -> list[subprocess.Popen]:
        args = [*run, "--max-steps", steps, "--output-dir", str(tmp_path / run_dir), *resume]
        own = [["--train-file", str(copy), "--eval-file", str(copy)] for copy in copies]
        return start_two_nodes(args + own[0], args + own[1], free_port())

    for steps, resume in (("1", ()), ("2", ("--resume",))):  # a resume reads each node's own
        agents = launch("a", steps, *resume)
        errors = [agent.communicate(timeout=120)[1] for agent in agents]
        assert [agent.returncode for agent in agents] == [0, 0], [e[-2000:] for e in errors]
    assert f'train_file = "{copies[0]}"' in (tmp_path / "a/config.toml").read_text()
    metrics = (tmp_path / "a/metrics.jsonl").read_text().splitlines()
    assert [r["step"] for r in map(json.loads, metrics) if "loss" in r] == [0, 1]
    copies[1].write_text(rows + "a row added on node 1\n")
    line = (
        f"error: rank 1 read other rows from --train-file {copies[1]} than rank 0 from "
        f"{copies[0]} (rows digest "
    )
    both_fail_saying(launch("b", "1"), time.monotonic(), line)


def test_a_node_that_cannot_write_its_summary_fails_every_node_before_the_export(tmp_path):
    # Node 1's rank could not write its rank1.json: node 0's rank published the export and
    # summary.json of a finished run, and node 0's torchrun then waited in its exit barrier
    # (5 minutes) for node 1's, which had failed.
    port, started = free_port(), time.monotonic()
    args = COMMON + ["--max-steps", "2", "--output-dir", str(tmp_path)]
    agents = start_two_nodes(args, args, port, env={faults.UNWRITABLE_SUMMARY: "1"})
    line = f"error: rank 1: cannot write {tmp_path}/rank1.json (under {tmp_path}): Is a dir"
    both_fail_saying(agents, started, line)
    assert not (tmp_path / "export").exists() and not (tmp_path / "summary.json").exists()


def both_fail_saying(agents: list[subprocess.Popen], started: float, line: str) -> list[float]:
    """Both nodes' agents exit 1 within a minute of ``started``, each node's log saying the
    error ``line`` (its start); their exit times."""
    try:
        ended = exit_times(agents, started + 90)
        errors = [agent.communicate(timeout=30)[1] for agent in agents]
    finally:
        stop(agents)
    assert [agent.returncode for agent in agents] == [1, 1], [e[-2000:] for e in errors]
    said = [any(each.startswith(line) for each in err.splitlines()) for err in errors]
    assert said == [True, True], [e[-2000:] for e in errors]
    assert max(ended) - started < 60, ended
    return ended


def stop(agents: list[subprocess.Popen]) -> None:
    """End the agents still running: torchrun passes SIGTERM on to its ranks, but one
    waiting in its exit barrier ignores it."""
    for agent in agents:
        agent.terminate()
        try:
            agent.wait(30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait(30)


def exit_times(agents: list[subprocess.Popen], deadline: float) -> list[float]:
    """When each agent exited (``time.monotonic``), polled until ``deadline``; their
    output is read afterwards (a launch that fails early writes little)."""
    ended: dict[int, float] = {}
    while len(ended) < len(agents) and time.monotonic() < deadline:
        for i, agent in enumerate(agents):
            if i not in ended and agent.poll() is not None:
                ended[i] = time.monotonic()
        time.sleep(0.1)
    return [ended.get(i, float("inf")) for i in range(len(agents))]


def test_a_rank_that_raises_makes_every_rank_exit_within_a_minute(tmp_path):
    started = time.monotonic()
    proc = torchrun(
        4,
        COMMON + ["--max-steps", "1000", "--output-dir", str(tmp_path)],
        env={"DISTZO_FAIL_AT": "1:3"},
        timeout=120,
        preload=False,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode != 0
    assert "failure injected by DISTZO_FAIL_AT at step 3" in proc.stderr
    assert elapsed < 60, elapsed
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dp", "3", "--pert", "2"], "--dp 3 x --pert 2 = 6 does not match the 2 launched ranks"),
        (["--pert", "3"], "--pert 3 does not divide the 2 launched ranks"),
        (["--pert", "1", "--batch-size", "7"], "--batch-size 7 is not divisible by --dp 2"),
    ],
)
def test_invalid_layouts_are_rejected_on_every_rank_before_any_model(flags, message):
    if flags[0] == "--dp":  # through torchrun: rank 0 prints the line and nothing is built
        proc = torchrun(2, ["--max-steps", "1"] + flags, timeout=120, preload=False)
        assert proc.returncode != 0
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(f"error: {message}"), proc.stderr[-2000:]
        # the ranks' error files carry it into torchrun's summary, as the root cause
        root_cause = proc.stderr.split("Root Cause", 1)[1]
        assert f"traceback : error: {message}" in root_cause, proc.stderr[-2000:]
        assert "eval loss" not in proc.stderr and "ZO engine" not in proc.stderr
        return
    # the same validation as rank 0 of a 2-rank launch sees it, in this process
    launched = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    proc = train_in_process(["--max-steps", "1"] + flags, env=launched)
    assert proc.returncode == 2 and proc.stderr.strip().startswith(f"error: {message}"), proc.stderr


@pytest.mark.parametrize(
    "flags, passes",
    [
        ([], "the 2 forward passes of a step (--estimator spsa, --num-queries 1)"),
        (["--estimator", "fzoo", "--num-queries", "2"], "the 3 forward passes of a step"),
    ],
)
def test_a_pert_group_wider_than_a_steps_passes_is_refused(flags, passes):
    launched = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}
    proc = train_in_process(["--max-steps", "1", "--pert", "4", *flags], env=launched)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert line.startswith(f"error: --pert 4 is more ranks than {passes}") and "\n" not in line
    assert line.endswith("or more --num-queries")


def test_sliced_without_a_process_group_is_rejected():
    proc = train_in_process(["--transfer", "sliced"])
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: --transfer sliced needs a torchrun launch (a process group); use --transfer naive "
        "or auto"
    )


@pytest.mark.parametrize("wire, compute", [("bf16", "bf16"), ("fp8", "fp32")])
def test_low_bit_sliced_equals_low_bit_naive_bitwise(tmp_path, wire, compute):
    flags = COMMON + [
        "--pert",
        "1",
        "--transfer-dtype",
        wire,
        "--compute-dtype",
        compute,
        "--eps",
        "1e-2",
    ]
    runs = {}
    # sliced at bf16 with two master buffers (each block upcast on the upload stream after
    # its gather, its own pieces rounded on the offload stream), at fp8 with one; the
    # last: each rank rebuilds the masters of its own pieces, no float32 block
    masters = ["--low-bit-master", "double"] if wire == "bf16" else []
    for name, extra in [
        ("naive", ["--transfer", "naive"]),
        ("sliced", ["--transfer", "sliced", *masters]),
        ("sliced-recomputed", ["--transfer", "sliced", "--low-bit-master", "recompute"]),
    ]:
        out = tmp_path / name
        proc = torchrun(2, flags + extra + ["--output-dir", str(out)])
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = Run(out)
    chosen = 'low_bit_master = "double"' in (tmp_path / "sliced" / "config.toml").read_text()
    assert chosen == bool(masters)
    for layout in ("sliced", "sliced-recomputed"):
        assert runs[layout].grads == runs["naive"].grads
        for name, value in runs["naive"].params.items():
            assert (runs[layout].params[name] == value).all(), (layout, name)
    share = runs["sliced"].ranks[0]["host_bytes"] / runs["naive"].ranks[0]["host_bytes"]
    assert 0.5 <= share <= 0.53  # 1/2, plus padding that aligns each of the 4 pieces per rank


def test_single_node_launch_script_runs(tmp_path):
    proc = subprocess.run(
        [
            "bash",
            "launch/run_train.sh",
            "--max-steps",
            "20",
            "--log-every",
            "0",
            "--output-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=child_env({"NGPU": "2", "MASTER_PORT": str(free_port())}),
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert len(Run(tmp_path).metrics) == 20


@pytest.mark.parametrize("chunks", ["1", "3"])
def test_pipelined_pieces_do_not_change_the_trajectory(runs, tmp_path, chunks):
    proc = torchrun(
        4,
        FP64
        + [
            "--dp",
            "2",
            "--pert",
            "2",
            "--transfer",
            "sliced",
            "--transfer-chunks",
            chunks,
            "--output-dir",
            str(tmp_path),
        ],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert Run(tmp_path).grads == runs["2d_sliced"].grads  # default: 4 pieces


def _one_process_and_two_sliced_ranks(tmp_path: Path, args: list[str]) -> list[Path]:
    """The exports of the job ``args`` run in one process and on two sliced ranks."""
    one = python_train([*args, "--output-dir", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr[-3000:]
    two = torchrun(2, [*args, "--transfer", "sliced", "--output-dir", str(tmp_path / "two")])
    assert two.returncode == 0, two.stderr[-3000:]
    return [tmp_path / run / "export" / "model.safetensors" for run in ("one", "two")]


def test_a_mixture_of_experts_on_two_sliced_ranks_exports_one_process_bytes(tmp_path):
    """A Qwen3-MoE checkpoint as save_pretrained (and the hub) store it, one key an expert:
    each sliced rank reads its pieces of the fused experts the streamed read builds, and
    the export, written by rank 0 under the checkpoint's keys, is the one process's byte
    for byte."""
    build("qwen3_moe", seed=2).save_pretrained(tmp_path / "moe")
    args = ["--model", str(tmp_path / "moe"), "--task", "counting", "--seq-len", "8"]
    args += ["--dtype", "fp64", "--lr", "1e-3", "--max-steps", "3", "--log-every", "0"]
    exported = _one_process_and_two_sliced_ranks(tmp_path, args)
    assert exported[0].read_bytes() == exported[1].read_bytes()
    with (
        safe_open(str(exported[1]), "pt") as export,
        safe_open(str(tmp_path / "moe" / "model.safetensors"), "pt") as checkpoint,
    ):
        assert set(export.keys()) == set(checkpoint.keys())


def test_a_multimodal_gemma_3_on_two_sliced_ranks_exports_one_process_bytes(tmp_path):
    """Gemma 3 4B+ (a vision tower beside the text model that trains): on 2 ranks with the
    sliced transfer, the export (written by rank 0, the vision tower copied from the
    checkpoint) is the one process's, byte for byte."""
    folder = save_multimodal(tmp_path / "mm")
    args = ["--model", str(folder), "--task", "counting", "--seq-len", "8", "--dtype", "fp64"]
    args += ["--lr", "1e-3", "--max-steps", "4", "--log-every", "0"]
    exported = _one_process_and_two_sliced_ranks(tmp_path, args)
    assert exported[0].read_bytes() == exported[1].read_bytes()
    with safe_open(str(exported[1]), "pt") as export:
        assert any(key.startswith("vision_tower.") for key in export.keys())
