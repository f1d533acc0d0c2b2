"""LOZO-M: LOZO's momentum kept in the low-rank factors, not in a dense moment.

With LOZO's noise a matrix W (m x n) moves along ``Z = U V^T``, U (m x r) drawn each
step and V (n x r) kept for ``interval`` steps. Within a window every estimate
``g U V^T`` shares the factor V, so the momentum of those estimates is ``N V^T`` with N
an m x r factor: the whole point is memory, r/n of a dense moment (OPT-175B at r = 2:
about 85 MB). LOZO-M (Chen et al., ICLR 2025, arXiv 2410.07698) keeps only N:

* a step that keeps V: ``N <- beta1 N + (1 - beta1) g U``;
* a step that redraws V (``t % interval == 0``): the old momentum projected onto the new
  subspace, ``N <- beta1 N (V_old^T V_new) / n + (1 - beta1) g U``;
* then ``W <- W (1 - lr wd) - lr N V^T`` (decay where distzo decays: matrices).

A 1-D entry (bias, norm scale) keeps a dense moment of its Gaussian z:
``m <- beta1 m + (1 - beta1) g z``, ``W <- W - lr m``.

**The first step** (step 0 of a run) sets ``N = g U`` and ``m = g z``, as LOZO's own code
does, rather than ``(1 - beta1) g U`` from a zero N: the first moves are then as large as
the later ones instead of ``1 - beta1`` of them (a tenth at beta1 = 0.9), so a learning
rate tuned with LOZO's code means the same here. V_old is never stored: it is the V of
the previous window, regenerated from its key like every other draw.

The state of a bucket is one flat tensor on the device: each matrix entry's N (rows x r,
row-major) then each 1-D entry's moment, in the bucket's element order. It is kept whole
on every rank in every layout (it is tiny), so a streamed block's update reads it where
the block is uploaded and nothing of it crosses the host link. The factors an update
draws (U, V, V_old) and its projection go to scratch sized once for the widest matrix, so
a step allocates nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from distzo.zo.lowrank import LowRankNoise, Segment


def moment_elements(segment: Segment, rank: int) -> int:
    """Elements of one segment's LOZO-M moment: rows x r for a matrix, its length for a 1-D
    entry, none for padding."""
    if segment.cols:
        return segment.rows * rank
    return segment.stop - segment.start if segment.gaussian else 0


def state_elements(segments: Sequence[Segment], rank: int) -> int:
    """Elements of a bucket's LOZO-M state: its segments' moments, in the bucket's order."""
    return sum(moment_elements(s, rank) for s in segments)


def scratch_elements(segment_lists: Sequence[Sequence[Segment]], rank: int) -> int:
    """Elements of the update's scratch (``FactorScratch``): U and the projected N for the
    most rows, V and V_old for the most columns, and the r x r projection."""
    rows, cols = _widest(segment_lists)
    return 2 * rows * rank + 2 * cols * rank + rank * rank


def _widest(segment_lists: Sequence[Sequence[Segment]]) -> tuple[int, int]:
    """The most rows and the most columns of any matrix entry (0, 0 without one)."""
    matrices = [s for segs in segment_lists for s in segs if s.cols]
    return max((s.rows for s in matrices), default=0), max((s.cols for s in matrices), default=0)


class FactorScratch:
    """Flat buffers an update draws its factors into and projects N through, allocated
    once for the widest matrix: the step loop's rule that steps allocate nothing."""

    def __init__(
        self, segment_lists: Sequence[Sequence[Segment]], rank: int, noise: LowRankNoise
    ) -> None:
        rows, cols = _widest(segment_lists)
        device, dtype = noise.device, noise.dtype
        self.u, self.projected = (
            torch.empty(rows * rank, device=device, dtype=dtype) for _ in "up"
        )
        self.v, self.v_old = (torch.empty(cols * rank, device=device, dtype=dtype) for _ in "vo")
        self.projection = torch.empty(rank, rank, device=device, dtype=dtype)

    @property
    def device_bytes(self) -> int:
        return sum(t.nbytes for t in (self.u, self.projected, self.v, self.v_old, self.projection))


