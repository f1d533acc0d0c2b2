"""The two sides of the resident bucket: what the embedding reads and what the head reads.

A pass reads the embedding before the first block and the head after the last, never
both at once. Where the head has weights of its own (no tied ``lm_head``), the two sides
take turns in one scratch the size of the larger, each perturbed when it is read, with
the z of its elements' places in the resident bucket: the same values as a scratch of
the whole bucket, in half the memory or less (OPT-30B with ZO2's untied head: 0.72 GB of
fp16 fewer), and each side perturbed once per pass, where a whole scratch is perturbed
for the embedding and again for the head. Under full tuning that scratch is the block
scratch too (``share_block_scratch``). A tied head reads the embedding's weights, so
its bucket stays one side, perturbed once for both.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from distzo.models import family_for
from distzo.offload.bucket import ALIGN_ELEMENTS, BucketLayout, Entry, round_up

EMBEDDING, HEAD = "embedding", "head"
WHOLE = "whole"  # one side for both: a tied head, or a bucket that does not split


@dataclass(frozen=True)
class Run:
    """Elements ``[start, stop)`` of the resident bucket, at ``at`` in the scratch."""

    start: int
    stop: int
    at: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ResidentSide:
    """One side's runs of the resident bucket, packed into a scratch of ``numel`` elements,
    and its parameters' places there (what ``bind_entries`` takes)."""

    name: str
    runs: tuple[Run, ...]
    entries: tuple[Entry, ...]
    numel: int


def whole_side(layout: BucketLayout) -> ResidentSide:
    runs = (Run(0, layout.numel, 0),) if layout.numel else ()
    return ResidentSide(WHOLE, runs, layout.entries, layout.numel)


def side_entries(layout: BucketLayout, model: nn.Module) -> dict[str, list[Entry]]:
    """The entries (at their places in the bucket) of each side: ``EMBEDDING`` and ``HEAD``
    where every entry of ``layout`` (names relative to ``model``) lies under one of the
    family's head modules (``ModelFamily.head_modules``) or under none, at all of its
    names, and both sides have entries; otherwise every entry in one ``WHOLE`` side."""
    heads = {id(m) for m in family_for(model).head_modules()}
    prefixes = tuple(f"{name}." for name, m in model.named_modules() if id(m) in heads)
    is_head = [[name.startswith(prefixes) for name in e.names] for e in layout.entries]
    whole = {WHOLE: list(layout.entries)}
    if any(len(set(flags)) > 1 for flags in is_head):  # a tied weight: read by both
        return whole
    side_of = [all(flags) for flags in is_head]
    if all(side_of) or not any(side_of):
        return whole
    return {
        name: [e for e, head in zip(layout.entries, side_of) if head == wanted]
        for name, wanted in ((EMBEDDING, False), (HEAD, True))
    }


def resident_sides(layout: BucketLayout, model: nn.Module) -> dict[str, ResidentSide]:
    """The side each of ``EMBEDDING`` and ``HEAD`` reads (``side_entries``): two packed
    sides, or one ``WHOLE`` side for both."""
    sides = side_entries(layout, model)
    if WHOLE in sides:
        return dict.fromkeys((EMBEDDING, HEAD), whole_side(layout))
    return {name: packed(name, entries) for name, entries in sides.items()}


def packed(name: str, entries: list[Entry]) -> ResidentSide:
    """Consecutive entries (in layout order) as runs, each run aligned in the scratch, so
    every parameter's view keeps its alignment."""
    runs: list[Run] = []
    placed: list[Entry] = []
    groups: list[list[Entry]] = []
    for e in entries:
        last = groups[-1][-1] if groups else None
        if last is not None and round_up(last.offset + last.numel, ALIGN_ELEMENTS) == e.offset:
            groups[-1].append(e)
        else:
            groups.append([e])
    at = 0
    for group in groups:
        start, stop = group[0].offset, group[-1].offset + group[-1].numel
        runs.append(Run(start, stop, at))
        placed += [Entry(e.names, e.shape, at + e.offset - start, e.numel) for e in group]
        at = round_up(at + stop - start, ALIGN_ELEMENTS)
    return ResidentSide(name, tuple(runs), tuple(placed), at)


def share_block_scratch(sides: dict[str, ResidentSide], full_tuning: bool) -> bool:
    """Whether the sides take turns in the block scratch as well: an untied head's, under
    full tuning. The sides are read when no block is (the embedding before the first, the
    head after the last, on the compute stream), and each side of an untied head is
    perturbed whenever a pass reads it, so the blocks writing between costs no
    perturbation; a tied head's one side would lose the embedding's perturbation that
    its head reuses, and an adapter run keeps its scratches as they were (its batched
    passes stack the blocks' own)."""
    return full_tuning and sides[EMBEDDING] is not sides[HEAD]


def scratch_numel(sides: dict[str, ResidentSide]) -> int:
    """The elements of the one scratch the sides take turns in."""
    return max(side.numel for side in sides.values())
