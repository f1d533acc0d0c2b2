"""A task generated in code, so the default run and the tests need no download.

Sequences count upwards through a window of the vocabulary, wrapping around:
``a, a+1, ..., a+L-1 (mod span)``. A randomly initialised model starts at
log(vocab_size) and can learn first the unigram of the window, then the
successor rule, which makes progress visible within a few hundred ZO steps.
"""

from __future__ import annotations

import torch


class CountingTask:
    def __init__(self, vocab_size: int, seq_len: int = 16, span: int = 16, offset: int = 16, seed: int = 0) -> None:
        if offset + span > vocab_size:
            raise ValueError(f"counting window [{offset}, {offset + span}) does not fit a vocabulary of {vocab_size}")
        self.seq_len, self.span, self.offset = seq_len, span, offset
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, batch_size: int) -> dict[str, torch.Tensor]:
        start = torch.randint(0, self.span, (batch_size, 1), generator=self.generator)
        input_ids = self.offset + (start + torch.arange(self.seq_len)) % self.span
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
