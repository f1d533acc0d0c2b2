"""The only collectives a ZO step needs: one seed broadcast per run, one sum per step."""

from __future__ import annotations

import secrets

import torch
import torch.distributed as dist


def broadcast_seed(seed: int | None, device: torch.device) -> int:
    """Rank 0 picks the run seed (or takes the given one) and every rank receives it,
    so noise and data agree everywhere without relying on any global RNG state."""
    value = seed if seed is not None else secrets.randbits(62)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return int(value)
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(tensor, src=0)
    return int(tensor.item())


def sum_over_world(vector: torch.Tensor) -> torch.Tensor:
    """All-reduce (sum) of the step's small ``[L+, L-]`` vector over every rank."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(vector, op=dist.ReduceOp.SUM)
    return vector
