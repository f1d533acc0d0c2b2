"""Every collective goes through distzo/dist, and there follows NCCL's rules: device
tensors, stream-ordered waits, a host sync at the end of every collective read-back."""

import ast
import json
from pathlib import Path

import torch

from distzo.dist import Collectives
from tests.helpers.launch import child_env, free_port, run_python, torchrun_command

PACKAGE = Path(__file__).resolve().parents[2] / "distzo"
COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "gather",
    "gather_object",
    "send",
    "recv",
    "isend",
    "irecv",
    "new_group",
    "monitored_barrier",
    "batch_isend_irecv",
}


def collective_calls(path: Path) -> list[str]:
    """``dist.<collective>(...)`` / ``torch.distributed.<collective>(...)`` calls in a file."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = {"torch.distributed"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name == "torch.distributed"}
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in COLLECTIVES
        ):
            owner = ast.unparse(node.func.value)
            if owner in aliases:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {owner}.{node.func.attr}")
        if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            found += [
                f"{path.relative_to(PACKAGE)}:{node.lineno} from torch.distributed import {a.name}"
                for a in node.names
                if a.name in COLLECTIVES
            ]
    return found


def test_no_module_outside_distzo_dist_calls_a_collective():
    offenders = [
        call
        for path in sorted(PACKAGE.rglob("*.py"))
        if "dist" not in path.relative_to(PACKAGE).parts[:1]
        for call in collective_calls(path)
    ]
    assert offenders == [], offenders


def test_the_checker_finds_a_direct_collective(tmp_path):
    probe = PACKAGE / "_probe_for_test.py"
    try:
        probe.write_text("import torch.distributed as d\n\ndef f(t):\n    d.all_reduce(t)\n")
        assert collective_calls(probe) == ["_probe_for_test.py:4 d.all_reduce"]
    finally:
        probe.unlink()


def test_one_process_collectives_are_the_identity():
    comm = Collectives(torch.device("cpu"))
    assert comm.sum_to_host([1.5, torch.tensor(2.0)]) == [1.5, 2.0]
    assert comm.broadcast_object({"a": 1}) == {"a": 1} and comm.all_gather_object(3) == [3]
    assert comm.read_later(torch.tensor([1.0, 2.0]))() == [1.0, 2.0]


def test_the_engine_follows_nccls_rules_against_a_stand_in(tmp_path):
    # tests/helpers/nccl_like.py refuses tensors not placed for the device group and holds every
    # collective outstanding until a host sync: evaluation summing a host tensor, or a
    # read-back returning before its gathers finished, fail here as under NCCL.
    # the ranks forked from a launcher that imported the probe (the fork server's child)
    command = torchrun_command(
        2, [str(tmp_path)], free_port(), module="tests.helpers.nccl_like_probe", preload=True
    )
    proc = run_python(command, child_env(), 180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for record in records:
        assert record["refused"] == 0
        assert [
            record[k] for k in ("after_steps", "after_eval", "after_export", "after_checkpoint")
        ] == [0, 0, 0, 0]
    assert records[0]["eval"] == records[1]["eval"] and records[0]["eval"]["eval_loss"] > 0
    assert (tmp_path / "export" / "model.safetensors").is_file()
