"""LOZO's low-rank perturbations: the z of each weight matrix is ``U V^T``.

LOZO (Chen et al., "Enhancing Zeroth-order Fine-tuning for Language Models with Low-rank
Structures", ICLR 2025) keeps SPSA, ``g = (L+ - L-) / (2 eps)`` and
``theta -= lr (g z + wd theta)``, but perturbs each weight matrix W (m x n) by
``Z = U V^T`` with U (m x r) and V (n x r) standard Gaussian: U is drawn every step, V
once per ``interval`` steps (its nu; windows start at steps 0, nu, 2 nu, ...) and kept
in between (its "lazy sampling"). Tensors of fewer than two dimensions (biases, norm
scales) take ordinary Gaussian z. A tensor of more than two dimensions is a matrix of
its first dimension by the product of the others.

**Keys.** U of step t, and V of its window's first step ``t - t % interval``, come from
the portable keyed noise (Philox by element, ``distzo.zo.philox``), each from a stream
of its own keyed by (run seed, step, block, query): the U rows of a bucket's matrices
one matrix after another in one stream, their V rows in another. Nothing is stored: any
rank regenerates any piece, and a resumed run or a replay needs only the step. The 1-D
entries take the ``gaussian`` kind's z at their elements (the same values); padding
between entries is 0. With several queries (n-SPSA) each query has its own U and V.

**Ranges.** z of elements [lo, hi) of a bucket is computed from the U rows those elements
touch (a range may cut rows) and the matrix's whole V, so any range of z equals that
range of the whole bucket's z, bit for bit, whatever the chunking or slicing. Each
element is ``sum_k U[i,k] V[j,k]`` formed by separate multiplies and adds in k order (no
fused multiply-add, no matmul whose summation order depends on the shape), so the CPU
and a GPU form the same z from the same U and V. Memory: a piece of z, a product buffer
of the same size, the U rows of one piece and one matrix's V: ``U V^T`` of a whole matrix
never exists. On CUDA the perturbation and the update of a matrix's elements form z in
registers instead, in the same order (``distzo.zo.triton_lowrank``): theta read once and
written once, no piece of z or product in memory.

**Expectation.** For iid standard Gaussian U and V, ``E[Z_ab Z_ij] = r`` when (a, b) =
(i, j) and 0 otherwise, so ``E[Z <Z, G>] = r G``: on matrices the estimate ``g Z`` is r
times the gradient in expectation, on 1-D tensors the gradient itself. LOZO does not
rescale, nor does this (its learning rates absorb r). Within a window the expectation
over U alone is ``G V V^T``: the steps move in the subspace V spans.

**One difference from LOZO's code.** There, on a step where V is redrawn, the update
regenerates U from another position of torch's generator than the perturbation drew it
from, so that step moves along another direction than the one it measured. Here the
perturbation and the update draw the same U (from its key): the method as the paper
states it. ``benchmarks/peer_lozo.py`` runs LOZO's own step beside this one.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from distzo.zo import philox
from distzo.zo.noise import (
    NoiseSource,
    planned_noise_bytes,
    refuse_outside,
    refuse_short,
    workspace_elements,
)


class EntryShape(Protocol):
    """Where a tensor lies in a bucket (``distzo.offload.bucket.Entry`` is one)."""

    @property
    def names(self) -> tuple[str, ...]: ...
    @property
    def offset(self) -> int: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def numel(self) -> int: ...


class BucketShape(Protocol):
    """A bucket's entries and length (``distzo.offload.bucket.BucketLayout`` is one)."""

    @property
    def entries(self) -> Sequence[EntryShape]: ...
    @property
    def numel(self) -> int: ...


@dataclass(frozen=True)
class Segment:
    """Elements [start, stop) of a bucket that draw alike: a matrix (``cols`` > 0, its U
    rows from ``u_offset`` and V rows from ``v_offset`` of the factors' streams), a 1-D
    entry (Gaussian) or padding (zero)."""

    start: int
    stop: int
    cols: int = 0
    rows: int = 0
    u_offset: int = 0
    v_offset: int = 0
    gaussian: bool = True


@dataclass(frozen=True)
class Keys:
    """The Philox keys of one (step, block, query): z of the 1-D entries, U, V."""

    z: tuple[int, int]
    u: tuple[int, int]
    v: tuple[int, int]


