"""What the launcher (torchrun, SLURM via torchrun) told this process about its place."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0  # torchrun's GROUP_RANK: which agent (node) started this process
    launched: bool = False  # started by torchrun (a process group can be formed)
    # torchrun --max-restarts: the job is restarted after a failure that many times
    max_restarts: int = 0
    restart_count: int = 0  # which restart this is (0: the first attempt)

    @property
    def on_rank_zeros_node(self) -> bool:
        """Whether rank 0 runs on this node (torchrun numbers a node's ranks in a row from
        its local rank 0): where the work rank 0 does alone, the export, takes memory."""
        return self.rank == self.local_rank

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> LaunchEnv:
        """Read torchrun's variables; a plain ``python -m`` run is one process of one. A
        value no launcher writes (not a number, a rank outside the world) is refused in one
        line: it would otherwise wait out --dist-timeout for ranks that never come."""
        env = os.environ if environ is None else environ
        if "RANK" not in env:
            _refuse_task_launchers(env)
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return cls()
        world_size = _count(env, "WORLD_SIZE", None)
        local_world_size = _count(env, "LOCAL_WORLD_SIZE", world_size)
        if world_size < 1 or not 1 <= local_world_size <= world_size:
            raise ValueError(
                f"the launcher's WORLD_SIZE={world_size} and LOCAL_WORLD_SIZE="
                f"{local_world_size} make no job; launch with torchrun, which sets them"
            )
        launched = cls(
            rank=_count(env, "RANK", None),
            world_size=world_size,
            local_rank=_count(env, "LOCAL_RANK", 0),
            local_world_size=local_world_size,
            node_rank=_count(env, "GROUP_RANK", 0),
            # a world of one with no rendezvous address (RANK=0 WORLD_SIZE=1 left in a
            # shell) is a plain run: it has no group to form
            launched=world_size > 1 or "MASTER_ADDR" in env,
            max_restarts=_count(env, "TORCHELASTIC_MAX_RESTARTS", 0),
            restart_count=_count(env, "TORCHELASTIC_RESTART_COUNT", 0),
        )
        for name, value, bound, of in (
            ("RANK", launched.rank, world_size, "WORLD_SIZE"),
            ("LOCAL_RANK", launched.local_rank, local_world_size, "LOCAL_WORLD_SIZE"),
        ):
            if not 0 <= value < bound:
                raise ValueError(
                    f"the launcher's {name}={value} is not below {of}={bound}; launch with "
                    "torchrun, which sets them"
                )
        return launched


# Launchers that start the tasks of a job themselves, and the variable holding how many.
TASK_LAUNCHERS = (
    ("srun", "SLURM_STEP_NUM_TASKS"),
    ("mpirun", "OMPI_COMM_WORLD_SIZE"),
    ("mpirun", "PMI_SIZE"),
)


def _refuse_task_launchers(env: Mapping[str, str]) -> None:
    """Refuse several tasks started without torchrun (``srun -n 2 python -m distzo.train``):
    with no RANK each would be a job of one, training alone into the same output."""
    for launcher, variable in TASK_LAUNCHERS:
        tasks = env.get(variable, "1")
        if tasks.isdigit() and int(tasks) > 1:
            raise ValueError(
                f"{launcher} started {tasks} tasks ({variable}={tasks}) without torchrun, so "
                "each would train alone into the same output; start one torchrun agent per "
                "node (srun --ntasks-per-node=1 torchrun --nproc_per_node=GPUS ..., as "
                "launch/slurm.sbatch does)"
            )


def _count(env: Mapping[str, str], name: str, default: int | None) -> int:
    """The launcher's variable ``name`` as a whole number (``default`` when unset)."""
    if name not in env and default is not None:
        return default
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(
            f"the launcher's {name}={env[name]!r} is not a whole number; launch with torchrun, "
            "which sets it"
        ) from None
