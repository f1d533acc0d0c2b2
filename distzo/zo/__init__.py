"""Zeroth-order pieces: counter-based noise, the SPSA estimator, lr schedules."""

from distzo.zo.estimator import loss_contribution, projected_gradient
from distzo.zo.noise import NoiseSource, noise_seed
from distzo.zo.schedule import SCHEDULES, learning_rate

__all__ = ["NoiseSource", "noise_seed", "loss_contribution", "projected_gradient", "learning_rate", "SCHEDULES"]
