"""SPSA, MeZO's estimator, and its n-query form (n-SPSA).

A step draws q directions z_0 .. z_{q-1} and runs each on both sides:

    L+_j = L(theta + eps z_j),   L-_j = L(theta - eps z_j)
    g_j  = (L+_j - L-_j) / (2 eps)        the central difference along z_j
    theta <- theta - lr * (mean_j g_j z_j + wd theta)

g_j is z_j . grad L up to O(eps^2), and E[z z^T] = I for Gaussian or Rademacher z, so
mean_j g_j z_j is an unbiased estimate of the gradient (to that order) whose variance
falls as 1/q. The update coefficient c_j is g_j itself. 2q forward passes per step; the
loss vector is ``[L+_0, L-_0, L+_1, L-_1, ...]``; q = 1 is MeZO's ZO-SGD.
"""

from __future__ import annotations

from collections.abc import Sequence

from distzo.zo.estimators.protocol import Pass, StepLosses


def projected_gradient(loss_plus: float, loss_minus: float, eps: float) -> float:
    """g = (L+ - L-) / (2 eps): the directional derivative along z (central difference)."""
    return (loss_plus - loss_minus) / (2.0 * eps)


class SPSA:
    """Two-sided differences along q directions (module docstring)."""

    name = "spsa"
    default_noise = "gaussian"
    default_queries = 1
    min_queries = 1
    pretrained_lr = 1e-6  # MeZO's, for full-parameter OPT

    def passes(self, num_queries: int) -> tuple[Pass, ...]:
        """(j, +1), (j, -1) for each query j."""
        return tuple((query, sign) for query in range(num_queries) for sign in (1, -1))

    def update_coefficients(self, losses: Sequence[float], eps: float) -> tuple[float, ...]:
        """g_j of each query from ``[L+_0, L-_0, ...]``."""
        return tuple(
            projected_gradient(losses[i], losses[i + 1], eps) for i in range(0, len(losses), 2)
        )

    def step_losses(self, losses: Sequence[float]) -> StepLosses:
        """The means of L+ and of L- over the queries; their mean is L(theta) to first order."""
        q = len(losses) // 2
        loss_plus, loss_minus = sum(losses[0::2]) / q, sum(losses[1::2]) / q
        return StepLosses((loss_plus + loss_minus) / 2, loss_plus, loss_minus)
