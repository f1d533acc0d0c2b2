"""A task generated in code, so the default run and the tests need no download.

Sequences count upwards through a window of the vocabulary, wrapping around:
``a, a+1, ..., a+L-1 (mod span)``. A randomly initialised model starts at
log(vocab_size) and can learn first the unigram of the window, then the
successor rule, which makes progress visible within a few hundred ZO steps.
Each batch is a pure function of (seed, step), so the data position of a resumed
run is just its step.
"""

from __future__ import annotations

import torch

from distzo.zo.noise import noise_seed

EVAL_STREAM = -1  # the evaluation set's "step": never a training step


class CountingTask:
    def __init__(
        self, vocab_size: int, seq_len: int = 16, span: int = 16, offset: int = 16, seed: int = 0
    ) -> None:
        if offset + span > vocab_size:
            raise ValueError(
                f"counting window [{offset}, {offset + span}) does not fit a vocabulary of "
                f"{vocab_size}"
            )
        self.seq_len, self.span, self.offset, self.seed = seq_len, span, offset, seed
        self._next_step = 0

    def batch(self, batch_size: int, step: int | None = None) -> dict[str, torch.Tensor]:
        """The batch of ``step`` (default: the step after the last one drawn)."""
        if step is None:
            step = self._next_step
        self._next_step = step + 1
        return self._sequences(batch_size, step)

    def eval_set(self, size: int) -> dict[str, torch.Tensor]:
        """A fixed evaluation set, drawn from its own stream (disjoint from training steps)."""
        batch = self._sequences(size, EVAL_STREAM)
        return batch | {"labels": batch["input_ids"]}

    def _sequences(self, batch_size: int, key: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(noise_seed(self.seed, key, 0, 0))
        start = torch.randint(0, self.span, (batch_size, 1), generator=generator)
        input_ids = self.offset + (start + torch.arange(self.seq_len)) % self.span
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
