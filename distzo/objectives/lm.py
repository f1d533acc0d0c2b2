"""Teacher forcing on the label tokens: the causal-LM loss, with the head at labels only."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from distzo.objectives.protocol import PassRunner
from distzo.objectives.scoring import HeadTargets, picked_log_probs
from distzo.runtime.devices import to_device
from distzo.zo.estimators import Pass


def default_labels(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The batch's labels, or a plain causal LM's: every real token, never padding."""
    labels = batch.get("labels")
    if labels is not None:
        return labels
    mask = batch.get("attention_mask")
    return batch["input_ids"] if mask is None else batch["input_ids"].masked_fill(mask == 0, -100)


LM_KEYS = ("input_ids", "attention_mask", "labels")  # what a plain causal-LM batch holds


def check_lm_keys(batch: Mapping[str, torch.Tensor]) -> None:
    """Refuse keys a causal-LM batch does not have: a mistyped ``label`` was ignored, and
    the step trained on every token instead of the labels given."""
    unknown = [k for k in batch if k not in LM_KEYS]
    if unknown:
        raise ValueError(
            f"the batch has keys a language-modeling batch does not read: "
            f"{', '.join(map(repr, unknown))} (it reads {', '.join(LM_KEYS)}); rename or "
            "drop them"
        )


@dataclass
class LMBatch:
    input_ids: torch.Tensor  # on the device
    attention_mask: torch.Tensor | None  # on the host: the model's masks are built there
    targets: HeadTargets


def prepare_lm(
    batch: Mapping[str, torch.Tensor], device: torch.device, full_head: bool = False
) -> LMBatch:
    """Token t+1 of a row is predicted at position t: the head runs at the positions whose
    next label is not -100 (found on the host when the batch is on the host)."""
    input_ids = batch["input_ids"]
    labels = default_labels(batch)
    following = labels[:, 1:].cpu()
    rows, cols = (following != -100).nonzero(as_tuple=True)
    targets = HeadTargets.build(
        rows * input_ids.shape[1] + cols, following[rows, cols], None, device, full_head
    )
    mask = batch.get("attention_mask")
    return LMBatch(to_device(input_ids, device), mask.cpu() if mask is not None else None, targets)


def lm_sums(
    runner: PassRunner, prepared: LMBatch, p: Pass, hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed negative log-likelihood, number of argmax hits) over the label tokens."""
    log_probs, hits = picked_log_probs(runner, p, hidden, prepared.targets, with_hits=True)
    assert hits is not None  # asked for with_hits
    return -log_probs.sum(), hits.sum()


class LanguageModeling:
    """MeZO's loss with ``only_train_option``: next-token cross-entropy on the label tokens,
    summed and divided by the global label count (the HF Trainer's device-invariant loss)."""

    name = "lm"
    predicts_next_token = True  # a causal LM's loss: a masked LM's engine refuses it

    def __init__(self, full_head: bool = False) -> None:
        self.full_head = full_head

    def check_batch(self, batch: Mapping[str, torch.Tensor]) -> None:
        """Refuse keys the loss does not read (a mistyped ``label`` trained on every token)."""
        check_lm_keys(batch)

    def num_items(self, batch: Mapping[str, torch.Tensor]) -> int:
        return int((default_labels(batch)[..., 1:] != -100).sum())

    def prepare(self, batch: Mapping[str, torch.Tensor], device: torch.device) -> LMBatch:
        return prepare_lm(batch, device, self.full_head)

    def losses(
        self, runner: PassRunner, prepared: LMBatch, passes: tuple[Pass, ...], num_items: int
    ) -> dict[Pass, torch.Tensor]:
        hiddens = runner.hidden_states(
            {p: prepared.input_ids for p in passes}, prepared.attention_mask
        )
        return {
            p: -picked_log_probs(runner, p, hidden, prepared.targets)[0].sum() / num_items
            for p, hidden in hiddens.items()
        }
