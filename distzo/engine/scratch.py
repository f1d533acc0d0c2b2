"""The scratch buckets the model computes with.

The model's parameters are bound once to scratch buffers (views into them), so its own
layers compute with whatever perturbation the scratch holds: a pass perturbs a master
out of place into the scratch instead of re-pointing parameters. Scratch is in the
compute dtype (AMP): the masters keep theirs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from distzo.engine.layouts import RESIDENT_BLOCK_ID
from distzo.engine.module_scratch import Fill
from distzo.engine.passes import UNPERTURBED
from distzo.engine.resident_sides import EMBEDDING, ResidentSide, scratch_numel
from distzo.offload import BucketLayout, bind
from distzo.offload.bucket import bind_entries
from distzo.zo import NoiseSource, Pass


def bound_scratch(
    model: nn.Module,
    layouts: list[BucketLayout],
    device: torch.device,
    dtype: torch.dtype,
    at_least: int = 0,
) -> torch.Tensor:
    """One scratch bucket that serves every block of ``layouts`` (blocks compute one after
    another on one stream), with each block's parameters bound to it; ``at_least``
    elements where the resident sides share it."""
    numel = max(at_least, *(layout.numel for layout in layouts))
    scratch = torch.zeros(numel, device=device, dtype=dtype)
    for layout in layouts:
        bind(model, layout, scratch)
    return scratch


def held_key(side: str, p: Pass, step: int) -> tuple[str, int, int, int]:
    """What a resident scratch holds: ``side`` perturbed for pass ``p`` of ``step``, or
    unperturbed at any step."""
    query, sign = p
    return (side, query, sign, step) if sign else (side, 0, 0, -1)


def resident_fill(noise: NoiseSource, master: torch.Tensor, eps: float, p: Pass, step: int) -> Fill:
    """What writes elements ``[lo, hi)`` of the resident ``master``, perturbed for pass
    ``p`` of ``step`` with the z of their places in the bucket, into ``out``."""
    query, sign = p

    def fill(out: torch.Tensor, lo: int, hi: int) -> None:
        noise.perturb_into(
            out,
            master[lo:hi],
            sign * eps,
            step,
            RESIDENT_BLOCK_ID,
            query,
            start=lo,
            total=master.numel(),
        )

    return fill


class ResidentScratch:
    """The resident bucket's scratch, and which side and pass's perturbation it holds.

    The embedding and an untied head take turns in it (``resident_sides``), each side
    perturbed when a pass reads it; a tied head shares the embedding's side, so the head
    read for the pass the embedding already perturbed for costs no second perturbation."""

    def __init__(
        self,
        model: nn.Module,
        sides: dict[str, ResidentSide],
        device: torch.device,
        dtype: torch.dtype,
        block_scratch: torch.Tensor | None = None,
    ) -> None:
        self.sides = sides
        # in the block scratch, if given (``share_block_scratch``): a block's fill forgets
        self.shares_blocks = block_scratch is not None
        self.values = (
            block_scratch
            if block_scratch is not None
            else torch.zeros(scratch_numel(sides), device=device, dtype=dtype)
        )
        for side in {id(s): s for s in sides.values()}.values():
            bind_entries(model, side.entries, self.values)
        # (side, query, sign, step) whose perturbation ``values`` holds now
        self.holds: tuple[str, int, int, int] | None = None

    @contextmanager
    def reading(
        self,
        side: str,
        noise: NoiseSource,
        master: torch.Tensor,
        eps: float,
        p: Pass,
        step: int,
    ) -> Iterator[None]:
        """While the body reads ``side``, the scratch holds it of ``master`` perturbed for
        pass ``p`` of ``step`` (perturbed now unless it already does: an unperturbed copy
        serves every step)."""
        read = self.sides[side]
        key = held_key(read.name, p, step)
        if self.holds != key:
            fill = resident_fill(noise, master, eps, p, step)
            for run in read.runs:
                fill(self.values[run.at : run.at + run.numel], run.start, run.stop)
            self.holds = key
        yield

    def forget(self) -> None:
        """The master changed (an update, a restore), or a block wrote the scratch the
        sides share: what it holds is stale."""
        self.holds = None

    def held_pass(self, step: int) -> Pass | None:
        """The pass of ``step`` whose perturbation the embedding's side holds now, if any."""
        if self.holds is None:
            return None
        name, query, sign, held_step = self.holds
        if name != self.sides[EMBEDDING].name:
            return None
        if sign == 0:
            return UNPERTURBED
        return (query, sign) if held_step == step else None
