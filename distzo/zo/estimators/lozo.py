"""LOZO, low-rank ZO (optsuite/LOZO): SPSA's two-sided differences along a low-rank z.

Each weight matrix W (rows x columns) is perturbed along Z = U V^T, U (rows x r) drawn each
step and V (columns x r) kept for ``lozo_interval`` steps, both standard Gaussian; vectors
(biases, norms) along an ordinary Gaussian z (``distzo.zo.lowrank``). Then, as SPSA:

    g = (L(theta + eps Z) - L(theta - eps Z)) / (2 eps)
    theta <- theta - lr * (g Z + wd theta)

E[Z <Z, G>] = r G over U and V, so the estimate is r times the gradient on average (the lr
absorbs the r). The passes, the loss vector and the coefficients are SPSA's; what makes
it LOZO is its noise, ``lowrank``, which this estimator takes by default and requires.
"""

from __future__ import annotations

from distzo.zo.estimators.spsa import SPSA


class LOZO(SPSA):
    """SPSA along LOZO's low-rank z (module docstring)."""

    name = "lozo"
    default_noise = "lowrank"
    pretrained_lr = 1e-6  # LOZO's README: 1e-6 or 1e-7 for OPT-13B
