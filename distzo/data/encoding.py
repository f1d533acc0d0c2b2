"""Token batches for prompt tasks and raw text, drawn as a pure function of the step.

A prompt and its continuation are tokenized separately and concatenated, so the
continuation's tokens (the only ones with labels) are exactly known; a sequence
longer than ``max_length`` loses prompt tokens from the left, never its answer.
The batch of step t takes positions [t*B, (t+1)*B) of an endless run of per-epoch
permutations seeded by (seed, epoch): a resumed run needs only its step.

Each objective reads its own batch form (``distzo.objectives``): ``lm`` the right
continuation with labels on its tokens, ``classification`` / ``accuracy`` every
candidate of each example, ``f1`` the prompt with room for the answer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distzo.data.templates import Example
from distzo.objectives import ChoiceEncoding, collate_choices, collate_prompts
from distzo.zo.noise import noise_seed


class PromptEncoder:
    def __init__(self, tokenizer, max_length: int) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.pad_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )

    def encode(self, prompt: str, continuation: str) -> tuple[list[int], int]:
        """(token ids, number of continuation tokens at the end)."""
        head = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        tail = (
            self.tokenizer(continuation, add_special_tokens=False)["input_ids"]
            if continuation
            else []
        )
        tail = tail[: self.max_length - 1]
        ids = (head + tail)[-self.max_length :]
        return ids, len(tail)

    def _tail(self, continuation: str) -> list[int]:
        return self.tokenizer(continuation, add_special_tokens=False)["input_ids"]

    def shares_prompt(self, example: Example) -> bool:
        """Every candidate is one token: one row (the prompt) scores them all."""
        return all(len(self._tail(c)) == 1 for c in example.continuations)

    def choice_rows(self, example: Example) -> int:
        return 1 if self.shares_prompt(example) else len(example.continuations)

    def encode_choices(self, example: Example) -> ChoiceEncoding:
        """The example's rows and scored tokens: the prompt alone when every candidate is
        one token (scored at the prompt's last position), else prompt + candidate per row,
        each scored on its candidate's tokens, exactly as ``encode`` lays them out."""
        ids, _ = self.encode(example.prompt, example.continuations[0])
        if self.shares_prompt(example) and len(ids) > 1:
            prompt = ids[:-1]
            scored = [
                (0, len(prompt) - 1, self._tail(c)[0], c_index)
                for c_index, c in enumerate(example.continuations)
            ]
            return ChoiceEncoding((tuple(prompt),), tuple(scored), example.label)
        rows, scored = [], []
        for c_index, continuation in enumerate(example.continuations):
            ids, answer = self.encode(example.prompt, continuation)
            if answer == 0:
                raise ValueError(f"candidate {continuation!r} has no tokens to score")
            scored += [
                (c_index, t - 1, ids[t], c_index) for t in range(len(ids) - answer, len(ids))
            ]
            rows.append(tuple(ids))
        return ChoiceEncoding(tuple(rows), tuple(scored), example.label)

    def encode_prompt(self, prompt: str, room: int) -> list[int]:
        """A prompt to decode from, cut from the left to leave ``room`` new tokens."""
        ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        return ids[-max(self.max_length - room, 1) :]

    def collate(self, sequences: Sequence[tuple[list[int], int]]) -> dict[str, torch.Tensor]:
        """Right-padded ids, mask, and labels on the continuation tokens only."""
        width = max(len(ids) for ids, _ in sequences)
        input_ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        labels = torch.full((len(sequences), width), -100, dtype=torch.long)
        for row, (ids, answer) in enumerate(sequences):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            mask[row, : len(ids)] = 1
            if answer:
                labels[row, len(ids) - answer : len(ids)] = input_ids[
                    row, len(ids) - answer : len(ids)
                ]
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def step_indices(num_items: int, batch_size: int, step: int, seed: int) -> list[int]:
    """The item indices of ``step``'s global batch (epoch permutations, end to end)."""
    if num_items < 1:
        raise ValueError("the training set is empty")
    out = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(position, num_items)
        generator = torch.Generator().manual_seed(noise_seed(seed, epoch, 1, 0))
        out.append(int(torch.randperm(num_items, generator=generator)[offset]))
    return out


class PromptTrainData:
    """Training batches of a prompt task: each example with its right continuation."""

    def __init__(self, examples: list[Example], encoder: PromptEncoder, seed: int) -> None:
        self.examples, self.encoder, self.seed = examples, encoder, seed
        self._cache: dict[int, tuple[list[int], int]] = {}

    def _sequence(self, index: int) -> tuple[list[int], int]:
        if index not in self._cache:
            example = self.examples[index]
            self._cache[index] = self.encoder.encode(
                example.prompt, example.continuations[example.label]
            )
        return self._cache[index]

    def batch(self, batch_size: int, step: int) -> dict[str, torch.Tensor]:
        indices = step_indices(len(self.examples), batch_size, step, self.seed)
        return self.encoder.collate([self._sequence(i) for i in indices])


class ChoiceTrainData:
    """Training batches that score every candidate (``classification``, ``accuracy``)."""

    def __init__(self, examples: list[Example], encoder: PromptEncoder, seed: int) -> None:
        self.examples, self.encoder, self.seed = examples, encoder, seed
        self._cache: dict[int, ChoiceEncoding] = {}

    def _encoding(self, index: int) -> ChoiceEncoding:
        if index not in self._cache:
            self._cache[index] = self.encoder.encode_choices(self.examples[index])
        return self._cache[index]

    def batch(self, batch_size: int, step: int) -> dict[str, torch.Tensor]:
        indices = step_indices(len(self.examples), batch_size, step, self.seed)
        return collate_choices([self._encoding(i) for i in indices], self.encoder.pad_id)


class PromptOnlyTrainData:
    """Training batches to decode from (``f1``): each row a prompt with room for the answer,
    and its example's index (where the objective finds the gold answers)."""

    def __init__(
        self, examples: list[Example], encoder: PromptEncoder, seed: int, max_new_tokens: int
    ) -> None:
        self.examples, self.encoder, self.seed, self.max_new_tokens = (
            examples,
            encoder,
            seed,
            max_new_tokens,
        )
        self._cache: dict[int, list[int]] = {}

    def _prompt(self, index: int) -> list[int]:
        if index not in self._cache:
            self._cache[index] = self.encoder.encode_prompt(
                self.examples[index].prompt, self.max_new_tokens
            )
        return self._cache[index]

    def batch(self, batch_size: int, step: int) -> dict[str, torch.Tensor]:
        indices = step_indices(len(self.examples), batch_size, step, self.seed)
        return collate_prompts(
            [self._prompt(i) for i in indices], indices, self.max_new_tokens, self.encoder.pad_id
        )


class TextTrainData:
    """Plain causal LM on raw text rows: every token of a row (up to max_length) is a label."""

    def __init__(self, texts: list[str], encoder: PromptEncoder, seed: int) -> None:
        self.sequences = []
        for text in texts:
            ids, _ = encoder.encode(text, "")
            self.sequences.append((ids, len(ids)))
        self.encoder, self.seed = encoder, seed

    def batch(self, batch_size: int, step: int) -> dict[str, torch.Tensor]:
        indices = step_indices(len(self.sequences), batch_size, step, self.seed)
        return self.encoder.collate([self.sequences[i] for i in indices])
