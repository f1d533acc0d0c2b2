"""The scratch buckets the model computes with.

The model's parameters are bound once to scratch buffers (views into them), so its own
layers compute with whatever perturbation the scratch holds: a pass perturbs a master
out of place into the scratch instead of re-pointing parameters. Scratch is in the
compute dtype (AMP): the masters keep theirs.
"""

from __future__ import annotations

import torch
from torch import nn

from distzo.engine.layouts import RESIDENT_BLOCK_ID
from distzo.engine.passes import UNPERTURBED
from distzo.offload import BucketLayout, bind
from distzo.zo import NoiseSource, Pass


def bound_scratch(
    model: nn.Module, layouts: list[BucketLayout], device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """One scratch bucket that serves every block of ``layouts`` (blocks compute one after
    another on one stream), with each block's parameters bound to it."""
    scratch = torch.zeros(max(layout.numel for layout in layouts), device=device, dtype=dtype)
    for layout in layouts:
        bind(model, layout, scratch)
    return scratch


class ResidentScratch:
    """The resident bucket's scratch, and which pass's perturbation it holds: the head
    read for the pass the embedding already perturbed for costs no second perturbation."""

    def __init__(
        self, model: nn.Module, layout: BucketLayout, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.values = torch.zeros(layout.numel, device=device, dtype=dtype)
        bind(model, layout, self.values)
        self.holds: tuple[int, int, int] | None = None  # (query, sign, step) now in values

    def perturb(
        self, noise: NoiseSource, master: torch.Tensor, eps: float, p: Pass, step: int
    ) -> None:
        """Make the scratch hold ``master`` perturbed for pass ``p`` of ``step``, unless it
        already does (an unperturbed copy serves every step)."""
        query, sign = p
        key = (query, sign, step) if sign else (0, 0, -1)
        if self.holds != key and master.numel():
            noise.perturb_into(self.values, master, sign * eps, step, RESIDENT_BLOCK_ID, query)
            self.holds = key

    def forget(self) -> None:
        """The master changed (an update, a restore): what the scratch holds is stale."""
        self.holds = None

    def held_pass(self, step: int) -> Pass | None:
        """The pass of ``step`` whose perturbation the scratch holds now, if any."""
        if self.holds is None:
            return None
        query, sign, held_step = self.holds
        if sign == 0:
            return UNPERTURBED
        return (query, sign) if held_step == step else None
