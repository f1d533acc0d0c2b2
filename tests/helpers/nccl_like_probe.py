"""Run by test_collectives under torchrun (2 ranks): the engine's collective paths
against the NCCL stand-in (tests/helpers/nccl_like.py) as the device group, gloo as the host
group. Adam steps, an evaluation, a sliced export written by rank 0 alone and a sliced
checkpoint (moments included); after each, no collective may be outstanding on any rank (what NCCL
would leave pending when a rank returns or tears down), and none may be refused. Its work is in
``main``: the test's launcher imports the module once and forks the ranks from itself."""

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distzo import ZOConfig, ZOEngine  # noqa: E402
from distzo.dist import Collectives, LaunchEnv, ParallelContext, ParallelDims, ShardGroup  # noqa: E402
from distzo.dist import process_group as pg  # noqa: E402
from distzo.export.hf_model import export_hf  # noqa: E402
from distzo.job.checkpoint import Checkpointer  # noqa: E402
from distzo.job.evaluation import evaluate_lm  # noqa: E402
from tests.helpers import nccl_like
from tests.helpers.models import random_batch, tiny_opt


def outstanding() -> int:
    return sum(g.outstanding for g in nccl_like.NcclLike.instances)


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    nccl_like.register()
    env = LaunchEnv.from_environ()
    dist.init_process_group(nccl_like.NAME, rank=env.rank, world_size=env.world_size)
    comm = Collectives.for_job(torch.device("cpu"))
    group, members = pg.node_groups(env, comm)
    parallel = ParallelContext(
        env, ParallelDims(2, 1), None, ShardGroup.of(group, members, env.rank), comm
    )
    # Adam: its moments are sliced and gathered with the blocks, and checkpointed beside them.
    engine = ZOEngine(
        tiny_opt(seed=0, num_hidden_layers=3),
        ZOConfig(device="cpu", seed=4, transfer="sliced", lr=1e-3, optimizer="adam"),
        parallel=parallel,
    )
    record: dict[str, Any] = {"rank": env.rank}
    for step in range(3):
        batch = random_batch(64, batch=4, seed=step)
        engine.step(
            parallel.shard_batch(batch), num_items=int((batch["labels"][:, 1:] != -100).sum())
        )
    record["after_steps"] = outstanding()
    record["eval"] = evaluate_lm(engine, random_batch(64, batch=6, seed=9), parallel, batch_size=2)
    record["after_eval"] = outstanding()
    export_hf(engine, out / "export", None)  # rank 0 writes; rank 1 only takes part in the gathers
    record["after_export"] = outstanding()
    Checkpointer(out / "checkpoints", engine).save(asynchronous=False)
    record["after_checkpoint"] = outstanding()
    record["refused"] = sum(len(g.refused) for g in nccl_like.NcclLike.instances)
    (out / f"rank{env.rank}.json").write_text(json.dumps(record))
    comm.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
