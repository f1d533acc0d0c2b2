"""Process group, named 2D mesh (dp x pert), and every collective (``collectives``)."""

from distzo.dist.collectives import Collectives, broadcast_seed
from distzo.dist.launch_env import LaunchEnv
from distzo.dist.parallel_context import ParallelContext, ShardGroup
from distzo.dist.parallel_dims import ParallelDims

__all__ = [
    "Collectives",
    "LaunchEnv",
    "ParallelContext",
    "ParallelDims",
    "ShardGroup",
    "broadcast_seed",
]
