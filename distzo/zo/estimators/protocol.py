"""What every estimator says of a step: the passes it runs and what their losses become.

A *pass* is one ``(query, sign)`` pair: the model at theta + sign * eps * z_query
(sign 0 is theta itself, the unperturbed pass). An estimator lists every pass of a step
in one order, the order of the step's loss vector; the ranks of a layout each run a
share of them, and the vectors of all ranks add up in the step's one all-reduce. From
the reduced vector the estimator gives one *update coefficient* c_j per query and the
step's reported losses. Every estimator's update is then the same:

    theta <- theta - lr * (mean_j c_j z_j + wd * theta)

so the pending update, momentum, Adam, checkpoints, the seed log and replay treat every
estimator alike: they carry the c_j (``projected_grads`` in their records).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

Pass = tuple[int, int]  # (query, sign): sign +1/-1 perturbs, 0 is the unperturbed model


@dataclass(frozen=True)
class StepLosses:
    """The losses a step reports: ``loss`` is the loss at theta (or its estimate),
    ``loss_plus`` the mean loss of the passes along +z, ``loss_minus`` that of the other
    end of each difference (SPSA's -z passes, FZOO's unperturbed pass)."""

    loss: float
    loss_plus: float
    loss_minus: float


class Estimator(Protocol):
    """A zeroth-order estimator of the step direction from forward passes only."""

    name: str
    default_noise: str  # the z it draws unless told otherwise
    default_queries: int  # its directions per step when --num-queries is not given
    min_queries: int  # the fewest directions its estimate is defined for
    pretrained_lr: float  # its authors' lr for full tuning of a pretrained model

    def passes(self, num_queries: int) -> tuple[Pass, ...]:
        """Every pass of a step with ``num_queries`` directions, in loss-vector order."""
        ...

    def update_coefficients(self, losses: Sequence[float], eps: float) -> tuple[float, ...]:
        """One c_j per query from the reduced loss vector: the update moves along
        ``mean_j c_j z_j``."""
        ...

    def step_losses(self, losses: Sequence[float]) -> StepLosses:
        """The losses the step reports, from the reduced loss vector."""
        ...


def rank_share(passes: tuple[Pass, ...], ranks: int, index: int) -> tuple[Pass, ...]:
    """The passes rank ``index`` of ``ranks`` (a pert group) runs: every ``ranks``-th pass
    from its own. For SPSA's ``(+, -)`` pairs and two ranks that is every +eps pass on
    one rank and every -eps pass on the other; passes split as evenly as they can."""
    return tuple(p for k, p in enumerate(passes) if k % ranks == index)


def loss_contribution(
    losses: Mapping[Pass, torch.Tensor], step_passes: tuple[Pass, ...]
) -> torch.Tensor:
    """This rank's share of the step's loss vector (``step_passes`` order) as one float64
    vector.

    ``losses`` maps each pass this rank ran to its loss, already normalised by the
    *global* count, so summing the vectors of all ranks (the step's single all-reduce)
    gives the losses of the whole global batch for every parallel layout. A pass a rank
    did not run contributes 0.
    """
    first = next(iter(losses.values()))
    zero = torch.zeros((), device=first.device, dtype=torch.float64)
    return torch.stack([losses[p].to(torch.float64) if p in losses else zero for p in step_passes])
