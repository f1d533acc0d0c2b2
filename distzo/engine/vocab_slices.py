"""The resident bucket read a vocabulary slice at a time, in the block's module scratch.

With ``perturb_scope="module"`` a block's perturbed copy is the size of its largest
module (``module_scratch``), but the resident side's would still hold a whole embedding
or head, larger than that module: 0.41 GB of fp16 at OPT-6.7B, 1.24 GB at OPT-175B. The
embedding is read before the first block and the head after the last, on the one
compute stream, so both sides use the block's scratch; and the two vocabulary matrices
(the token embedding, an ``nn.Embedding`` or Gemma's scaled one, and the LM head, a
plain ``nn.Linear``)
are perturbed there a slice of rows at a time, as many rows as the scratch holds: the
embedding looks each token up in the slice holding its row, the head writes each slice's
logits into their columns. The side's other weights (positions, norms, a head's bias)
keep places at the front of the scratch, perturbed when the side is read.

Every element is perturbed with the noise of its place in the resident bucket, by the
same ``NoiseSource.perturb_into`` as the whole side's; a looked-up row is a copy, and a
slice's logits are the whole head's dot products, so the trajectory is the block scope's
(bit for bit on CPU, whose GEMM sums a logit's products alike whatever the columns
around it: tests/unit/test_vocab_slices.py). The price: a head that takes several slices
is perturbed again for every ``HEAD_CHUNK`` positions it reads, and a tied head is
perturbed again after the blocks (they overwrote the embedding's copy).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

from distzo.engine.module_scratch import Fill, module_scratch_numel
from distzo.engine.resident_sides import EMBEDDING, HEAD, WHOLE, ResidentSide, packed, side_entries
from distzo.engine.scratch import held_key, resident_fill
from distzo.offload import BucketLayout
from distzo.offload.bucket import ALIGN_ELEMENTS, Entry, bind_entries, round_up
from distzo.zo import NoiseSource, Pass

# A slice's rows: a multiple of ROW_ALIGN, starting at one (CPU GEMMs group an output's
# columns by up to 64: slices so aligned sum each logit's products as the whole head does,
# where a slice of 16 rows, or a short one at an odd place, may not), and at least MIN_ROWS
# (a smaller module scratch is grown to hold that).
ROW_ALIGN = 64
MIN_ROWS = ROW_ALIGN


@dataclass(frozen=True)
class VocabMatrix:
    """A vocabulary matrix read a slice of rows at a time: ``module`` (an ``nn.Embedding``
    or ``nn.Linear`` over the vocabulary) and its weight's place in the resident bucket."""

    module: str
    entry: Entry

    @property
    def rows(self) -> int:
        return self.entry.shape[0]

    @property
    def width(self) -> int:
        return self.entry.shape[1]


@dataclass(frozen=True)
class SlicedSide:
    """One side of the resident bucket: its ``fixed`` weights packed at the front of the
    scratch, its vocabulary matrices sliced into the rest."""

    fixed: ResidentSide
    matrices: tuple[VocabMatrix, ...]

    @property
    def name(self) -> str:
        return self.fixed.name

    @property
    def numel(self) -> int:
        """The scratch this side needs: its fixed places and ``MIN_ROWS`` of each matrix."""
        least = max((min(m.rows, MIN_ROWS) * m.width for m in self.matrices), default=0)
        return self.fixed.numel + round_up(least, ALIGN_ELEMENTS)


