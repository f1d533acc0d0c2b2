"""The update a step leaves behind.

A step does not write its update: it keeps ``(step, g, lr)`` (a few numbers) and each
bucket applies it the next time it is on the device, so a streamed block crosses the
link once per step. Momentum recomputed from the gradient history rides on the update
as that history.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# (step, projected_grads) of recent steps, newest first: a momentum's history
History = tuple[tuple[int, tuple[float, ...]], ...]


def step_grads(entries: Iterable[Sequence]) -> History:
    """``(step, projected_grads)`` pairs as ints and float tuples (from lists, a state
    dict or a checkpoint): a momentum's history."""
    return tuple((int(step), tuple(float(g) for g in grads)) for step, grads in entries)


@dataclass(frozen=True)
class PendingUpdate:
    """The last step's update, applied lazily when each bucket next reaches the device:
    theta -= lr * (mean_j g_j z_j + wd theta), z_j drawn for (step, query j).

    With momentum recomputed from the gradient history (MeZO, appendix B.2) ``history``
    holds the earlier steps' ``(step, projected_grads)``, newest first, and the update is
    theta -= lr * (m_t + wd theta), m_t = sum_k beta1^k mean_j g_{t-k,j} z_{t-k,j}: the
    momentum regenerated from its seeds, truncated to ``1 + len(history)`` steps."""

    step: int
    projected_grads: tuple[float, ...]
    lr: float
    history: History = ()
    beta1: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "projected_grads", tuple(float(g) for g in self.projected_grads))
        object.__setattr__(self, "history", step_grads(self.history))
        if not self.projected_grads:
            raise ValueError("a pending update needs one projected gradient per query, got none")

    def terms(self) -> list[tuple[int, int, float]]:
        """``(step, query, coefficient of z)`` of every noise draw the update adds, over lr."""
        steps = [(self.step, self.projected_grads), *self.history]
        return [
            (step, query, -(self.beta1**k) * g / len(grads))
            for k, (step, grads) in enumerate(steps)
            for query, g in enumerate(grads)
        ]
