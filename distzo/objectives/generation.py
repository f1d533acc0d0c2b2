"""Greedy decoding of a whole batch together, and MeZO's F1 objective built on it.

Rows are right-padded prompts with room for ``T`` new tokens; the mask marks a row's
prompt and its ``T`` slots as visible from the start. Causal attention keeps a position
blind to the slots after it, so the mask (and every per-batch tensor the model builds
from it) is the same at every decoding step, and decoding step k only writes the token
it chose into slot k. Each decoding step runs every pass through every block once: one
block upload per decoding step, whatever the number of rows or passes. Nothing reads the
device until the caller takes the finished tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from distzo.objectives.metrics import answer_text, f1_score
from distzo.objectives.protocol import PassRunner
from distzo.objectives.scoring import broken_rows
from distzo.runtime.devices import to_device
from distzo.zo.estimators import Pass

PROMPT_KEYS = ("input_ids", "attention_mask", "prompt_length", "example")


def collate_prompts(
    prompts: Sequence[Sequence[int]], examples: Sequence[int], max_new_tokens: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """Prompts (already cut to leave ``max_new_tokens`` of room) with their slots, and the
    index of each row's example (where a metric finds its gold answers)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt to decode needs at least one token")
    lengths = [len(p) for p in prompts]
    width = max(lengths) + max_new_tokens
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
        mask[row, : len(ids) + max_new_tokens] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": mask,
        "prompt_length": torch.tensor(lengths),
        "example": torch.tensor(list(examples), dtype=torch.long),
    }


@dataclass
class PromptBatch:
    input_ids: torch.Tensor  # on the device
    attention_mask: torch.Tensor  # on the host: the model's masks are built there
    prompt_length: torch.Tensor  # on the device
    longest_prompt: int  # host copies of what sizes the loop
    max_new_tokens: int
    examples: list[int]


def prepare_prompts(batch: Mapping[str, torch.Tensor], device: torch.device) -> PromptBatch:
    missing = [k for k in PROMPT_KEYS if k not in batch]
    if missing:
        raise ValueError(
            f"this objective decodes: the batch lacks {', '.join(missing)} (build it with "
            "distzo.objectives.collate_prompts)"
        )
    lengths = batch["prompt_length"].cpu()
    # Every row's mask shows its prompt and the T slots; the width is the *global* batch's
    # (a data-parallel shard may be narrower), so T is read from the mask, not the width.
    new_tokens = int(batch["attention_mask"][0].sum()) - int(lengths[0])
    return PromptBatch(
        to_device(batch["input_ids"], device),
        batch["attention_mask"].cpu(),
        to_device(lengths, device),
        int(lengths.max()),
        new_tokens,
        batch["example"].cpu().tolist(),
    )


def greedy_decode(
    runner: PassRunner,
    prepared: PromptBatch,
    passes: tuple[Pass, ...],
    broken: dict[Pass, torch.Tensor] | None = None,
) -> dict[Pass, torch.Tensor]:
    """Each pass's ``[rows, T]`` greedy tokens, left on the device. ``broken``, if given,
    gets each pass's ``[rows]`` flags of the rows whose logits held a NaN or +inf at some
    decoding step (``broken_rows``: their tokens are picks among NaNs)."""
    rows = torch.arange(prepared.input_ids.shape[0], device=prepared.input_ids.device)
    ids = {p: prepared.input_ids.clone() for p in passes}
    out = {
        p: torch.empty((len(rows), prepared.max_new_tokens), dtype=torch.long, device=rows.device)
        for p in passes
    }
    if broken is not None:
        broken.update({p: torch.zeros_like(rows, dtype=torch.bool) for p in passes})
    for k in range(prepared.max_new_tokens):
        width = prepared.longest_prompt + k  # the columns that can matter at this decoding step
        hiddens = runner.hidden_states(
            {p: t[:, :width] for p, t in ids.items()}, prepared.attention_mask[:, :width]
        )
        last = prepared.prompt_length - 1 + k
        for p, hidden in hiddens.items():
            logits = runner.head(p, hidden[rows, last])
            if broken is not None:
                broken[p] |= broken_rows(logits)
            token = logits.argmax(-1)
            out[p][:, k] = token
            if k + 1 < prepared.max_new_tokens:
                ids[p][rows, last + 1] = token
    return out


class F1:
    """MeZO's non-differentiable objective for SQuAD: minus the F1 of each perturbed model's
    greedy answer (to the end-of-sequence token or the first newline) against the best gold
    answer, summed over the examples and divided by the global example count.

    The metric is text, so each step reads the decoded tokens back once: an F1 step has a
    host sync besides the step's all-reduce.
    """

    name = "f1"
    predicts_next_token = True  # greedy decoding: a masked LM's engine refuses it

    def __init__(
        self, decode: Callable[[Sequence[int]], str], answers: Sequence[Sequence[str]]
    ) -> None:
        self.decode, self.answers = decode, answers

    def num_items(self, batch: Mapping[str, torch.Tensor]) -> int:
        return int(batch["input_ids"].shape[0])

    def prepare(self, batch: Mapping[str, torch.Tensor], device: torch.device) -> PromptBatch:
        return prepare_prompts(batch, device)

    def score(self, tokens: torch.Tensor, examples: Sequence[int]) -> float:
        """Summed best-answer F1 of host ``[rows, T]`` tokens."""
        return sum(
            max(f1_score(answer_text(self.decode, row), gold) for gold in self.answers[example])
            for row, example in zip(tokens.tolist(), examples)
        )

    def losses(
        self, runner: PassRunner, prepared: PromptBatch, passes: tuple[Pass, ...], num_items: int
    ) -> dict[Pass, torch.Tensor]:
        broken: dict[Pass, torch.Tensor] = {}
        generated = greedy_decode(runner, prepared, passes, broken)
        # the metric's one read-back: each pass's tokens, its broken flags as a last column
        host = torch.stack([flagged(generated[p], broken[p]) for p in passes]).cpu()
        return {
            p: torch.tensor(
                math.nan  # picks among NaN logits: broken weights, which must not look fine
                if host[i, :, -1].any()
                else -self.score(host[i, :, :-1], prepared.examples) / num_items,
                dtype=torch.float64,
                device=runner.device,
            )
            for i, p in enumerate(passes)
        }


def flagged(tokens: torch.Tensor, broken: torch.Tensor) -> torch.Tensor:
    """``[rows, T]`` tokens and ``[rows]`` broken flags as one ``[rows, T + 1]`` tensor, so
    that one device read brings both back."""
    return torch.cat([tokens, broken.to(tokens.dtype).unsqueeze(1)], dim=1)
