"""Optimizers with stored moments: ZO momentum and MeZO-Adam, one bucket chunk at a time.

A step's gradient estimate is ``ghat = mean_j g_j z_j``. It is never materialised
whole: each chunk of a bucket regenerates its piece of every ``z_j``, forms that piece
of ``ghat`` in a scratch, updates the moments' piece and then theta's, while all of
them are hot (on CUDA with Triton: one kernel per bucket, ``triton_noise.momentum``
or ``adam``, reading and writing theta and the moments once). The moments live beside
their bucket (``distzo.offload`` moves them with it), so the update needs no more than
the bucket's own chunk of each.

* momentum: ``m = beta1 m + ghat``; ``theta -= lr (m + wd theta)`` (decay first, as
  the recomputed momentum does);
* adam (MeZO-Adam: MeZO hands ``ghat`` to the AdamW of transformers):
  ``m = beta1 m + (1 - beta1) ghat``, ``v = beta2 v + (1 - beta2) ghat^2``,
  ``theta -= lr sqrt(1 - beta2^t) / (1 - beta1^t) m / (sqrt(v) + eps)`` with t the
  1-based step, then ``theta -= lr wd theta`` (decay after the step, as that AdamW).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from distzo.zo import triton_noise

if TYPE_CHECKING:
    from distzo.zo.noise import NoiseSource

# The names torch's own optimizers give these states (SGD's and AdamW's), for state dicts.
MOMENT_NAMES = {"momentum": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq")}


class MomentOptions(Protocol):
    """The options a rule is read from (``ZOConfig`` has them): zo states what it needs
    rather than importing the config layer above it."""

    @property
    def stored_state(self) -> bool: ...

    optimizer: str
    beta1: float
    beta2: float
    adam_eps: float


@dataclass(frozen=True)
class MomentRule:
    """Which optimizer keeps moments, and its coefficients."""

    optimizer: str  # "momentum" or "adam"
    beta1: float
    beta2: float = 0.999
    eps: float = 1e-8

    @classmethod
    def of(cls, config: MomentOptions) -> MomentRule | None:
        """The config's rule, or None when it stores no moments (ZO-SGD, recomputed momentum)."""
        if not config.stored_state:
            return None
        return cls(config.optimizer, config.beta1, config.beta2, config.adam_eps)

    @property
    def names(self) -> tuple[str, ...]:
        return MOMENT_NAMES[self.optimizer]

    @property
    def num_moments(self) -> int:
        return len(self.names)

    @property
    def scratch_pieces(self) -> int:
        """Noise pieces of scratch the update holds: ``ghat``, and Adam's denominator."""
        return 2 if self.optimizer == "adam" else 1


class MomentUpdater:
    """Applies a rule's update to buckets and their moments, with scratch made once
    (``ghat`` and Adam's denominator, one noise piece each), so steps allocate nothing.
    ``noise`` sizes the scratch; each ``apply`` draws from the source it is given (the
    engine's own, which a restore replaces)."""

    def __init__(self, rule: MomentRule, noise: NoiseSource) -> None:
        self.rule = rule
        self._scratch = torch.empty(
            rule.scratch_pieces, noise.piece, device=noise.device, dtype=noise.dtype
        )

    @property
    def device_bytes(self) -> int:
        return self._scratch.nbytes

    def _launch(
        self,
        noise: NoiseSource,
        theta: torch.Tensor,
        moments: Sequence[torch.Tensor],
        decay: tuple[int, float],
        keys: list[tuple[int, int]],
        alphas: list[float],
        lr: float,
        step_size: float,
    ) -> None:
        """The rule's fused Triton kernel: ghat = sum_j alpha_j z_j drawn in registers,
        theta and the moments read once and written once (``apply``'s arithmetic)."""
        rule, draws = self.rule, (noise.kind, noise.kind_table)
        if rule.optimizer == "momentum":
            triton_noise.momentum(theta, moments[0], *decay, keys, alphas, rule.beta1, lr, *draws)
            return
        coefficients = (rule.beta1, rule.beta2, rule.eps, step_size)
        m, v = moments
        triton_noise.adam(theta, m, v, *decay, keys, alphas, coefficients, *draws)

    def apply(
        self,
        noise: NoiseSource,
        theta: torch.Tensor,
        moments: Sequence[torch.Tensor],
        decay_end: int,
        lr: float,
        weight_decay: float,
        step: int,
        projected_grads: Sequence[float],
        block_id: int,
    ) -> None:
        """Update ``theta`` and its ``moments`` (same length) in place with step ``step``'s
        estimate; weight decay only on ``theta[:decay_end]``."""
        rule = self.rule
        n, c = theta.numel(), noise.piece
        q = len(projected_grads)
        shrink = 1.0 - lr * weight_decay
        decay_end = decay_end if weight_decay else 0
        step_size = 0.0
        if rule.optimizer == "adam":
            t = step + 1
            step_size = lr * math.sqrt(1.0 - rule.beta2**t) / (1.0 - rule.beta1**t)
        if noise.fuses(theta, *moments):  # CUDA: one kernel, the same arithmetic
            keys = [noise.key(step, block_id, query) for query in range(q)]
            alphas = [g / q for g in projected_grads]
            self._launch(noise, theta, moments, (decay_end, shrink), keys, alphas, lr, step_size)
            return
        for lo in range(0, n, c):
            hi = min(lo + c, n)
            ghat = self._scratch[0, : hi - lo]
            for query, g in enumerate(projected_grads):
                for z_lo, z_hi, z in noise.chunks(lo, hi, n, step, block_id, query):
                    part = ghat[z_lo - lo : z_hi - lo]
                    if query == 0:
                        torch.mul(z, g / q, out=part)
                    else:
                        part.add_(z, alpha=g / q)
            piece = theta[lo:hi]
            decayed = piece[: max(min(hi, decay_end) - lo, 0)]
            m = moments[0][lo:hi]
            if rule.optimizer == "momentum":
                m.mul_(rule.beta1).add_(ghat)
                decayed.mul_(shrink)
                piece.add_(m, alpha=-lr)
                continue
            v = moments[1][lo:hi]
            m.mul_(rule.beta1).add_(ghat, alpha=1.0 - rule.beta1)
            v.mul_(rule.beta2).addcmul_(ghat, ghat, value=1.0 - rule.beta2)
            denom = self._scratch[1, : hi - lo]
            torch.sqrt(v, out=denom)
            denom.add_(rule.eps)
            piece.addcdiv_(m, denom, value=-step_size)
            decayed.mul_(shrink)
