"""Run by test_checkpoint_paths under torchrun (ranks of one node, gloo, sliced transfer,
Adam): write a checkpoint with the saving path as it is, resume a fresh engine from it while
counting the bytes each rank reads from the checkpoint's data files, then take one more
step on both engines and report whether the resumed one followed the uninterrupted one. Its
work is in ``main``: the test's launcher imports the module once and forks the ranks from it."""

import json
import sys
from pathlib import Path

import torch

from distzo import ZOConfig, ZOEngine
from distzo.dist import Collectives, LaunchEnv, ParallelContext, ParallelDims, ShardGroup
from distzo.dist import process_group as pg
from distzo.job.checkpoint import Checkpointer
from tests.helpers.dcp_reads import counting_reads
from tests.helpers.models import random_batch, tiny_opt


def engine(parallel: ParallelContext) -> ZOEngine:
    model = tiny_opt(
        seed=2, num_hidden_layers=4, hidden_size=64, ffn_dim=256, word_embed_proj_dim=64
    )
    config = ZOConfig(device="cpu", seed=4, transfer="sliced", lr=1e-3, optimizer="adam")
    return ZOEngine(model, config, parallel=parallel)


def step(engine: ZOEngine, parallel: ParallelContext, seed: int):
    batch = random_batch(64, batch=4, seed=seed)
    num_items = int((batch["labels"][:, 1:] != -100).sum())
    return engine.step(parallel.shard_batch(batch), num_items=num_items)


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    env = LaunchEnv.from_environ()
    pg.init_process_group(env, "gloo", 600)
    comm = Collectives.for_job(torch.device("cpu"))
    group, members = pg.node_groups(env, comm)
    parallel = ParallelContext(
        env, ParallelDims(env.world_size, 1), None, ShardGroup.of(group, members, env.rank), comm
    )
    first = engine(parallel)
    for seed in range(2):
        step(first, parallel, seed)
    Checkpointer(out / "checkpoints", first).save(asynchronous=False)
    comm.barrier()

    with counting_reads() as counter:
        resumed = engine(parallel)
        Checkpointer(out / "checkpoints", resumed).load(out / "checkpoints" / "step-2")
    read = counter[0]

    element = first.store.rest_dtype.itemsize
    blocks = sum(layout.numel for layout in first.block_layouts) * element * (1 + 2)  # + moments
    record = {
        "rank": env.rank,
        "read": read,
        "blocks": blocks,
        "resident": first.resident_master.numel() * first.resident_master.element_size() * (1 + 2),
        "items": len(first.block_layouts) * 3,
        "same_step": step(first, parallel, 7) == step(resumed, parallel, 7),
    }
    a, b = first.named_parameters(), resumed.named_parameters()
    record["same_params"] = all(torch.equal(a[k], b[k]) for k in a)
    (out / f"rank{env.rank}.json").write_text(json.dumps(record))
    comm.barrier()
    pg.shutdown()


if __name__ == "__main__":
    main()
