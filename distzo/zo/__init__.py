"""Zeroth-order pieces: counter-based noise (and LOZO's low-rank kind), the estimators
(SPSA, FZOO, LOZO), lr schedules and the stored-moment rules (momentum, MeZO-Adam)."""

from distzo.zo.estimators import (
    ESTIMATORS,
    Estimator,
    Pass,
    estimator_for,
    loss_contribution,
    projected_gradient,
    rank_share,
)
from distzo.zo.noise import (
    NOISE_KINDS,
    NOISE_VERSION,
    NoiseSource,
    drawable,
    identity_kind,
    noise_identity,
    noise_seed,
)
from distzo.zo.schedule import SCHEDULES, learning_rate

__all__ = [
    "NOISE_KINDS",
    "NOISE_VERSION",
    "NoiseSource",
    "drawable",
    "identity_kind",
    "noise_identity",
    "noise_seed",
    "ESTIMATORS",
    "Estimator",
    "Pass",
    "estimator_for",
    "loss_contribution",
    "projected_gradient",
    "rank_share",
    "learning_rate",
    "SCHEDULES",
]
