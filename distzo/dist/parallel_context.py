"""Everything the engine and the trainer need to know about the parallel layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from distzo.dist.collectives import sum_over_world
from distzo.dist.launch_env import LaunchEnv
from distzo.dist.parallel_dims import ParallelDims


@dataclass
class ShardGroup:
    """The node-local ranks that share one host copy of the blocks (sliced transfer)."""

    group: dist.ProcessGroup
    members: list[int]  # global ranks, in slice order
    rank: int  # this rank's index in the group: it owns slice ``rank`` of every bucket

    @property
    def size(self) -> int:
        return len(self.members)


@dataclass
class ParallelContext:
    env: LaunchEnv
    dims: ParallelDims
    mesh: DeviceMesh | None = None
    shard_group: ShardGroup | None = None

    @classmethod
    def single(cls) -> "ParallelContext":
        return cls(LaunchEnv(), ParallelDims(1, 1))

    @property
    def dp_rank(self) -> int:
        if self.mesh is not None:
            return self.mesh.get_local_rank("dp")
        return self.dims.coordinates(self.env.rank)[0]

    @property
    def pert_rank(self) -> int:
        if self.mesh is not None:
            return self.mesh.get_local_rank("pert")
        return self.dims.coordinates(self.env.rank)[1]

    @property
    def is_distributed(self) -> bool:
        return self.env.world_size > 1

    @property
    def signs(self) -> tuple[int, ...]:
        """The perturbed passes this rank runs: both, or its half of a pert pair."""
        if self.dims.pert == 1:
            return (1, -1)
        return ((1,), (-1,))[self.pert_rank]

    def reduce(self, vector: torch.Tensor) -> torch.Tensor:
        """Sum over this context's ranks (a 1-rank context inside a job reduces nothing)."""
        return sum_over_world(vector) if self.is_distributed else vector

    def shard_batch(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This dp group's contiguous share of a global batch; both ranks of a pert pair
        get the same rows."""
        size = next(iter(batch.values())).shape[0]
        self.dims.check_batch(size)
        share = size // self.dims.dp
        lo = self.dp_rank * share
        return {key: value[lo : lo + share] for key, value in batch.items()}
