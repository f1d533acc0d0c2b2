"""FZOO (arXiv 2506.09034): one-sided differences normalised by the spread of the losses.

A step draws N directions z_1 .. z_N (Rademacher +-1 by default) and runs each on one
side, plus the model itself:

    L_j   = L(theta + eps z_j)  for j = 1..N,     L_0 = L(theta)
    sigma = std(L_1 .. L_N)                       population std (divides by N)
    g_j   = (L_j - L_0) / (N sigma)
    theta <- theta - lr * sum_j g_j z_j           (+ lr wd theta when asked; FZOO has none)

(L_j - L_0) / eps estimates z_j . grad L, and sigma / eps estimates its spread over the
directions, about |grad L|: the step is a normalised gradient step whose length does
not follow the scale of the loss, so eps cancels and lr is the step's own length. For
Gaussian z, in the limit of small eps, the expected step direction is exactly
kappa_N grad L / |grad L|, with kappa_N = E[s + xbar^2 / s] over N standard normals
(s their population std, xbar their mean) = sqrt(2/N) G(N/2) / G((N-1)/2) +
sqrt(1/(2N)) G(N/2 - 1) / G((N-1)/2), G the gamma function: 1.447 for N = 3, 1.053 for
N = 8, tending to 1; for N = 2 it is infinite (the two losses can nearly agree).
Rademacher z comes close whenever z . grad L is near-Gaussian (many coordinates).

The engine's update moves along the *mean* of c_j z_j, so the coefficient kept per
query is c_j = N g_j = (L_j - L_0) / sigma, which makes mean_j c_j z_j exactly FZOO's
sum_j g_j z_j. When every L_j is equal, sigma is 0 and FZOO's own code would divide by
zero: here that step does not move (every c_j = 0). N + 1 forward passes per step; the
loss vector is ``[L_1, .., L_N, L_0]``; the step reports L_0 as its loss. N >= 2: one
loss has no spread.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from distzo.zo.estimators.protocol import Pass, StepLosses

UNPERTURBED: Pass = (0, 0)


def loss_spread(losses: Sequence[float]) -> float:
    """The population standard deviation of ``losses`` (torch's ``std(unbiased=False)``)."""
    mean = sum(losses) / len(losses)
    return math.sqrt(sum((x - mean) ** 2 for x in losses) / len(losses))


class FZOO:
    """One-sided, sigma-normalised differences along N directions (module docstring)."""

    name = "fzoo"
    default_noise = "rademacher"
    default_queries = 8
    min_queries = 2
    pretrained_lr = 1e-5  # FZOO's script's default (with eps 1e-3, N 8)

    def passes(self, num_queries: int) -> tuple[Pass, ...]:
        """(j, +1) for each query j, then the unperturbed pass."""
        return (*((query, 1) for query in range(num_queries)), UNPERTURBED)

    def update_coefficients(self, losses: Sequence[float], eps: float) -> tuple[float, ...]:
        """c_j = N g_j = (L_j - L_0) / sigma from ``[L_1, .., L_N, L_0]`` (eps cancels:
        the spread normalises the differences); all 0 when sigma is 0."""
        *perturbed, unperturbed = losses
        sigma = loss_spread(perturbed)
        if sigma == 0.0:
            return tuple(0.0 for _ in perturbed)
        return tuple((loss - unperturbed) / sigma for loss in perturbed)

    def step_losses(self, losses: Sequence[float]) -> StepLosses:
        """L_0 as the step's loss; the perturbed losses' mean as ``loss_plus``, L_0 as the
        other end of the differences."""
        *perturbed, unperturbed = losses
        return StepLosses(unperturbed, sum(perturbed) / len(perturbed), unperturbed)
