"""What the engine reads of a batch: ``count_tokens``, public and documented as what a
data-parallel caller passes as ``num_items``, must count what the engine's own objective
divides by; and the length check reads the sequence axis of a choice batch too."""

from __future__ import annotations

import pytest
import torch

from distzo.engine import count_tokens
from distzo.engine.batches import check_batch
from distzo.objectives.lm import LanguageModeling

IDS = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
LABELS = torch.tensor([[-100, -100, 7, 8], [9, 10, -100, -100]])  # row 1: 9 is never predicted


@pytest.mark.parametrize(
    "batch, tokens, label_tokens",
    [
        ({"input_ids": IDS}, 8, 6),  # every token but each row's first is predicted
        ({"input_ids": IDS, "attention_mask": MASK}, 6, 4),  # padding neither read nor scored
        ({"input_ids": IDS, "attention_mask": MASK, "labels": LABELS}, 6, 3),
    ],
)
def test_count_tokens_counts_what_the_lm_objective_divides_by(batch, tokens, label_tokens):
    assert count_tokens(batch) == (tokens, label_tokens)
    assert LanguageModeling().num_items(batch) == label_tokens


def test_a_sequence_of_exactly_the_models_positions_is_accepted():
    check_batch({"input_ids": IDS}, limit=4, prefix=0)
    with pytest.raises(ValueError, match="^sequences of 4 tokens after a 1-token prefix exceed"):
        check_batch({"input_ids": IDS}, limit=4, prefix=1)


def test_a_choice_batch_is_checked_along_its_sequence_not_its_candidates():
    """A choice batch is examples x candidate rows x sequence: 2 examples of 6 candidates
    of 3 tokens fit 4 positions; of 5 tokens they do not."""
    short = torch.ones(2, 6, 3, dtype=torch.int64)
    check_batch({"input_ids": short}, limit=4, prefix=0, dims=3)
    with pytest.raises(ValueError, match="^sequences of 5 tokens exceed the model's"):
        check_batch({"input_ids": torch.ones(2, 3, 5, dtype=torch.int64)}, 4, 0, dims=3)