def segments(layout: BucketShape, rank: int) -> tuple[Segment, ...]:
    """The bucket cut into segments, in element order, covering [0, layout.numel)."""
    out, at, u, v = [], 0, 0, 0
    for e in sorted(layout.entries, key=lambda e: e.offset):
        if e.offset > at:
            out.append(Segment(at, e.offset, gaussian=False))
        if len(e.shape) >= 2 and e.numel:
            rows = e.shape[0]
            cols = e.numel // rows
            out.append(Segment(e.offset, e.offset + e.numel, cols, rows, u, v))
            u, v = u + rows * rank, v + cols * rank
        elif e.numel:
            out.append(Segment(e.offset, e.offset + e.numel))
        at = max(at, e.offset + e.numel)
    if at < layout.numel:
        out.append(Segment(at, layout.numel, gaussian=False))
    return tuple(out)


def narrowest_matrix(layouts: Sequence[BucketShape]) -> tuple[int, EntryShape] | None:
    """The smallest side of the matrices in ``layouts`` and the first matrix that has it
    (None: no matrix). A ``U V^T`` of that matrix has at most that rank whatever ``rank``,
    while its entries' variance is ``rank``: a larger rank only scales the step."""
    narrowest: tuple[int, EntryShape] | None = None
    for layout in layouts:
        for e in sorted(layout.entries, key=lambda e: e.offset):
            if len(e.shape) >= 2 and e.numel:
                side = min(e.shape[0], e.numel // e.shape[0])
                if narrowest is None or side < narrowest[0]:
                    narrowest = (side, e)
    return narrowest


def factor_elements(
    segment_lists: Sequence[Sequence[Segment]], rank: int, piece: int
) -> tuple[int, int]:
    """The elements of the U buffer (the rows one piece of z touches) and of the V buffer
    (the widest matrix's V) a source over buckets cut into ``segment_lists`` holds."""
    u = v = 0
    for segs in segment_lists:
        for s in segs:
            if s.cols:
                u = max(u, min(s.rows, max(1, piece // s.cols)) * rank)
                v = max(v, s.cols * rank)
    return u, v


def planned_lowrank_bytes(
    segment_lists: Sequence[Sequence[Segment]],
    rank: int,
    chunk: int,
    itemsize: int,
    device_type: str,
) -> int:
    """What a ``LowRankNoise`` of ``chunk`` elements over buckets cut into
    ``segment_lists`` (``segments``; the plan cuts them once for every use) allocates: a
    portable source's workspace, the product buffer (rank > 1) and the factor buffers."""
    piece = workspace_elements(chunk, device_type, "lowrank")
    u, v = factor_elements(segment_lists, rank, piece)
    product = piece if rank > 1 else 0
    base = planned_noise_bytes(chunk, itemsize, device_type, "lowrank")
    return base + (product + u + v) * itemsize


class LowRankNoise(NoiseSource):
    """The ``lowrank`` kind: z of every matrix entry of a bucket is ``U V^T``, of every
    1-D entry Gaussian. ``layouts[block_id]`` is the layout of the bucket a block id
    names (the resident bucket's first). Every op of ``NoiseSource`` runs on its generic
    path over ``chunks`` (``fuses`` is False: moments, ``full``, rebuilt masters), but for
    the perturbation and the update on CUDA (``fuses_master``): there a matrix's elements
    take one ``triton_lowrank`` kernel a run of rows at a time, the same bits."""

    def __init__(
        self,
        run_seed: int,
        chunk: int,
        device: torch.device,
        dtype: torch.dtype,
        layouts: Sequence[BucketShape],
        rank: int,
        interval: int,
    ) -> None:
        if rank < 1:
            raise ValueError(f"lozo_rank must be >= 1, got {rank}")
        if interval < 1:
            raise ValueError(f"lozo_interval must be >= 1 step, got {interval}")
        super().__init__(run_seed, chunk, device, dtype, "normal", kind="gaussian")
        self.kind = "lowrank"
        self.rank, self.interval = int(rank), int(interval)
        self._segments = [segments(layout, self.rank) for layout in layouts]
        self._starts = [[s.start for s in segs] for segs in self._segments]
        # matrix entries by their offset, for ``factors``
        self._matrices = [{s.start: s for s in segs if s.cols} for segs in self._segments]
        u, v = factor_elements(self._segments, self.rank, self.piece)
        self._u = torch.empty(u, device=self.device, dtype=dtype)
        self._v = torch.empty(v, device=self.device, dtype=dtype)
        self._v_holds: tuple | None = None  # (key, v_offset, cols) of the V in self._v
        product = self.piece if self.rank > 1 else 0
        self._product = torch.empty(product, device=self.device, dtype=dtype)

    @property
    def device_bytes(self) -> int:
        """A portable source's, and the product and factor buffers."""
        return super().device_bytes + self._u.nbytes + self._v.nbytes + self._product.nbytes

    def fuses(self, *tensors: torch.Tensor) -> bool:
        """Never: the kernels this gates (the stored moments', the rebuilt master's) draw
        z element by element; the low-rank kind's fused ops are ``fuses_master``'s."""
        return False

    def fuses_master(self, theta: torch.Tensor, out: torch.Tensor | None = None) -> bool:
        """The perturbation and the update of the matrices as one low-rank kernel each
        (``triton_lowrank``): CUDA with Triton, contiguous float32, bf16 or fp16 operands
        and factors, out of theta's dtype for a 16-bit theta (``add_scaled``'s rule)."""
        from distzo.zo.triton_lowrank import DTYPES

        if out is not None and not (
            out.is_contiguous()
            and out.dtype in DTYPES
            and (out.dtype == theta.dtype or theta.dtype == torch.float32)
        ):
            return False
        return (
            self._triton
            and self.dtype in DTYPES
            and theta.dtype in DTYPES
            and theta.is_contiguous()
        )

    def perturb_into(
        self,
        out: torch.Tensor,
        theta: torch.Tensor,
        scale: float,
        step: int,
        block_id: int,
        query: int = 0,
        start: int = 0,
        total: int | None = None,
    ) -> None:
        """``NoiseSource.perturb_into``: where ``fuses_master``, a matrix's elements in one
        kernel a run of rows at a time, its 1-D entries and padding on the generic path."""
        stop = start + theta.numel()
        total = stop if total is None else total
        if scale == 0.0 or not self.fuses_master(theta, out):
            super().perturb_into(out, theta, scale, step, block_id, query, start, total)
            return
        refuse_short(out, theta.numel(), "the perturbation's out")
        from distzo.zo import triton_lowrank

        keys = self.keys(step, block_id, query)
        for s, lo, hi in self._spans(start, stop, total, block_id):
            piece = slice(lo - start, hi - start)
            if s is None:
                self.perturb_chunks(
                    out[piece], theta[piece], scale, step, block_id, query, lo, total
                )
                continue
            v = self._v_of(s, keys.v)
            for a, b, first in self._row_runs(s, lo, hi, keys.u):
                run = slice(a - start, b - start)
                triton_lowrank.perturb(out[run], theta[run], self._u, v, first, scale)

    def apply_terms(
        self,
        theta: torch.Tensor,
        decay_end: int,
        shrink: float,
        terms: Sequence[tuple[int, int, float]],
        block_id: int,
        start: int = 0,
        total: int | None = None,
    ) -> None:
        """``NoiseSource.apply_terms``: where ``fuses_master``, a matrix's elements take the
        decay and each term's ``alpha z`` in one kernel per term (the decay in the first), a
        run of rows at a time; its 1-D entries and padding the generic path."""
        stop = start + theta.numel()
        total = stop if total is None else total
        if not terms or not self.fuses_master(theta):
            # the chunked path itself: ``NoiseSource.apply_terms`` would ask ``fuses_master``
            # again and hand this kind to the element-wise kernel, which has no low-rank z
            self._refuse_range(start, stop, total, block_id)
            self.terms_chunks(theta, decay_end, shrink, terms, block_id, start, total)
            return
        from distzo.zo import triton_lowrank

        for s, lo, hi in self._spans(start, stop, total, block_id):
            piece = theta[lo - start : hi - start]
            if s is None:
                self.terms_chunks(piece, decay_end, shrink, terms, block_id, lo, total)
                continue
            for index, (step, query, alpha) in enumerate(terms):
                keys = self.keys(step, block_id, query)
                v = self._v_of(s, keys.v)
                for a, b, first in self._row_runs(s, lo, hi, keys.u):
                    decay = decay_end - a if index == 0 else 0
                    run = theta[a - start : b - start]
                    triton_lowrank.update(run, self._u, v, first, decay, shrink, alpha)

    def _refuse_range(self, start: int, stop: int, total: int, block_id: int) -> None:
        """Refuse a range outside its bucket, or a bucket id this source has no layout of."""
        refuse_outside(start, stop, total)
        if not 0 <= block_id < len(self._segments):
            raise ValueError(
                f"block id {block_id} has no layout in this low-rank noise source "
                f"({len(self._segments)} buckets)"
            )

    def _spans(
        self, start: int, stop: int, total: int, block_id: int
    ) -> Iterator[tuple[Segment | None, int, int]]:
        """Bucket elements [start, stop) cut where segments meet: (the matrix segment, lo,
        hi), or (None, lo, hi) for a run of 1-D entries, padding or elements past the
        layout (the generic path's). Refuses a range outside the bucket or an unknown id."""
        self._refuse_range(start, stop, total, block_id)
        segs, at = self._segments[block_id], start
        i = max(0, bisect.bisect_right(self._starts[block_id], start) - 1)
        generic = start  # the start of the run of generic elements not yet yielded
        while at < stop:  # the walk of ``_fill_range``
            s = segs[i] if i < len(segs) else None
            end = stop if s is None else min(s.stop, stop)
            if s is not None and s.cols:
                if generic < at:
                    yield None, generic, at
                yield s, at, end
                generic = end
            at, i = end, i + 1
        if generic < stop:
            yield None, generic, stop

    def _row_runs(
        self, s: Segment, lo: int, hi: int, u_key: tuple[int, int]
    ) -> Iterator[tuple[int, int, int]]:
        """Bucket elements [lo, hi) of matrix ``s`` in runs of the rows the U buffer holds:
        each run's U rows are drawn into it (from their row) before it is yielded as (its
        first, its end, its first's place in its first row)."""
        r, cols = self.rank, s.cols
        batch = max(1, self._u.numel() // r)
        first, end = lo - s.start, hi - s.start
        row = first // cols
        while row * cols < end:
            k = min(batch, (end - 1) // cols + 1 - row)
            self._draw_range(self._u[: k * r], s.u_offset + row * r, u_key)
            a = max(first, row * cols)
            yield s.start + a, s.start + min(end, (row + k) * cols), a - row * cols
            row += k

    def keys(self, step: int, block_id: int, query: int = 0) -> Keys:
        """The keys of a draw: V's is its window's first step's."""
        window = step - step % self.interval
        return Keys(
            self.key(step, block_id, query),
            philox.noise_key(self.run_seed, step, block_id, query, philox.STREAM_LOWRANK_U),
            philox.noise_key(self.run_seed, window, block_id, query, philox.STREAM_LOWRANK_V),
        )

    def chunks(
        self, start: int, stop: int, total: int, step: int, block_id: int, query: int = 0
    ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Yield ``(lo, hi, z)`` as ``NoiseSource.chunks`` does; elements past the bucket's
        layout (a padded slot) are 0."""
        self._refuse_range(start, stop, total, block_id)
        keys, c = self.keys(step, block_id, query), self.piece
        for lo in range(start - start % c, stop, c):
            lo, hi = max(lo, start), min(lo + c, stop)
            z = self._workspace[: hi - lo]
            self._fill_range(z, lo, block_id, keys)
            yield lo, hi, z

    def factors(
        self,
        step: int,
        block_id: int,
        offset: int,
        query: int = 0,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(U, V) of the matrix entry at bucket ``offset``: its z is ``U @ V.T``. Copies, or
        drawn into ``out`` (two flat buffers of at least rows x r and cols x r elements, so
        that a step's update allocates nothing), viewed as rows x r and cols x r."""
        segment, r = self._matrix(block_id, offset), self.rank
        keys = self.keys(step, block_id, query)
        u_out, v_out = out or (
            torch.empty(segment.rows * r, device=self.device, dtype=self.dtype),
            None,
        )
        u = u_out[: segment.rows * r]
        self._draw_range(u, segment.u_offset, keys.u)
        return u.view(segment.rows, r), _copy(self._v_of(segment, keys.v), v_out)

    def column_factor(
        self,
        step: int,
        block_id: int,
        offset: int,
        query: int = 0,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """V of the matrix entry at bucket ``offset`` in step ``step``'s window, without
        drawing U: LOZO-M's V_old at a redraw. A copy, or written into the flat ``out``."""
        segment = self._matrix(block_id, offset)
        return _copy(self._v_of(segment, self.keys(step, block_id, query).v), out)

    def _matrix(self, block_id: int, offset: int) -> Segment:
        """The matrix entry at bucket ``offset``, or a one-line error."""
        matrices = self._matrices[block_id] if 0 <= block_id < len(self._matrices) else {}
        segment = matrices.get(offset)
        if segment is None:
            raise ValueError(f"bucket {block_id} has no matrix entry at offset {offset}")
        return segment

    @property
    def num_buckets(self) -> int:
        """The buckets (noise ids) the source has layouts of."""
        return len(self._segments)

    def segments_of(self, block_id: int) -> tuple[Segment, ...]:
        """Bucket ``block_id`` cut into segments (``segments``)."""
        return self._segments[block_id]

    def _fill_range(self, z: torch.Tensor, lo: int, block_id: int, keys: Keys) -> None:
        """z <- elements [lo, lo + len(z)) of the bucket's z, segment by segment."""
        segs, hi = self._segments[block_id], lo + z.numel()
        i, at = max(0, bisect.bisect_right(self._starts[block_id], lo) - 1), lo
        while at < hi:
            if i >= len(segs):  # past the layout
                z[at - lo :].zero_()
                return
            s = segs[i]
            end = min(s.stop, hi)
            out = z[at - lo : end - lo]
            if s.cols:
                self._matrix_into(out, at - s.start, s, keys)
            elif s.gaussian:
                self._fill(out, at, keys.z)
            else:
                out.zero_()
            at, i = end, i + 1

    def _matrix_into(self, out: torch.Tensor, first: int, s: Segment, keys: Keys) -> None:
        """out <- elements [first, first + len(out)) of a matrix's ``U V^T`` (row-major):
        a partial first row, whole rows a U buffer at a time, a partial last row."""
        n, count = s.cols, out.numel()
        v = self._v_of(s, keys.v)
        row, col, done = first // n, first % n, 0
        if col:
            width = min(n - col, count)
            self._rows_into(out[:width].view(1, width), row, col, s, v, keys.u)
            done, row = width, row + 1
        batch = max(1, self._u.numel() // self.rank)
        while count - done >= n:
            k = min(batch, (count - done) // n)
            self._rows_into(out[done : done + k * n].view(k, n), row, 0, s, v, keys.u)
            done, row = done + k * n, row + k
        if done < count:
            width = count - done
            self._rows_into(out[done:].view(1, width), row, 0, s, v, keys.u)

    def _rows_into(
        self,
        dst: torch.Tensor,
        row: int,
        col: int,
        s: Segment,
        v: torch.Tensor,
        u_key: tuple[int, int],
    ) -> None:
        """dst (k x w) <- rows [row, row + k), columns [col, col + w) of ``U V^T``, summed
        over the rank in order by separate multiplies and adds."""
        k, w = dst.shape
        r = self.rank
        u = self._u[: k * r]
        self._draw_range(u, s.u_offset + row * r, u_key)
        u, cols = u.view(k, r), v[col : col + w]
        torch.mul(u[:, :1], cols[:, 0], out=dst)
        if r > 1:
            term = self._product[: k * w].view(k, w)
            for j in range(1, r):
                torch.mul(u[:, j : j + 1], cols[:, j], out=term)
                dst.add_(term)

    def _v_of(self, s: Segment, key: tuple[int, int]) -> torch.Tensor:
        """The matrix's V (cols x r) in the V buffer, drawn unless it already holds it."""
        size = s.cols * self.rank
        held = (key, s.v_offset, s.cols)
        if self._v_holds != held:
            self._draw_range(self._v[:size], s.v_offset, key)
            self._v_holds = held
        return self._v[:size].view(s.cols, self.rank)

    def _draw_range(self, out: torch.Tensor, start: int, key: tuple[int, int]) -> None:
        """out <- Gaussian draws [start, start + len) of ``key``, a workspace piece at a time."""
        for at in range(0, out.numel(), self.piece):
            self._fill(out[at : at + self.piece], start + at, key)


def _copy(v: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``v`` copied out of the shared V buffer (the next draw overwrites it): a clone, or
    into the front of the flat buffer ``out``, viewed as ``v``."""
    return v.clone() if out is None else out[: v.numel()].view_as(v).copy_(v)
