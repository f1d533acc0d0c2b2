"""Ranks: the launch (``launch_env``, ``launch_gate``), the dp x pert layout, the process
group and mesh, every collective (``collectives``), checks every rank agrees on
(``agreement``) and how a failure reaches torchrun (``failure_report``)."""

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
