"""The SPSA projected gradient, split so that ranks can each hold a part of it."""

from __future__ import annotations

import torch


def loss_contribution(losses: dict[int, torch.Tensor]) -> torch.Tensor:
    """This rank's share of ``[L+, L-]`` as one float64 vector.

    ``losses`` maps the sign (+1/-1) of each pass this rank ran to its loss, already
    normalised by the *global* token count, so summing the vectors of all ranks (the
    step's single all-reduce) gives the losses of the whole global batch for every
    parallel layout. A sign a rank did not run contributes 0.
    """
    first = next(iter(losses.values()))
    zero = torch.zeros((), device=first.device, dtype=torch.float64)
    return torch.stack([losses[s].to(torch.float64) if s in losses else zero for s in (1, -1)])


def projected_gradient(loss_plus: float, loss_minus: float, eps: float) -> float:
    """g = (L+ - L-) / (2 eps): the directional derivative along z (central difference)."""
    return (loss_plus - loss_minus) / (2.0 * eps)
