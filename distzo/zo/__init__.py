"""Zeroth-order pieces: counter-based noise, the (n-)SPSA estimator, lr schedules."""

from distzo.zo.estimator import (
    Pass,
    loss_contribution,
    passes,
    projected_gradient,
    projected_gradients,
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
    "Pass",
    "loss_contribution",
    "passes",
    "projected_gradient",
    "projected_gradients",
    "learning_rate",
    "SCHEDULES",
]
