"""Everything the engine and the trainer need to know about the parallel layout."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from distzo.dist.collectives import Collectives
from distzo.dist.launch_env import LaunchEnv
from distzo.dist.parallel_dims import ParallelDims
from distzo.zo.estimators import Pass, rank_share


@dataclass
class ShardGroup:
    """The node-local ranks that share one host copy of the blocks (sliced transfer)."""

    group: dist.ProcessGroup
    members: list[int]  # global ranks, in slice order
    rank: int  # this rank's index in the group: it owns slice ``rank`` of every bucket

    @property
    def size(self) -> int:
        return len(self.members)

    @classmethod
    def of(cls, group: dist.ProcessGroup, members: list[int], global_rank: int) -> ShardGroup:
        """This rank's place in ``group``: slice ``i`` of every bucket belongs to
        ``members[i]``, and a gather over the group orders its pieces by group rank, so the
        two orders must be one (NCCL and gloo number a group's ranks in ascending global
        order; ``node_groups`` lists the members so)."""
        index = members.index(global_rank)
        group_rank = dist.get_rank(group) if dist.is_initialized() else index
        if group_rank != index:
            raise RuntimeError(
                f"rank {global_rank} is rank {group_rank} of its shard group but owns slice "
                f"{index} (members {members}): slices would be gathered out of order"
            )
        return cls(group, members, index)


@dataclass(init=False)
class ParallelContext:
    env: LaunchEnv
    dims: ParallelDims
    mesh: DeviceMesh | None
    shard_group: ShardGroup | None
    comm: Collectives  # every collective goes through it

    def __init__(
        self,
        env: LaunchEnv,
        dims: ParallelDims,
        mesh: DeviceMesh | None = None,
        shard_group: ShardGroup | None = None,
        comm: Collectives | None = None,
    ) -> None:
        """``comm`` is made for the job when not given (on the CPU for one process)."""
        self.env = env
        self.dims = dims
        self.mesh = mesh
        self.shard_group = shard_group
        if comm is None:
            comm = Collectives.for_job() if env.world_size > 1 else Collectives(torch.device("cpu"))
        self.comm = comm

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ParallelContext:
        return cls(LaunchEnv(), ParallelDims(1, 1), comm=Collectives(torch.device(device)))

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

    def own_passes(self, step_passes: tuple[Pass, ...]) -> tuple[Pass, ...]:
        """The passes of a step (in loss-vector order) this rank runs: all of them, or its
        share in a pert group (SPSA's +eps passes on one rank of a pair, -eps on the other)."""
        return rank_share(step_passes, self.dims.pert, self.pert_rank)

    def sum_to_host(self, values: torch.Tensor | list) -> list[float]:
        """Sum over this context's ranks, read on the host (a 1-rank context inside a job
        reduces nothing): the step's one all-reduce, and evaluation's sums."""
        if not self.is_distributed:
            return self.comm.read(self.comm.stack(values))
        return self.comm.sum_to_host(values)

    def shard_batch(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This dp group's contiguous share of a global batch; the ranks of a pert group
        get the same rows."""
        size = next(iter(batch.values())).shape[0]
        if size % self.dims.dp:
            raise ValueError(
                f"shard_batch: the batch's {size} rows do not split over dp {self.dims.dp}; "
                f"pass a multiple of {self.dims.dp} rows"
            )
        share = size // self.dims.dp
        lo = self.dp_rank * share
        return {key: value[lo : lo + share] for key, value in batch.items()}
