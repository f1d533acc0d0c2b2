"""What the launcher (torchrun, SLURM via torchrun) told this process about its place."""

from __future__ import annotations

import os
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

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> LaunchEnv:
        """Read torchrun's variables; a plain ``python -m`` run is one process of one."""
        env = os.environ if environ is None else environ
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return cls()
        return cls(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
            node_rank=int(env.get("GROUP_RANK", 0)),
            launched=True,
            max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", 0)),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
        )
