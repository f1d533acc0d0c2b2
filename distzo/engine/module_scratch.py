"""A block perturbed one module at a time, into a scratch the size of its largest module.

The block scratch (``scratch.bound_scratch``) holds a whole perturbed block in the
compute dtype while it computes: 0.40 GB at OPT-6.7B in fp16, 1.23 GB at OPT-30B, 3.6 GB
at OPT-175B, beside the block's own slot. A block's modules run one after another, and
each reads only its own weights while it runs, so with ``perturb_scope="module"`` every
module that owns weights and has no children (a ``Linear``, a norm) is bound to the same
place of a smaller scratch, and a forward pre-hook perturbs its weights there just
before it runs. Weights whose module has children, or that several modules share, keep
places of their own, perturbed when the block starts. The scratch is the largest module
plus those (OPT-6.7B: ``fc1``, 0.13 GB in fp16; OPT-30B: 0.41 GB).

Every element is perturbed with the noise of its place in the block, by the same
``NoiseSource.perturb_into`` as the whole block's, so the passes read the same values
and the trajectory is the same bit for bit (the resident sides share this scratch:
``vocab_slices``). The price is a kernel launch per module and
per pass (a dozen a block, and again for each micro-batch of ``grad_accum``), queued on
the compute stream in the order the modules run:
a module's weights are overwritten only after the work that read the last module's was
queued, and work on one stream runs in order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import nn

from distzo.engine.resident_sides import ResidentSide, Run, packed
from distzo.offload import BucketLayout
from distzo.offload.bucket import Entry, bind_entries

# Fills ``out`` with elements [lo, hi) of the block being read, perturbed for the pass.
Fill = Callable[[torch.Tensor, int, int], None]


@dataclass(frozen=True)
class BlockPieces:
    """One block's places in the module scratch: ``fixed`` (perturbed when the block
    starts) at the front, then each hooked module's piece, all at the same offset."""

    fixed: ResidentSide
    modules: tuple[tuple[str, ResidentSide], ...]  # (module name, its piece)

    @property
    def numel(self) -> int:
        return max([self.fixed.numel, *(piece.numel for _, piece in self.modules)])


def _shifted(side: ResidentSide, by: int) -> ResidentSide:
    """``side`` placed ``by`` elements further into the scratch."""
    runs = tuple(Run(r.start, r.stop, r.at + by) for r in side.runs)
    entries = tuple(replace(e, offset=e.offset + by) for e in side.entries)
    return ResidentSide(side.name, runs, entries, side.numel + by)


def _hooked_owner(model: nn.Module, entry: Entry) -> str | None:
    """The one module without children that owns ``entry`` at all of its names, if any:
    the module whose forward is the only place its weights are read."""
    owners = {name.rpartition(".")[0] for name in entry.names}
    if len(owners) != 1:
        return None
    (owner,) = owners
    module = model.get_submodule(owner)
    return owner if next(module.children(), None) is None else None


def block_pieces(model: nn.Module, layout: BucketLayout) -> BlockPieces:
    """How ``layout``'s block (names relative to ``model``) is bound to the module scratch."""
    by_module: dict[str, list[Entry]] = {}
    fixed: list[Entry] = []
    for e in layout.entries:
        owner = _hooked_owner(model, e)
        if owner is None:
            fixed.append(e)
        else:
            by_module.setdefault(owner, []).append(e)
    front = packed("fixed", fixed)  # its length a multiple of ALIGN_ELEMENTS, as each run's
    modules = tuple(
        (owner, _shifted(packed(owner, entries), front.numel))
        for owner, entries in by_module.items()
    )
    return BlockPieces(front, modules)


def module_scratch_numel(model: nn.Module, layouts: list[BucketLayout]) -> int:
    """The elements of the module scratch that serves every block of ``layouts``."""
    return max((block_pieces(model, layout).numel for layout in layouts), default=0)


class ModuleScratch:
    """The block scratch of ``perturb_scope="module"`` (``values``, at least
    ``module_scratch_numel``): each block's modules bound to it, and a pre-hook on each
    that perturbs its piece for the pass being read."""

    def __init__(
        self,
        model: nn.Module,
        layouts: list[BucketLayout],
        values: torch.Tensor,
    ) -> None:
        self.pieces = [block_pieces(model, layout) for layout in layouts]
        assert values.numel() >= max((p.numel for p in self.pieces), default=0)
        self.values = values
        self._fill: Fill | None = None
        self._block: int | None = None
        for i, block in enumerate(self.pieces):
            bind_entries(model, block.fixed.entries, self.values)
            for name, piece in block.modules:
                bind_entries(model, piece.entries, self.values)
                hook = partial(self._before, i, name, piece)
                model.get_submodule(name).register_forward_pre_hook(hook)

    @contextmanager
    def reading(self, i: int, fill: Fill) -> Iterator[None]:
        """While the body runs block ``i``'s forward, each module is perturbed by ``fill``
        just before it runs; the fixed places are perturbed now."""
        for run in self.pieces[i].fixed.runs:
            fill(self.values[run.at : run.at + run.numel], run.start, run.stop)
        self._fill, self._block = fill, i
        try:
            yield
        finally:
            self._fill, self._block = None, None

    def _before(
        self, i: int, name: str, piece: ResidentSide, module: nn.Module, args: object
    ) -> None:
        if self._fill is None or self._block != i:
            raise RuntimeError(
                f"module {name} ran outside the engine's pass over its block {i}: with "
                "perturb_scope module its weights exist only while that pass reads them; "
                "run the model through the engine, or use perturb_scope block"
            )
        for run in piece.runs:
            self._fill(self.values[run.at : run.at + run.numel], run.start, run.stop)