class LowRankMomentum:
    """The LOZO-M state of every trained bucket (by noise id) and the update that advances
    it with a bucket. Made zero; ``load`` replaces it from a state or a checkpoint."""

    def __init__(self, noise: LowRankNoise, beta1: float) -> None:
        self.beta1 = float(beta1)
        self.rank, self.interval = noise.rank, noise.interval
        self.segments = [noise.segments_of(block_id) for block_id in range(noise.num_buckets)]
        self.states = [
            torch.zeros(state_elements(segs, self.rank), device=noise.device, dtype=noise.dtype)
            for segs in self.segments
        ]
        self.scratch = FactorScratch(self.segments, self.rank, noise)

    @property
    def device_bytes(self) -> int:
        """The states and the update's scratch."""
        return sum(t.nbytes for t in self.states) + self.scratch.device_bytes

    def load(self, states: Sequence[torch.Tensor]) -> None:
        """Copy saved states in (one per bucket, as ``states`` holds them)."""
        if len(states) != len(self.states) or any(
            a.numel() != b.numel() for a, b in zip(states, self.states)
        ):
            raise ValueError(
                f"the saved LOZO-M state has buckets of {[t.numel() for t in states]} elements, "
                f"this model's are {[t.numel() for t in self.states]}; load a state of this "
                "model trained with the same lozo rank"
            )
        with torch.no_grad():
            for saved, state in zip(states, self.states):
                state.copy_(saved.reshape(-1))

    def apply(
        self,
        noise: LowRankNoise,
        theta: torch.Tensor,
        decay_end: int,
        lr: float,
        weight_decay: float,
        step: int,
        projected_grad: float,
        block_id: int,
    ) -> None:
        """Advance bucket ``block_id``'s state with step ``step``'s estimate and update
        ``theta`` (the whole bucket) in place; decay only on ``theta[:decay_end]``."""
        shrink = 1.0 - lr * weight_decay
        decay_end = decay_end if weight_decay else 0
        draw = _Draw(noise, step, projected_grad, block_id, theta.numel())
        state, at = self.states[block_id], 0
        for s in self.segments[block_id]:
            if not (s.cols or s.gaussian):
                continue  # padding
            piece = theta[s.start : s.stop]
            if s.stop <= decay_end:
                piece.mul_(shrink)
            size = moment_elements(s, self.rank)
            moment = state[at : at + size]
            if s.cols:
                w = piece.view(s.rows, s.cols)
                self._matrix(draw, w, moment.view(s.rows, self.rank), s, lr)
            else:
                self._vector(draw, piece, moment, s, lr)
            at += size

    def _matrix(
        self, draw: _Draw, w: torch.Tensor, moment: torch.Tensor, s: Segment, lr: float
    ) -> None:
        """N and W of one matrix entry; W -= lr N V^T in one in-place matmul."""
        noise, step, g, scratch = draw.noise, draw.step, draw.projected_grad, self.scratch
        u, v = noise.factors(step, draw.block_id, s.start, out=(scratch.u, scratch.v))
        if step == 0:
            torch.mul(u, g, out=moment)
        else:
            if step % self.interval == 0:  # V redrawn: project N onto the new subspace
                v_old = noise.column_factor(step - 1, draw.block_id, s.start, out=scratch.v_old)
                projection = torch.mm(v_old.T, v, out=scratch.projection)
                projected = torch.mm(
                    moment, projection, out=scratch.projected[: moment.numel()].view_as(moment)
                )
                torch.div(projected, s.cols, out=moment)
            moment.mul_(self.beta1).add_(u, alpha=(1.0 - self.beta1) * g)
        w.addmm_(moment, v.T, alpha=-lr)

    def _vector(
        self, draw: _Draw, w: torch.Tensor, moment: torch.Tensor, s: Segment, lr: float
    ) -> None:
        """The dense moment of a 1-D entry, from its Gaussian z a noise piece at a time."""
        step, g = draw.step, draw.projected_grad
        for lo, hi, z in draw.noise.chunks(s.start, s.stop, draw.total, step, draw.block_id):
            m = moment[lo - s.start : hi - s.start]
            if step == 0:
                torch.mul(z, g, out=m)
            else:
                m.mul_(self.beta1).add_(z, alpha=(1.0 - self.beta1) * g)
        w.add_(moment, alpha=-lr)


class _Draw(NamedTuple):
    """The step a bucket's update draws for: its noise, step, g, bucket and bucket length."""

    noise: LowRankNoise
    step: int
    projected_grad: float
    block_id: int
    total: int
