"""The estimators a step can use, each a small module with its math in its docstring:
``spsa`` (MeZO's, and n-SPSA), ``fzoo`` and ``lozo`` (SPSA along low-rank z).
``protocol`` is what they share."""

from distzo.zo.estimators.fzoo import FZOO
from distzo.zo.estimators.lozo import LOZO
from distzo.zo.estimators.protocol import (
    Estimator,
    Pass,
    StepLosses,
    loss_contribution,
    rank_share,
)
from distzo.zo.estimators.spsa import SPSA, projected_gradient

ESTIMATORS: dict[str, Estimator] = {"spsa": SPSA(), "fzoo": FZOO(), "lozo": LOZO()}


def estimator_for(name: str) -> Estimator:
    """The estimator called ``name`` (one of ``ESTIMATORS``)."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"estimator must be one of {', '.join(ESTIMATORS)}, got {name!r}"
        ) from None


__all__ = [
    "ESTIMATORS",
    "FZOO",
    "LOZO",
    "SPSA",
    "Estimator",
    "Pass",
    "StepLosses",
    "estimator_for",
    "loss_contribution",
    "projected_gradient",
    "rank_share",
]
