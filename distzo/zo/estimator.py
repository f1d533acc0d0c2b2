"""The SPSA projected gradients (one per query), split so that ranks can each hold a part.

A step draws ``num_queries`` directions z_j (n-SPSA; MeZO's SPSA is one query) and runs
each at theta + eps z_j and theta - eps z_j. A *pass* is one ``(query, sign)`` pair; the
losses of all passes travel in one vector, so the step keeps its single all-reduce
whatever the number of queries.
"""

from __future__ import annotations

import torch

Pass = tuple[int, int]  # (query, sign): sign +1/-1 perturbs, 0 is the unperturbed model


def passes(num_queries: int, signs: tuple[int, ...]) -> tuple[Pass, ...]:
    """The passes a rank runs: every query, each with the signs this rank owns."""
    return tuple((query, sign) for query in range(num_queries) for sign in signs)


def loss_contribution(losses: dict[Pass, torch.Tensor], num_queries: int = 1) -> torch.Tensor:
    """This rank's share of ``[L+_0, L-_0, L+_1, L-_1, ...]`` as one float64 vector.

    ``losses`` maps each pass this rank ran to its loss, already normalised by the
    *global* token count, so summing the vectors of all ranks (the step's single
    all-reduce) gives the losses of the whole global batch for every parallel layout. A
    pass a rank did not run contributes 0.
    """
    first = next(iter(losses.values()))
    zero = torch.zeros((), device=first.device, dtype=torch.float64)
    return torch.stack(
        [losses[p].to(torch.float64) if p in losses else zero for p in passes(num_queries, (1, -1))]
    )


def projected_gradient(loss_plus: float, loss_minus: float, eps: float) -> float:
    """g = (L+ - L-) / (2 eps): the directional derivative along z (central difference)."""
    return (loss_plus - loss_minus) / (2.0 * eps)


def projected_gradients(losses: list[float], eps: float) -> tuple[float, ...]:
    """One g per query from the reduced ``[L+_0, L-_0, L+_1, L-_1, ...]``."""
    return tuple(
        projected_gradient(losses[i], losses[i + 1], eps) for i in range(0, len(losses), 2)
    )
