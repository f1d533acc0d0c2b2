"""Forming the process group, the named mesh and the node-local shard groups."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from distzo.dist.collectives import Collectives
from distzo.dist.launch_env import LaunchEnv
from distzo.dist.launch_gate import await_every_rank, rendezvous_store
from distzo.dist.parallel_dims import ParallelDims

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "nccl", "gloo")


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("--backend nccl needs CUDA devices; use --backend gloo (or auto) on CPU")
    return backend


def init_process_group(env: LaunchEnv, backend: str, timeout_s: float) -> None:
    """Join the job's process group, once every rank has passed its own checks
    (``launch_gate``: a rank that refused its input ends the wait at once, on every
    node). A collective stuck past ``timeout_s`` (a dead peer) raises instead of hanging,
    so the whole job exits.

    torchrun's store outlives a restart (``--max-restarts``) and still holds the failed
    attempt's keys, among them the dead ranks' addresses, which gloo would try to reach:
    each attempt's groups live under a prefix of their own in it."""
    timeout = timedelta(seconds=timeout_s)
    store = rendezvous_store(env, timeout)
    if env.world_size > 1:
        await_every_rank(store, env, timeout_s)
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(f"distzo/attempt-{env.restart_count}", store),
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
    )


def build_mesh(dims: ParallelDims, device: torch.device, timeout: timedelta) -> DeviceMesh:
    """The named ``("dp", "pert")`` mesh, its groups with the job's timeout (DeviceMesh
    gives its groups torch's default unless their options carry one)."""
    backend = str(dist.get_backend())
    options = _backend_options(backend)
    override: dict[int | str, Any] | None = None
    if options is not None:  # NCCL or gloo (a test's stand-in backend keeps the default)
        options._timeout = timeout
        override = {name: (backend, options) for name in ("dp", "pert")}
    return init_device_mesh(
        device.type, (dims.dp, dims.pert), mesh_dim_names=("dp", "pert"), backend_override=override
    )


def _backend_options(backend: str) -> Any:
    """A fresh options object of ``backend``'s process groups, where torch has one."""
    if backend == "nccl":
        return dist.ProcessGroupNCCL.Options()
    if backend == "gloo":
        return dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    return None


def node_groups(env: LaunchEnv, comm: Collectives) -> tuple[dist.ProcessGroup, list[int]]:
    """This node's group of local ranks (the sliced transfer's shard group) and its members.

    Nodes are told apart by torchrun's GROUP_RANK and sized by LOCAL_WORLD_SIZE, as the
    launcher set them; every rank learns every node's members (over the host group),
    since each new_group must be created by all ranks in the same order.
    """
    places = comm.all_gather_object((env.node_rank, env.local_rank, env.local_world_size))
    by_node: dict[int, list[tuple[int, int]]] = {}
    for rank, (node, local_rank, _) in enumerate(places):
        by_node.setdefault(node, []).append((local_rank, rank))
    _check_even_nodes({node: local_world for node, _, local_world in places})
    mine = None
    for node in sorted(by_node):
        members = sorted(rank for _, rank in by_node[node])  # the group's own rank order
        group = comm.new_group(members)
        if node == env.node_rank:
            assert group is not None, "new_group left out one of its own ranks"
            mine = (group, members)
    assert mine is not None
    return mine


def _check_even_nodes(ranks_per_node: dict[int, int]) -> None:
    """Refuse nodes that run different numbers of ranks, naming them (every rank sees the
    same counts, so every rank raises the same line)."""
    counts = sorted(ranks_per_node.items())
    if len({count for _, count in counts}) > 1:
        said = ", ".join(f"node {node} runs {count}" for node, count in counts)
        raise ValueError(
            f"every node must run the same number of ranks, but {said} (torchrun's "
            "--nproc_per_node, LOCAL_WORLD_SIZE); start every node's torchrun with the same "
            "--nproc_per_node"
        )


def cpu_threads(
    threads: int | None,
    env: LaunchEnv,
    environ: Mapping[str, str] | None = None,
    cores: int | None = None,
) -> tuple[int, str]:
    """A CPU rank's intra-op thread count, and where it came from (for the log).

    ``--threads N`` sets N and ``--threads 0`` gives each local rank its share of the cores.
    Unset, an ``OMP_NUM_THREADS`` in the environment is the user's (or torchrun's, which sets
    1 for several local ranks) and is kept; else 1, as torchrun does: the tiny and small
    models a CPU run trains gain nothing from more threads, and ranks or jobs sharing the
    cores slow each other down by 10x and more when each spreads over all of them."""
    if threads is None:
        given = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "").strip()
        if not given:
            return 1, "the default; --threads N or OMP_NUM_THREADS sets it"
        first = given.split(",")[0].strip()  # OpenMP's nested form "4,2": the outer level
        if not first.isdigit() or int(first) < 1:
            raise ValueError(
                f"OMP_NUM_THREADS={given!r} is not a thread count; set it to a number >= 1, "
                "unset it, or give --threads N"
            )
        return int(first), "OMP_NUM_THREADS"
    if threads == 0:
        cores = cores or os.cpu_count() or 1
        count = max(1, cores // env.local_world_size)
        return count, f"--threads 0: {cores} cores / {env.local_world_size} local ranks"
    return threads, "--threads"


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
