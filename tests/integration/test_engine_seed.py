"""A ZOEngine built under torchrun without a seed draws one seed for the whole job."""

import json

import torch

from tests.helpers.launch import child_env, free_port, run_python, torchrun_command


def test_an_engine_without_a_seed_takes_rank_0s_draw_on_every_rank(tmp_path):
    # Each rank drawing its own would perturb along its own z: a PertP pair's L+ and L-
    # of two directions (a g of 1e4) and weights that part after the first update.
    # the ranks forked from a launcher that imported the probe (the fork server's child)
    command = torchrun_command(
        2, [str(tmp_path)], free_port(), module="tests.helpers.engine_seed_probe", preload=True
    )
    proc = run_python(command, child_env(), 180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert records[0]["run_seed"] == records[1]["run_seed"]
    assert abs(records[0]["g"]) < 100, records  # a directional derivative, not noise
    weights = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
