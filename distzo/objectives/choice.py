"""Classification and multiple choice: every candidate scored by the mean log-likelihood
of its tokens (the rule evaluation takes the argmax of), the loss read off those scores.

* ``Classification``: MeZO's ``--train_as_classification``, the cross-entropy of the right
  candidate among the example's candidates, softmax over the scores.
* ``Accuracy``: MeZO's non-differentiable objective, minus the fraction of examples whose
  best-scored candidate is the right one.

A batch holds whole examples along dim 0, so it shards over data-parallel ranks like any
batch; each rank's loss is its examples' sum divided by the *global* example count, and
the ranks' values add up to the global mean in the step's one all-reduce. An example
whose candidates are all single tokens (SST-2's " terrible" / " great") is one row, its
prompt: the logits of the prompt's last position score every candidate (a masked LM's,
RoBERTa's: those at its ``<mask>``, wherever the batch's ``score_position`` says).
Otherwise each candidate is a row of its own (prompt + candidate).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from distzo.objectives.protocol import PassRunner
from distzo.objectives.scoring import HeadTargets, broken_rows, picked_log_probs
from distzo.runtime.devices import to_device
from distzo.zo.estimators import Pass

# input_ids / attention_mask [E, R, L]; per scored token s of example e: score_position
# [E, S] (flat r * L + t of the position whose logits predict it, -1 = none), score_token,
# score_candidate (-1 = none); label [E]. Optional, where an example has several right
# candidates (ReCoRD's answers): right [E, K], their indices (-1 = none).
CHOICE_KEYS = (
    "input_ids",
    "attention_mask",
    "score_position",
    "score_token",
    "score_candidate",
    "label",
)


@dataclass(frozen=True)
class ChoiceEncoding:
    """One example, tokenized: its rows and, per scored token, (row, position, token, candidate)."""

    rows: tuple[tuple[int, ...], ...]
    scored: tuple[tuple[int, int, int, int], ...]
    label: int
    right: tuple[int, ...] = ()  # every right candidate where several are; else ``label``


def collate_choices(encodings: Sequence[ChoiceEncoding], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded rows; an example with fewer rows than the batch's widest gets rows of a
    single visible pad token (a row with no visible token has no defined attention)."""
    if not encodings:
        raise ValueError("a choice batch needs at least one example")
    rows = max(len(e.rows) for e in encodings)
    length = max(len(r) for e in encodings for r in e.rows)
    scored = max(len(e.scored) for e in encodings)
    count = len(encodings)
    input_ids = torch.full((count, rows, length), pad_id, dtype=torch.long)
    mask = torch.zeros((count, rows, length), dtype=torch.long)
    position = torch.full((count, scored), -1, dtype=torch.long)
    token = torch.zeros((count, scored), dtype=torch.long)
    candidate = torch.full((count, scored), -1, dtype=torch.long)
    for e, encoding in enumerate(encodings):
        mask[e, :, 0] = 1
        for r, ids in enumerate(encoding.rows):
            input_ids[e, r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[e, r, : len(ids)] = 1
        for s, (r, t, tok, c) in enumerate(encoding.scored):
            position[e, s], token[e, s], candidate[e, s] = r * length + t, tok, c
    label = torch.tensor([e.label for e in encodings], dtype=torch.long)
    batch = {
        "input_ids": input_ids,
        "attention_mask": mask,
        "score_position": position,
        "score_token": token,
        "score_candidate": candidate,
        "label": label,
    }
    if any(e.right for e in encodings):  # a key of examples, so it shards with them
        right = torch.full((count, max(len(e.right) for e in encodings)), -1, dtype=torch.long)
        for e, encoding in enumerate(encodings):
            indices = encoding.right or (encoding.label,)
            right[e, : len(indices)] = torch.tensor(indices, dtype=torch.long)
        batch["right"] = right
    return batch


@dataclass
class ChoiceBatch:
    input_ids: torch.Tensor  # [E * R, L], on the device
    attention_mask: torch.Tensor  # on the host: the model's masks are built there
    targets: HeadTargets  # groups: e * C + candidate
    counts: torch.Tensor  # [E * C] tokens per candidate
    present: torch.Tensor  # [E, C] candidates that exist
    labels: torch.Tensor  # [E] the right candidate trained on
    right: torch.Tensor  # [E, C] every right candidate (a pick among them is a hit)
    examples: int
    candidates: int


def check_choice_batch(batch: Mapping[str, torch.Tensor]) -> None:
    missing = [k for k in CHOICE_KEYS if k not in batch]
    if missing:
        raise ValueError(
            f"this objective scores candidates: the batch lacks {', '.join(missing)} "
            "(build it with distzo.objectives.collate_choices)"
        )


def prepare_choices(
    batch: Mapping[str, torch.Tensor], device: torch.device, full_head: bool = False
) -> ChoiceBatch:
    check_choice_batch(batch)
    input_ids = batch["input_ids"]
    examples, rows, length = input_ids.shape
    candidate = batch["score_candidate"].cpu()
    candidates = int(candidate.max()) + 1
    e, s = (candidate >= 0).nonzero(as_tuple=True)
    flat = e * rows * length + batch["score_position"].cpu()[e, s]
    group = e * candidates + candidate[e, s]
    counts = torch.bincount(group, minlength=examples * candidates)
    targets = HeadTargets.build(flat, batch["score_token"].cpu()[e, s], group, device, full_head)
    return ChoiceBatch(
        to_device(input_ids.reshape(examples * rows, length), device),
        batch["attention_mask"].reshape(examples * rows, length).cpu(),
        targets,
        to_device(counts, device),
        to_device((counts > 0).view(examples, candidates), device),
        to_device(batch["label"], device),
        to_device(_right(batch, examples, candidates), device),
        examples,
        candidates,
    )


def _right(batch: Mapping[str, torch.Tensor], examples: int, candidates: int) -> torch.Tensor:
    """[E, C] on the host: the candidates of ``right`` where the batch has it, else each
    example's label alone."""
    indices = batch.get("right")
    if indices is None:
        indices = batch["label"].cpu().unsqueeze(1)
    indices = indices.cpu()
    mask = torch.zeros((examples, candidates + 1), dtype=torch.bool)
    # -1 (no index) lands in the spare last column, dropped
    mask.scatter_(1, indices.where(indices >= 0, candidates), True)
    return mask[:, :candidates]


def hits(scores: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """[E] whether each example's best-scored candidate (the first on ties) is a right one."""
    return right.gather(1, scores.argmax(dim=1, keepdim=True)).squeeze(1)


def candidate_scores(
    runner: PassRunner, prepared: ChoiceBatch, p: Pass, hidden: torch.Tensor
) -> torch.Tensor:
    """[E, C]: each candidate's mean token log-likelihood; -inf where an example has fewer."""
    log_probs, _ = picked_log_probs(runner, p, hidden, prepared.targets)
    sums = log_probs.new_zeros(prepared.examples * prepared.candidates).index_add_(
        0, prepared.targets.groups, log_probs
    )
    scores = (sums / prepared.counts.clamp(min=1)).view(prepared.examples, prepared.candidates)
    return scores.masked_fill(~prepared.present, float("-inf"))


class _ChoiceObjective(ABC):
    """Scores every candidate of each example, then reads one number off the scores."""

    name = ""
    batch_dims = 3  # input_ids: examples x candidate rows x tokens

    def __init__(self, full_head: bool = False) -> None:
        self.full_head = full_head

    def check_batch(self, batch: Mapping[str, torch.Tensor]) -> None:
        """The batch's keys, checked before its shapes (a plain LM batch is named as such)."""
        check_choice_batch(batch)

    def num_items(self, batch: Mapping[str, torch.Tensor]) -> int:
        check_choice_batch(batch)
        return int(batch["label"].shape[0])

    def prepare(self, batch: Mapping[str, torch.Tensor], device: torch.device) -> ChoiceBatch:
        return prepare_choices(batch, device, self.full_head)

    def losses(
        self, runner: PassRunner, prepared: ChoiceBatch, passes: tuple[Pass, ...], num_items: int
    ) -> dict[Pass, torch.Tensor]:
        hiddens = runner.hidden_states(
            {p: prepared.input_ids for p in passes}, prepared.attention_mask
        )
        return {
            p: self.from_scores(candidate_scores(runner, prepared, p, hidden), prepared) / num_items
            for p, hidden in hiddens.items()
        }

    @abstractmethod
    def from_scores(self, scores: torch.Tensor, prepared: ChoiceBatch) -> torch.Tensor:
        """The summed loss of the examples, from their [E, C] scores and right candidates."""


def classification_losses(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[E]: each example's -log softmax(scores)[label], its [E, C] candidates' scores."""
    right = scores.gather(1, labels.unsqueeze(1)).squeeze(1)
    return torch.logsumexp(scores, dim=1) - right


def label_tokens(prepared: ChoiceBatch) -> torch.Tensor:
    """[E]: the tokens of each example's trained candidate (its ``label``)."""
    counts = prepared.counts.view(prepared.examples, prepared.candidates)
    return counts.gather(1, prepared.labels.unsqueeze(1)).squeeze(1)


# The objectives whose loss an evaluation reports beside its metrics (``choice_loss``):
# the differentiable ones; ``accuracy`` and ``f1`` are minus the metric reported.
SCORED_LOSSES = ("lm", "classification")


def choice_loss(
    objective: str, scores: torch.Tensor, labels: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, what it is a mean over) of examples under ``objective``, read off
    their [E, C] candidate scores, [E] labels and [E] tokens of the labelled candidate:
    ``classification``'s cross-entropy per example; ``lm``'s negative log-likelihood of
    the right answer's tokens (a score is their mean: the row ``PromptEncoder.encode``
    lays out, which teacher forcing trains on), per token."""
    if objective == "classification":
        return classification_losses(scores, labels).sum(), labels.new_tensor(labels.shape[0])
    if objective == "lm":
        right = scores.gather(1, labels.unsqueeze(1)).squeeze(1)
        return -(right * tokens).sum(), tokens.sum()
    raise ValueError(f"no loss read off candidate scores for --objective {objective}")


class Classification(_ChoiceObjective):
    """Sum over examples of -log softmax(scores)[label] (MeZO: CrossEntropyLoss over the
    candidates' mean log-likelihoods)."""

    name = "classification"

    def from_scores(self, scores: torch.Tensor, prepared: ChoiceBatch) -> torch.Tensor:
        return classification_losses(scores, prepared.labels).sum()


class Accuracy(_ChoiceObjective):
    """Minus the number of examples whose best candidate (first on ties) is a right one."""

    name = "accuracy"

    def from_scores(self, scores: torch.Tensor, prepared: ChoiceBatch) -> torch.Tensor:
        """NaN where a score is: argmax would count a pick among NaNs as a hit or a miss,
        and the loss of broken weights would stay finite (no divergence stops the run)."""
        count = -hits(scores, prepared.right).sum().to(torch.float64)  # exact in float64
        return torch.where(broken_rows(scores).any(), torch.nan, count)
