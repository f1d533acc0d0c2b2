"""The memory plan's place of a rank in the job (``RankPlace``): the fields read from the
trainer's context, and the blocks a save copies on the rank's node."""

import torch

from distzo.dist import Collectives, LaunchEnv, ParallelContext, ParallelDims
from distzo.job.memory_plan import RankPlace


def test_a_ranks_place_is_read_from_its_context():
    env = LaunchEnv(rank=5, world_size=8, local_rank=1, local_world_size=4, node_rank=1)
    parallel = ParallelContext(env, ParallelDims(4, 2), comm=Collectives(torch.device("cpu")))
    assert RankPlace.of(parallel) == RankPlace(pert=2, pert_rank=1, world=8, local_ranks=4, node=1)


def test_a_nodes_saved_blocks_by_rank_or_by_shard_group():
    """Block i from rank i % 8 (ranks 4-7 on node 1); sliced, from shard group i % 2; a
    shard group wider than the world is one node saving every block."""
    place = RankPlace(world=8, local_ranks=4, node=1)
    assert place.saved_blocks(10, sliced=False, shard_size=4) == [4, 5, 6, 7]
    assert place.saved_blocks(6, sliced=True, shard_size=4) == [1, 3, 5]
    alone = RankPlace(world=2, local_ranks=2)
    assert alone.saved_blocks(3, sliced=True, shard_size=4) == [0, 1, 2]
