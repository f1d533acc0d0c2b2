"""Run by test_streaming_load: stream a checkpoint into an engine (1 rank naive, or
torchrun ranks sliced), report each rank's peak RSS right after the load, and rank 0's
per-parameter checksums of the loaded values. ``hub:ORG/NAME`` streams a hub model's
snapshot the way the trainer does (downloaded once per node, here from an offline cache)."""

import json
import sys
from typing import Any

import torch
from transformers import AutoConfig

from distzo import ZOConfig, ZOEngine
from distzo.dist import Collectives, LaunchEnv, ParallelContext, ParallelDims, ShardGroup
from distzo.dist import process_group as pg
from distzo.models.weights import open_checkpoint, skeleton
from distzo.runtime.host_memory import peak_rss_bytes

path, out = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
env = LaunchEnv.from_environ()
parallel, transfer = ParallelContext.single(), "naive"
if env.launched:
    pg.init_process_group(env, "gloo", 600)
    comm = Collectives.for_job(torch.device("cpu"))
    group, members = pg.node_groups(env, comm)
    dims = ParallelDims.resolve(env.world_size, None, 1)
    shard = ShardGroup.of(group, members, env.rank)
    parallel, transfer = ParallelContext(env, dims, None, shard, comm), "sliced"
if path.startswith("hub:"):
    from distzo.job.build import model_source

    path = str(model_source(path[4:], env, parallel.comm))
model = skeleton(AutoConfig.from_pretrained(path), torch.float32)
engine = ZOEngine(
    model,
    ZOConfig(device="cpu", seed=0, transfer=transfer),
    parallel=parallel,
    weights=open_checkpoint(path),
)
peak = peak_rss_bytes()
params = engine.named_parameters()  # after the measurement: this makes full copies
record: dict[str, Any] = {
    "rank": env.rank,
    "peak_rss": peak,
    "host_bytes": engine.store.host_bytes,
}
if env.rank == 0:
    record["checksums"] = {
        k: [v.double().sum().item(), v.double().square().sum().item()] for k, v in params.items()
    }
with open(f"{out}.rank{env.rank}.json", "w") as fh:
    json.dump(record, fh)
pg.shutdown()