def vocab_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The vocabulary modules a slice of rows can stand in for, by name: the input
    embedding if a plain ``nn.Embedding`` (no ``max_norm``: a lookup is a copy of a row) or
    transformers' scaled one (``embed_scale``), the output embedding if a plain
    ``nn.Linear`` (a slice's logits are its columns)."""
    names = {id(m): name for name, m in model.named_modules()}
    found: dict[str, nn.Module] = {}
    embedding = model.get_input_embeddings()  # type: ignore[operator]
    if _looks_up_rows(embedding):
        found[names[id(embedding)]] = embedding
    head = model.get_output_embeddings()  # type: ignore[operator]
    if type(head) is nn.Linear and id(head) in names:
        found[names[id(head)]] = head
    return found


def _looks_up_rows(embedding: nn.Module) -> bool:
    """Whether ``embedding`` is a lookup of rows (no ``max_norm``), times ``embed_scale``
    where it is transformers' ``*ScaledWordEmbedding`` (Gemma's: its forward is the plain
    lookup times that scale, which a slice's lookup multiplies alike)."""
    if not isinstance(embedding, nn.Embedding) or embedding.max_norm is not None:
        return False
    kind = type(embedding)
    scaled = kind.__name__.endswith("ScaledWordEmbedding") and hasattr(embedding, "embed_scale")
    return kind is nn.Embedding or scaled


def sliced_sides(layout: BucketLayout, model: nn.Module) -> dict[str, SlicedSide]:
    """``EMBEDDING`` and ``HEAD``'s sides (one ``WHOLE`` side for both, as
    ``resident_sides``), each weight that only vocabulary modules read sliced."""
    weight_of = {f"{name}.weight": name for name in vocab_modules(model)}
    sides: dict[str, SlicedSide] = {}
    for name, entries in side_entries(layout, model).items():
        sliced = [e for e in entries if all(n in weight_of for n in e.names)]
        matrices = tuple(VocabMatrix(weight_of[n], e) for e in sliced for n in e.names)
        fixed = packed(name, [e for e in entries if e not in sliced])
        sides[name] = SlicedSide(fixed, matrices)
    if WHOLE in sides:
        return dict.fromkeys((EMBEDDING, HEAD), sides[WHOLE])
    return sides


def shared_scratch_numel(
    model: nn.Module, layouts: list[BucketLayout], resident_layout: BucketLayout
) -> int:
    """The elements of the one scratch the blocks' modules and the resident sides share."""
    sides = sliced_sides(resident_layout, model).values()
    return max(module_scratch_numel(model, layouts), *(side.numel for side in sides))


class SlicedResident:
    """The resident scratch of ``perturb_scope="module"`` (``ResidentScratch``'s
    interface): both sides in ``values``, the module scratch, their vocabulary matrices
    read a slice at a time by their modules' forwards."""

    def __init__(self, model: nn.Module, sides: dict[str, SlicedSide], values: torch.Tensor):
        self.sides, self.values = sides, values
        self.shares_blocks = True  # the module scratch: a block's fill forgets
        self.holds: tuple[str, int, int, int] | None = None  # a held_key
        self._reading: tuple[SlicedSide, Fill] | None = None
        self._slice: tuple[object, ...] | None = None  # which rows of which matrix it holds
        distinct = list({id(s): s for s in sides.values()}.values())
        for side in distinct:
            bind_entries(model, side.fixed.entries, values)
        # a sliced weight has no place: a stand-in of its shape, read only a slice at a time
        for entry in {m.entry for side in distinct for m in side.matrices}:
            stand_in = nn.Parameter(values[:1].expand(entry.shape), requires_grad=False)
            for name in entry.names:
                owner, _, attr = name.rpartition(".")
                setattr(model.get_submodule(owner), attr, stand_in)
        for side in distinct:
            for matrix in side.matrices:
                module = model.get_submodule(matrix.module)
                if isinstance(module, nn.Embedding):
                    module.forward = partial(self._lookup, matrix, module)  # type: ignore[method-assign]
                else:
                    assert isinstance(module, nn.Linear)
                    module.forward = partial(self._logits, matrix, module)  # type: ignore[method-assign]

    @property
    def num_slices(self) -> int:
        """The most slices a matrix is read in."""
        sides = self.sides.values()
        return max((-(-m.rows // self._rows(s, m)) for s in sides for m in s.matrices), default=0)

    @contextmanager
    def reading(
        self, side: str, noise: NoiseSource, master: torch.Tensor, eps: float, p: Pass, step: int
    ) -> Iterator[None]:
        """While the body reads ``side``, the scratch holds its fixed weights perturbed for
        pass ``p`` of ``step``, and its vocabulary modules read their slices perturbed
        alike (outside such a body they refuse to run)."""
        read = self.sides[side]
        self._reading = (read, self._perturb(read, noise, master, eps, p, step))
        try:
            yield
        finally:
            self._reading = None

    def _perturb(
        self,
        read: SlicedSide,
        noise: NoiseSource,
        master: torch.Tensor,
        eps: float,
        p: Pass,
        step: int,
    ) -> Fill:
        """The fixed places hold side ``read`` perturbed for pass ``p`` (unless they already
        do); what perturbs its slices alike."""
        key = held_key(read.name, p, step)
        fill = resident_fill(noise, master, eps, p, step)
        if self.holds != key:
            for run in read.fixed.runs:
                fill(self.values[run.at : run.at + run.numel], run.start, run.stop)
            self.holds, self._slice = key, None
        return fill

    def forget(self) -> None:
        """The master changed, or a block wrote the scratch: what it holds is stale."""
        self.holds, self._slice = None, None

    def held_pass(self, step: int) -> Pass | None:
        """Never one: the blocks overwrite whatever the embedding's side held."""
        return None

    def _rows(self, side: SlicedSide, matrix: VocabMatrix) -> int:
        """Rows per slice: the whole matrix where the scratch holds it after the side's
        fixed places, else as many aligned rows as it holds."""
        fits = (self.values.numel() - side.fixed.numel) // matrix.width
        return matrix.rows if fits >= matrix.rows else fits // ROW_ALIGN * ROW_ALIGN

    def _slices(self, matrix: VocabMatrix) -> Iterator[tuple[int, torch.Tensor]]:
        """Each slice's first row and its rows, perturbed for the pass being read."""
        if self._reading is None or matrix not in self._reading[0].matrices:
            raise RuntimeError(
                f"module {matrix.module} ran outside the engine's pass over its side of the "
                "resident bucket: with perturb_scope module its weights exist only a slice at "
                "a time while a pass reads them; run the model through the engine, or use "
                "perturb_scope block"
            )
        side, fill = self._reading
        at, width, offset = side.fixed.numel, matrix.width, matrix.entry.offset
        rows = self._rows(side, matrix)
        for lo in range(0, matrix.rows, rows):
            hi = min(lo + rows, matrix.rows)
            flat = self.values[at : at + (hi - lo) * width]
            if self._slice != (self.holds, offset, lo):
                fill(flat, offset + lo * width, offset + hi * width)
                self._slice = (self.holds, offset, lo)
            yield lo, flat.view(hi - lo, width)

    def _lookup(self, matrix: VocabMatrix, module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        """The embedding of ``ids``: each id's row from the slice that holds it (a copy, without
        the gradient options a no-grad lookup never uses), scaled as the module's own
        forward scales it (``embed_scale``: Gemma's)."""
        out: torch.Tensor | None = None
        for lo, rows in self._slices(matrix):
            looked_up = F.embedding((ids - lo).clamp(0, rows.shape[0] - 1), rows)
            if out is None:  # rows of ids in later slices are replaced there
                out = looked_up
            else:
                inside = ((ids >= lo) & (ids < lo + rows.shape[0])).unsqueeze(-1)
                out = torch.where(inside, looked_up, out)
        assert out is not None  # a vocabulary has rows
        scale = getattr(module, "embed_scale", None)
        if scale is None:
            return out
        return out * (scale.to(out.dtype) if isinstance(scale, torch.Tensor) else scale)

    def _logits(self, matrix: VocabMatrix, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``module(x)``: each slice's logits into their columns."""
        out = x.new_empty(*x.shape[:-1], matrix.rows)
        bias: torch.Tensor | None = module.bias
        for lo, rows in self._slices(matrix):
            hi = lo + rows.shape[0]
            out[..., lo:hi] = F.linear(x, rows, None if bias is None else bias[lo:hi])
        return out
