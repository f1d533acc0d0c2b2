"""The two things an objective may ask of the model: run the blocks, read the head."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from distzo.zo.estimators import Pass


class PassRunner(Protocol):
    """The model at one step's perturbations (or unperturbed, for evaluation).

    Every ``hidden_states`` call streams each block through the device once and runs it
    for every pass; the first call of a step also applies the pending update.
    """

    device: torch.device

    def hidden_states(
        self, input_ids: Mapping[Pass, torch.Tensor], attention_mask: torch.Tensor | None
    ) -> dict[Pass, torch.Tensor]:
        """Each pass's last hidden states ``[rows, length, width]`` for its own token ids
        (device tensors) and one shared padding mask (a host tensor: the model's masks are
        built on the host, so nothing waits for the device; None: no padding). The dict's
        first key is the pass whose head is cheapest to read next, so reading heads in its
        order perturbs the resident bucket least."""
        ...

    def head(self, p: Pass, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits of ``hidden`` (any leading shape) under pass ``p``'s
        perturbation: final norm, projections and LM head, nothing else."""
        ...


class Objective(Protocol):
    """One loss per pass, each a share of the global batch's figure: the ranks' values
    add up in the step's one all-reduce."""

    name: str

    def num_items(self, batch: Mapping[str, torch.Tensor]) -> int:
        """What this objective averages over in ``batch`` (label tokens or examples);
        the global batch's count is each rank's normaliser."""
        ...

    def prepare(self, batch: Mapping[str, torch.Tensor], device: torch.device) -> Any:
        """Host-side work (index tensors from the CPU batch) and the copies to ``device``,
        before the step's first kernel: no device sync."""
        ...

    def losses(
        self, runner: PassRunner, prepared: Any, passes: tuple[Pass, ...], num_items: int
    ) -> dict[Pass, torch.Tensor]:
        """Each pass's loss (0-dim, at least float32) divided by the global ``num_items``."""
        ...
