"""A node's shard group: slice i of every bucket belongs to members[i], and the gathers
order their pieces by group rank (NCCL's numbering: ascending global rank), so the two
orders are one whatever order the launcher gave the local ranks."""

from __future__ import annotations

import pytest

from distzo.dist import LaunchEnv, ShardGroup, parallel_context
from distzo.dist import process_group as pg


class TwoRanksOneNode:
    """A host group where global rank 0 was given local rank 1 and rank 1 local rank 0."""

    def __init__(self) -> None:
        self.groups: list[list[int]] = []

    def all_gather_object(self, value):
        return [(0, 1, 2), (0, 0, 2)]  # (node, local rank, local world) of ranks 0 and 1

    def new_group(self, ranks, backend=None):
        self.groups.append(list(ranks))
        return f"group{len(self.groups)}"


def test_members_are_listed_in_the_groups_rank_order_not_the_local_rank_order():
    comm = TwoRanksOneNode()
    env = LaunchEnv(rank=0, world_size=2, local_rank=1, local_world_size=2, launched=True)
    group, members = pg.node_groups(env, comm)
    assert members == [0, 1] and comm.groups == [[0, 1]]


def test_a_slice_order_that_differs_from_the_group_rank_is_refused(monkeypatch):
    monkeypatch.setattr(parallel_context.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(parallel_context.dist, "get_rank", lambda group: 1)
    assert ShardGroup.of("g", [3, 5], 5).rank == 1
    with pytest.raises(RuntimeError, match="rank 3 is rank 1 of its shard group but owns slice 0"):
        ShardGroup.of("g", [3, 5], 3)


class UnevenNodes(TwoRanksOneNode):
    """Three ranks: node 0 started two, node 1 one."""

    def all_gather_object(self, value):
        return [(0, 0, 2), (0, 1, 2), (1, 0, 1)]


def test_nodes_with_different_rank_counts_are_refused_naming_them_and_the_fix():
    env = LaunchEnv(rank=2, world_size=3, local_rank=0, local_world_size=1, launched=True)
    message = r"node 0 runs 2, node 1 runs 1 .* same --nproc_per_node$"
    with pytest.raises(ValueError, match=message):
        pg.node_groups(env, UnevenNodes())
