"""Run by test_engine_seed under torchrun (2 gloo ranks, PertP): a ``ZOEngine`` given
neither ``run_seed`` nor ``config.seed`` takes two steps; each rank writes the seed it
drew with, its last g and its weights (``rankN.pt``) into the folder named. Its work is in
``main``: the test's launcher imports the module once and forks the ranks from itself."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from distzo import ZOConfig, ZOEngine
from distzo.dist import Collectives, LaunchEnv, ParallelContext, ParallelDims, ShardGroup
from distzo.dist import process_group as pg
from tests.helpers.models import random_batch, tiny_opt


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    env = LaunchEnv.from_environ()
    dist.init_process_group("gloo", rank=env.rank, world_size=env.world_size)
    comm = Collectives.for_job(torch.device("cpu"))
    group, members = pg.node_groups(env, comm)
    parallel = ParallelContext(
        env, ParallelDims(1, 2), None, ShardGroup.of(group, members, env.rank), comm
    )
    engine = ZOEngine(tiny_opt(seed=0), ZOConfig(device="cpu", lr=1e-2), parallel=parallel)
    for step in range(2):
        result = engine.step(random_batch(64, batch=4, seed=step))
    torch.save(engine.named_parameters(), out / f"rank{env.rank}.pt")
    record = {"run_seed": engine.run_seed, "g": result.projected_grad}
    (out / f"rank{env.rank}.json").write_text(json.dumps(record))
    comm.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
