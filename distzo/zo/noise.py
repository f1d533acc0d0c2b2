"""Counter-based Gaussian noise and the fused ops that consume it.

z for (step, query, block) is never stored: any rank regenerates any chunk of it from
``(run_seed, step, block_id, chunk, query)`` alone. Chunk boundaries sit at fixed offsets
of the flat bucket, so a chunk's values do not depend on which op asks for it, in
which order blocks run, or how many ranks share the work.
"""

from __future__ import annotations

from typing import Sequence

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_seed(run_seed: int, step: int, block_id: int, chunk: int, query: int = 0) -> int:
    """Seed of one noise chunk: a pure function of its coordinates (63 bits).

    Chaining splitmix64 over the coordinates keeps neighbouring steps/blocks from
    producing correlated generator seeds. ``query`` (the n-SPSA direction) is chained
    only when it is not 0, so query 0 is the single-direction draw: a MeZO run's noise,
    logs and checkpoints do not depend on whether multi-query support exists.
    """
    h = _splitmix64(run_seed & _MASK64)
    for part in (step, block_id, chunk) + ((query,) if query else ()):
        h = _splitmix64(h ^ (part & _MASK64))
    return h >> 1


class NoiseSource:
    """Fills chunks of z on one device, reusing one workspace and one generator.

    The workspace is allocated once (``chunk`` elements), so the fused ops below
    allocate nothing in the step loop.
    """

    def __init__(
        self, run_seed: int, chunk: int, device: torch.device, dtype: torch.dtype, distribution: str = "normal"
    ) -> None:
        if distribution not in ("normal", "uniform"):
            raise ValueError(f"distribution must be normal or uniform, got {distribution!r}")
        if chunk <= 0:
            raise ValueError(f"noise chunk must be > 0 elements, got {chunk}")
        self.run_seed = int(run_seed)
        self.chunk = int(chunk)
        self.device = torch.device(device)
        self.dtype = dtype
        self.distribution = distribution
        self._generator = torch.Generator(device=self.device)
        self._workspace = torch.empty(self.chunk, device=self.device, dtype=dtype)

    def chunks(self, start: int, stop: int, total: int, step: int, block_id: int, query: int = 0):
        """Yield ``(lo, hi, z)`` for the chunk-aligned pieces of ``[start, stop)``.

        ``total`` is the bucket's length: each chunk is drawn whole (clipped only by
        ``total``), so its values never depend on the range asked for. ``z`` holds
        the noise of bucket elements ``lo..hi``; it is a view of the shared
        workspace, valid until the next item is drawn.
        """
        if not 0 <= start <= stop <= total:
            raise ValueError(f"noise range [{start}, {stop}) is outside a bucket of {total}")
        c = self.chunk
        for index in range(start // c, (stop + c - 1) // c):
            chunk_lo, chunk_hi = index * c, min((index + 1) * c, total)
            self._generator.manual_seed(noise_seed(self.run_seed, step, block_id, index, query))
            z = self._workspace[: chunk_hi - chunk_lo]
            if self.distribution == "normal":
                z.normal_(generator=self._generator)
            else:
                z.uniform_(generator=self._generator)
            lo, hi = max(start, chunk_lo), min(stop, chunk_hi)
            yield lo, hi, z[lo - chunk_lo : hi - chunk_lo]

    def full(self, numel: int, step: int, block_id: int, query: int = 0) -> torch.Tensor:
        """Materialise z for a whole bucket: for tests, never the step loop."""
        out = torch.empty(numel, device=self.device, dtype=self.dtype)
        for lo, hi, z in self.chunks(0, numel, numel, step, block_id, query):
            out[lo:hi] = z
        return out

    def perturb_into(
        self, out: torch.Tensor, theta: torch.Tensor, scale: float, step: int, block_id: int, query: int = 0
    ) -> None:
        """out = theta + scale * z_query, out of place, so theta is never perturbed."""
        n = theta.numel()
        if scale == 0.0:
            out[:n].copy_(theta)
            return
        for lo, hi, z in self.chunks(0, n, n, step, block_id, query):
            torch.add(theta[lo:hi], z, alpha=scale, out=out[lo:hi])

    def apply_update(
        self,
        theta: torch.Tensor,
        decay_end: int,
        lr: float,
        projected_grads: Sequence[float],
        weight_decay: float,
        step: int,
        block_id: int,
    ) -> None:
        """theta <- theta - lr * (mean_j g_j * z_j + wd * theta), wd only on ``theta[:decay_end]``.

        One g per query (n-SPSA); MeZO's step is the one-query case. Chunk by chunk, so each
        piece of theta is read and written while it is hot, whatever the number of queries.
        """
        shrink = 1.0 - lr * weight_decay
        alphas = [-lr * g / len(projected_grads) for g in projected_grads]
        n, c = theta.numel(), self.chunk
        for lo in range(0, n, c):
            hi = min(lo + c, n)
            piece = theta[lo:hi]
            if weight_decay and lo < decay_end:
                piece[: min(hi, decay_end) - lo].mul_(shrink)
            for query, alpha in enumerate(alphas):
                for _, _, z in self.chunks(lo, hi, n, step, block_id, query):
                    piece.add_(z, alpha=alpha)
