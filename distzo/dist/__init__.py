"""Process group, named 2D mesh (dp x pert), seed broadcast and the per-step all-reduce."""

from distzo.dist.collectives import broadcast_seed, sum_over_world
from distzo.dist.launch_env import LaunchEnv
from distzo.dist.parallel_context import ParallelContext, ShardGroup
from distzo.dist.parallel_dims import ParallelDims

__all__ = ["LaunchEnv", "ParallelContext", "ParallelDims", "ShardGroup", "broadcast_seed", "sum_over_world"]
