"""Log-probabilities of chosen tokens with the LM head run only where they are read.

A label token at position t+1 needs the logits of position t and nothing else: a
candidate or an answer is a few tokens, so computing ``rows x length x vocab`` logits
to use a handful is most of the head's cost (SmolLM2-135M: a 49k-word head is a fifth of
its FLOPs per token). ``HeadTargets`` lists, built on the host from the CPU batch, the
distinct positions that need the head and the tokens read at each; several tokens may
share one position (single-token candidates sharing their prompt). The head then runs
on ``HEAD_CHUNK`` positions at a time, so no full-vocabulary float32 tensor larger than
``HEAD_CHUNK x vocab`` is ever built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distzo.objectives.protocol import PassRunner
from distzo.runtime.devices import to_device
from distzo.zo.estimators import Pass

HEAD_CHUNK = 256  # positions per head call: bounds the float32 logits at HEAD_CHUNK x vocab


@dataclass
class HeadTargets:
    positions: torch.Tensor  # [P] distinct flat indices into the (rows x length) hidden grid
    entry_head: torch.Tensor  # [N] which of ``positions`` predicts each scored token
    tokens: torch.Tensor  # [N] the scored tokens
    groups: torch.Tensor  # [N] a caller's label per entry (a candidate id), permuted alongside
    chunks: list[tuple[int, int, int, int]]  # (p_lo, p_hi, n_lo, n_hi) per head call
    full_head: bool = (
        False  # the reference: the head on every position, then pick (tests, benchmarks)
    )

    @classmethod
    def build(
        cls,
        flat_positions: torch.Tensor,
        tokens: torch.Tensor,
        groups: torch.Tensor | None,
        device: torch.device,
        full_head: bool = False,
        chunk: int = HEAD_CHUNK,
    ) -> HeadTargets:
        """From host tensors: entries sorted by position, so each head chunk reads a
        contiguous run of entries (bounds computed here, on the host)."""
        flat_positions, tokens = flat_positions.cpu().long(), tokens.cpu().long()
        groups = torch.zeros_like(tokens) if groups is None else groups.cpu().long()
        positions, inverse = torch.unique(flat_positions, sorted=True, return_inverse=True)
        order = torch.argsort(inverse, stable=True)
        entry_head = inverse[order]
        counts = torch.bincount(entry_head, minlength=len(positions)).tolist()
        chunks, n_lo = [], 0
        for p_lo in range(0, len(positions), chunk):
            p_hi = min(p_lo + chunk, len(positions))
            n_hi = n_lo + sum(counts[p_lo:p_hi])
            chunks.append((p_lo, p_hi, n_lo, n_hi))
            n_lo = n_hi

        return cls(
            to_device(positions, device),
            to_device(entry_head, device),
            to_device(tokens[order], device),
            to_device(groups[order], device),
            chunks,
            full_head,
        )

    @property
    def num_entries(self) -> int:
        return self.chunks[-1][3] if self.chunks else 0


def broken_rows(scores: torch.Tensor) -> torch.Tensor:
    """Per row of ``[..., n]`` scores or logits, whether it holds a NaN or +inf: what broken
    weights or an overflowing forward give, never finite ones (a -inf marks an absent
    candidate). An argmax over such a row still picks something, so an accuracy, an F1 or
    a greedy answer read off it would look like a result; callers turn it into a NaN."""
    return (scores.isnan() | scores.isposinf()).any(dim=-1)


def picked_log_probs(
    runner: PassRunner, p: Pass, hidden: torch.Tensor, targets: HeadTargets, with_hits: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(token) per entry, whether the token is the argmax per entry; None unless
    ``with_hits``), in at least float32 (a float64 model keeps float64: a ZO step
    differences two nearly equal losses, so their precision is the gradient's)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    # every position's logits, as the model's own forward builds them
    full = runner.head(p, flat) if targets.full_head else None
    picked, hits = [], []
    for chunk in targets.chunks:
        chunk_picked, chunk_hits = _chunk_log_probs(
            runner, p, flat, full, targets, chunk, with_hits
        )
        picked.append(chunk_picked)
        if chunk_hits is not None:
            hits.append(chunk_hits)
    empty = hidden.new_zeros(0, dtype=torch.promote_types(hidden.dtype, torch.float32))
    if not with_hits:
        return (torch.cat(picked) if picked else empty), None
    no_hits = hidden.new_zeros(0, dtype=torch.bool)
    return (torch.cat(picked) if picked else empty), (torch.cat(hits) if hits else no_hits)


def _chunk_log_probs(
    runner: PassRunner,
    p: Pass,
    flat: torch.Tensor,
    full: torch.Tensor | None,
    targets: HeadTargets,
    chunk: tuple[int, int, int, int],
    with_hits: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One head call's picked log-probabilities (and hits). A function of its own so that
    the chunk's logits and float32 log-softmax (HEAD_CHUNK x vocab each) are freed before
    the next chunk's head runs: held across the loop, the next chunk's peak would carry
    them too (0.16 GB more at a 152k vocabulary)."""
    p_lo, p_hi, n_lo, n_hi = chunk
    where = targets.positions[p_lo:p_hi]
    logits = (
        full.index_select(0, where)
        if full is not None
        else runner.head(p, flat.index_select(0, where))
    )
    log_probs = torch.log_softmax(
        logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1
    )
    rows, tokens = targets.entry_head[n_lo:n_hi] - p_lo, targets.tokens[n_lo:n_hi]
    hits = logits.argmax(-1)[rows] == tokens if with_hits else None
    return log_probs[rows, tokens], hits
