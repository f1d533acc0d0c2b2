"""The noise z of every step and the fused ops that consume it.

z for (step, query, block) is never stored: any rank regenerates any piece of it from
``(run_seed, step, block_id, query)`` and the element's index alone. Three kinds:

* ``gaussian`` (the default) and ``rademacher``: portable. Each element's bits come from
  Philox4x32-10 keyed by those coordinates (``distzo.zo.philox``), a Gaussian z from a
  table of quantiles (``gaussian_table``), a Rademacher z (+-1, SPSA's original) from one
  bit. Integer arithmetic and a lookup: the same z on a CPU and on every GPU model,
  whatever the chunking, slicing or thread grid, so a run resumes and replays anywhere.
  On CUDA with Triton the ops below draw z inside one kernel each
  (``triton_noise``); on CPU a C kernel (``fast_noise``) fills a cache-sized chunk at a
  time; elsewhere the torch implementation does, slower, with the same bits.
* ``lowrank``: LOZO's perturbation, ``U V^T`` per weight matrix from the portable draws
  (``distzo.zo.lowrank``, ``LowRankNoise``: the same ops on the generic path).
* ``legacy``: the ``torch.Generator`` draws of earlier versions, chunk by chunk
  (``noise_chunk`` is then part of the run's identity, and CPU and CUDA draw different
  z): kept so that older checkpoints and seed logs resume and replay.

``NOISE_VERSION`` numbers the definition of the portable kinds; states and logs record
kind and version, and a mismatch is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distzo.zo import fast_noise, philox, triton_noise
from distzo.zo.gaussian_table import gaussian_table
from distzo.zo.seeds import noise_seed  # noqa: F401  (re-exported: data keys its batches with it)

NOISE_KINDS = ("gaussian", "rademacher", "legacy", "lowrank")
# the kinds a NoiseSource draws element by element; lowrank is LowRankNoise's
ELEMENTWISE_KINDS = NOISE_KINDS[:3]
NOISE_VERSION = 1


def noise_identity(kind: str) -> str:
    """What a state or a log records of its noise: the kind, with the version if portable."""
    return kind if kind == "legacy" else f"{kind}-v{NOISE_VERSION}"


def identity_kind(identity: str) -> str:
    """The kind named by a recorded identity (``gaussian-v1`` -> ``gaussian``)."""
    return identity.split("-v")[0]


def drawable(identity: str) -> bool:
    """Whether this version draws the noise a state or log recorded (its kind and version)."""
    kind = identity_kind(identity)
    return kind in NOISE_KINDS and identity == noise_identity(kind)


_TABLES: dict[torch.device, torch.Tensor] = {}
TABLE_BYTES = 1 << 18  # the Gaussian table: 65,536 float32 values, one copy per device
# Portable draws on the CPU go a cache-sized piece at a time (1 MB of float32, an L2's
# share), so z is consumed while it is still in cache; the bits do not depend on it.
CPU_PIECE = 1 << 18


def workspace_elements(chunk: int, device_type: str, kind: str) -> int:
    """The workspace a source holds: ``chunk`` elements, or a cache-sized piece for
    portable draws on the CPU (where the chunking changes no value)."""
    return min(chunk, CPU_PIECE) if device_type == "cpu" and kind != "legacy" else chunk


def planned_noise_bytes(chunk: int, itemsize: int, device_type: str, kind: str) -> int:
    """What a ``NoiseSource`` of ``chunk`` elements allocates: its workspace, the
    float32 staging of the C (CPU) or Triton (CUDA) kernel for other master dtypes, the
    table (portable kinds; shared by every source on a device, counted with each here, an
    upper bound)."""
    if kind == "legacy":
        return chunk * itemsize
    elements = workspace_elements(chunk, device_type, kind)
    # planned for CUDA from any machine: Triton is assumed there
    kernel = fast_noise.available() if device_type == "cpu" else device_type == "cuda"
    staging = elements * 4 if kernel and itemsize != 4 else 0
    return elements * itemsize + staging + TABLE_BYTES


def _table(device: torch.device) -> torch.Tensor:
    if device not in _TABLES:
        _TABLES[device] = gaussian_table().to(device)
    return _TABLES[device]


def add_scaled(out: torch.Tensor, x: torch.Tensor, z: torch.Tensor, alpha: float) -> None:
    """out <- x + alpha * z, torch's ``add`` (one rounding: a fused multiply-add). A 16-bit
    x (a model held in fp16 or bf16) is the one exception: torch's CPU kernel forms its
    sum in float32 with alpha rounded to x's dtype in its vectorised body but in 16-bit
    arithmetic (the product rounded) in a tail, and CUDA's keeps alpha in float32, so
    the bits would depend on the machine and on where a chunk ends. Here alpha is rounded
    to x's dtype, the sum (of an exact product) formed in float32 and rounded to nearest:
    the Triton kernels' rule, on every device."""
    if x.dtype not in triton_noise.LOW_BIT_MASTERS:
        torch.add(x, z, alpha=alpha, out=out)
        return
    out.copy_(torch.add(x.float(), z.float(), alpha=triton_noise.as_operand(alpha, x.dtype)))


def refuse_short(out: torch.Tensor, n: int, what: str) -> None:
    """Refuse an output of fewer than ``n`` elements before any work: a fused kernel would
    write past its end (torch's chunked ops would resize a view over what follows)."""
    if out.numel() < n:
        raise ValueError(f"{what} holds {out.numel()} elements, fewer than the {n} it is given")


def refuse_outside(start: int, stop: int, total: int) -> None:
    """Refuse a range of elements outside its bucket, before any element is drawn or
    changed (on every path: the fused kernels would draw it, the chunked ops stop midway)."""
    if not 0 <= start <= stop <= total:
        raise ValueError(f"noise range [{start}, {stop}) is outside a bucket of {total}")


class NoiseSource:
    """Fills chunks of z (or of uniform draws) on one device, reusing one workspace.

    The workspace is allocated once (``chunk`` elements), so the fused ops below
    allocate nothing in the step loop. ``distribution`` "normal" draws the perturbation
    z of ``kind``; "uniform" draws the stochastic rounding's uniforms in [0, 1) (24 bits,
    from their own Philox stream, or the legacy generator's).
    """

    def __init__(
        self,
        run_seed: int,
        chunk: int,
        device: torch.device,
        dtype: torch.dtype,
        distribution: str = "normal",
        kind: str = "gaussian",
    ) -> None:
        if distribution not in ("normal", "uniform"):
            raise ValueError(f"distribution must be normal or uniform, got {distribution!r}")
        if chunk <= 0:
            raise ValueError(f"noise chunk must be > 0 elements, got {chunk}")
        if kind not in ELEMENTWISE_KINDS:
            raise ValueError(
                f"noise kind must be one of {', '.join(ELEMENTWISE_KINDS)}, got {kind!r}"
                + ("; lowrank noise is distzo.zo.lowrank.LowRankNoise" if kind == "lowrank" else "")
            )
        self.run_seed = int(run_seed)
        self.chunk = int(chunk)
        self.device = torch.device(device)
        self.dtype = dtype
        self.distribution = distribution
        self.kind = kind
        # elements drawn at a time
        self.piece = workspace_elements(self.chunk, self.device.type, kind)
        self._workspace = torch.empty(self.piece, device=self.device, dtype=dtype)
        if kind == "legacy":
            self._generator = torch.Generator(device=self.device)
            self._triton = self._c = False
            self._table = self._float32 = None
            return
        self._draw = "uniform" if distribution == "uniform" else kind
        self._stream = philox.STREAM_ROUNDING if distribution == "uniform" else philox.STREAM_NOISE
        self._table = _table(self.device)
        self._triton = self.device.type == "cuda" and triton_noise.available()
        self._c = self.device.type == "cpu" and fast_noise.available()
        # the C and Triton kernels write float32; another master dtype takes the copy (exact
        # for float64, rounded to nearest for a 16-bit one, as the torch draws are)
        needs_float32 = (self._c or self._triton) and dtype != torch.float32
        self._float32 = (
            torch.empty(self.piece, dtype=torch.float32, device=self.device)
            if needs_float32
            else None
        )

    @property
    def device_bytes(self) -> int:
        """Workspace, staging and table: what ``planned_noise_bytes`` plans."""
        extras = (self._float32, self._table)
        return self._workspace.nbytes + sum(t.nbytes for t in extras if t is not None)

    @property
    def backend(self) -> str:
        """Which implementation draws: triton, c, torch (same bits) or legacy."""
        if self.kind == "legacy":
            return "legacy"
        return "triton" if self._triton else "c" if self._c else "torch"

    @property
    def kind_table(self) -> torch.Tensor:
        """The Gaussian table of a portable kind (a legacy source draws without one)."""
        assert self._table is not None, "a legacy noise source has no table"
        return self._table

    def key(self, step: int, block_id: int, query: int = 0) -> tuple[int, int]:
        return philox.noise_key(self.run_seed, step, block_id, query, self._stream)

    def _fill(self, out: torch.Tensor, start: int, key: tuple[int, int]) -> None:
        """out <- the draws of elements [start, start + len(out)) of the keyed bucket."""
        if self._triton or self._c:
            if out.dtype == torch.float32:
                staging = out
            else:
                assert self._float32 is not None  # allocated for a non-float32 master
                staging = self._float32[: out.numel()]
            fill = triton_noise.fill if self._triton else fast_noise.fill
            fill(staging, start, key, self._draw, self.kind_table)
            if staging is not out:
                out.copy_(staging)
        else:
            out.copy_(self.reference(start, start + out.numel(), key))

    def reference(self, start: int, stop: int, key: tuple[int, int]) -> torch.Tensor:
        """The draws of elements [start, stop) from the torch implementation (any device)."""
        lanes = philox.LANES32 if self._draw == "uniform" else philox.LANES16
        bits = philox.torch_lanes(key, start, stop, lanes, self.device)
        if self._draw == "uniform":
            return (bits >> 8).to(torch.float32) * (1.0 / 16777216.0)
        if self._draw == "rademacher":
            return torch.where((bits & 0x8000) != 0, 1.0, -1.0).to(torch.float32)
        return self.kind_table[bits]

    def chunks(self, start: int, stop: int, total: int, step: int, block_id: int, query: int = 0):
        """Yield ``(lo, hi, z)`` for the chunk-aligned pieces of ``[start, stop)``.

        ``total`` is the bucket's length. ``z`` holds the draws of bucket elements
        ``lo..hi``; it is a view of the shared workspace, valid until the next item is
        drawn. Portable kinds: a pure function of each element, so the chunking changes
        nothing. Legacy: each chunk is drawn whole from its own seed.
        """
        refuse_outside(start, stop, total)
        c = self.piece
        if self.kind != "legacy":
            key = self.key(step, block_id, query)
            for lo in range(start - start % c, stop, c):
                lo, hi = max(lo, start), min(lo + c, stop)
                z = self._workspace[: hi - lo]
                self._fill(z, lo, key)
                yield lo, hi, z
            return
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

    def fuses(self, *tensors: torch.Tensor) -> bool:
        """One Triton kernel per op: CUDA, a portable kind, float32 contiguous operands
        (a float64 master keeps torch's double-precision arithmetic)."""
        return self._triton and all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)

    def fuses_master(self, theta: torch.Tensor, out: torch.Tensor | None = None) -> bool:
        """The perturbation and the update as one kernel each for this master: ``fuses``,
        or a model held in fp16 or bf16 (its out of its dtype), whose kernels round as
        the chunked path does (``add_scaled``'s rule: z and alpha in its dtype, each op's
        float32 result rounded to it): the same bits. ``out`` contiguous (the kernel
        writes its elements in order)."""
        if out is not None and not out.is_contiguous():
            return False
        return self.fuses(theta) or (
            self._triton
            and theta.dtype in triton_noise.LOW_BIT_MASTERS
            and theta.is_contiguous()
            and (out is None or out.dtype == theta.dtype)
        )

    def round_into(
        self, dst: torch.Tensor, src: torch.Tensor, start: int, step: int, block_id: int
    ) -> bool:
        """Stochastic rounding of bucket elements [start, start + n) into ``dst``'s low-bit
        format (bf16, fp16, fp8) in one fused kernel, where there is one (CUDA with Triton,
        uniform draws of a portable kind, float32 source): True if it ran. Otherwise the
        caller rounds chunk by chunk with ``chunks`` (the same result, bit for bit)."""
        refuse_short(dst, src.numel(), "the rounding's destination")
        fused = (
            self.distribution == "uniform"
            and self._triton
            and triton_noise.rounds_into(dst.dtype)
            and src.dtype == torch.float32
            and dst.is_contiguous()
            and src.is_contiguous()
        )
        if fused:
            triton_noise.round_stochastic(dst, src, start, self.key(step, block_id))
        return fused

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
        """out = theta + scale * z_query, out of place, so theta is never perturbed.

        ``theta`` holds elements ``[start, start + n)`` of a bucket of ``total`` elements
        (the whole bucket by default), and takes their z."""
        n = theta.numel()
        stop = start + n
        refuse_short(out, n, "the perturbation's out")
        refuse_outside(start, stop, stop if total is None else total)
        if scale == 0.0:
            out[:n].copy_(theta)
            return
        if self.fuses_master(theta, out):
            key = self.key(step, block_id, query)
            triton_noise.perturb(out[:n], theta, scale, key, self.kind, self.kind_table, start)
            return
        self.perturb_chunks(out, theta, scale, step, block_id, query, start, total)

    def perturb_chunks(
        self,
        out: torch.Tensor,
        theta: torch.Tensor,
        scale: float,
        step: int,
        block_id: int,
        query: int,
        start: int,
        total: int | None,
    ) -> None:
        """``perturb_into``'s generic path: z a chunk at a time, then the add."""
        stop = start + theta.numel()
        for lo, hi, z in self.chunks(
            start, stop, stop if total is None else total, step, block_id, query
        ):
            add_scaled(out[lo - start : hi - start], theta[lo - start : hi - start], z, scale)

    def term_keys(
        self, terms: Sequence[tuple[int, int, float]], block_id: int
    ) -> tuple[list[tuple[int, int]], list[float]]:
        """The keys and the alphas of ``(step, query, alpha)`` terms: what a fused kernel
        takes for them."""
        return [self.key(s, block_id, q) for s, q, _ in terms], [a for _, _, a in terms]

    def rebuild_perturb_into(
        self,
        out: torch.Tensor,
        at_rest: torch.Tensor,
        decay_end: int,
        shrink: float,
        terms: Sequence[tuple[int, int, float]],
        block_id: int,
        scale: float,
        step: int,
        query: int = 0,
        start: int = 0,
    ) -> bool:
        """out = (float32(at_rest) after ``apply_terms(.., decay_end, shrink, terms, ..)``)
        + scale * z_query, the master never stored: one fused kernel where there is one
        (CUDA with Triton, a portable kind, a bf16 or fp16 block at rest): True if it ran.
        Otherwise the caller rebuilds the master and perturbs it (the same result).
        ``at_rest`` holds the block's elements [start, start + n) and takes their z."""
        refuse_short(out, at_rest.numel(), "the rebuilt perturbation's out")
        fused = (
            self.fuses()  # CUDA, Triton, a kind drawn element by element
            and at_rest.dtype in triton_noise.REBUILDS_FROM
            and at_rest.is_contiguous()
            and out.is_contiguous()
        )
        if fused:
            triton_noise.rebuild_perturb(
                out[: at_rest.numel()],
                at_rest,
                decay_end,
                shrink,
                *self.term_keys(terms, block_id),
                self.key(step, block_id, query),
                scale,
                self.kind,
                self.kind_table,
                start,
            )
        return fused

    def rebuild_round_into(
        self,
        at_rest: torch.Tensor,
        start: int,
        decay_end: int,
        shrink: float,
        terms: Sequence[tuple[int, int, float]],
        block_id: int,
        rounding: NoiseSource,
        step: int,
        stream: int,
    ) -> bool:
        """at_rest (bucket elements [start, start + n) of a 16-bit block) <- itself upcast,
        after ``apply_terms(.., decay_end, shrink, terms, ..)``, rounded back as
        ``round_keyed_`` rounds with ``rounding``'s uniforms of ``(step, stream)``: in place,
        the master never stored, in one fused kernel where both sources have theirs (CUDA
        with Triton, portable kinds, bf16 or fp16): True if it ran."""
        fused = (
            self.fuses()
            and rounding.distribution == "uniform"
            and rounding.fuses()
            and at_rest.dtype in triton_noise.REBUILDS_FROM
            and at_rest.is_contiguous()
        )
        if fused:
            triton_noise.rebuild_round(
                at_rest,
                start,
                decay_end,
                shrink,
                *self.term_keys(terms, block_id),
                rounding.key(step, stream),
                self.kind,
                self.kind_table,
            )
        return fused

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

        One g per query (n-SPSA); MeZO's step is the one-query case.
        """
        terms = [
            (step, query, -lr * g / len(projected_grads)) for query, g in enumerate(projected_grads)
        ]
        self.apply_terms(
            theta, decay_end if weight_decay else 0, 1.0 - lr * weight_decay, terms, block_id
        )

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
        """theta <- theta * shrink on ``[0, decay_end)``, then + sum alpha * z over the
        ``(step, query, alpha)`` terms (one step's queries, or a momentum's recent steps).
        Chunk by chunk, so each piece of theta is read and written while it is hot, whatever
        the number of terms (on CUDA: one kernel, one pass per term).

        ``theta`` holds elements ``[start, start + n)`` of a bucket of ``total`` elements
        (the whole bucket by default; ``decay_end`` counts from the bucket's start): an
        element takes the same operations in whichever piece of the bucket it is updated."""
        n = theta.numel()
        stop = start + n
        total = stop if total is None else total
        refuse_outside(start, stop, total)
        if self.fuses_master(theta):
            triton_noise.update(
                theta,
                decay_end,
                shrink,
                *self.term_keys(terms, block_id),
                self.kind,
                self.kind_table,
                start,
            )
            return
        self.terms_chunks(theta, decay_end, shrink, terms, block_id, start, total)

    def terms_chunks(
        self,
        theta: torch.Tensor,
        decay_end: int,
        shrink: float,
        terms: Sequence[tuple[int, int, float]],
        block_id: int,
        start: int,
        total: int,
    ) -> None:
        """``apply_terms``' generic path: a chunk of theta decayed, then each term's z
        drawn a chunk at a time and added."""
        stop, c = start + theta.numel(), self.piece
        for lo in range(start - start % c, stop, c):  # the pieces ``chunks`` draws
            lo, hi = max(lo, start), min(lo + c, stop)
            piece = theta[lo - start : hi - start]
            if lo < decay_end:
                # a 16-bit piece's product with the scalar is formed in float32 and rounded
                # once, on the CPU (tails included) and on CUDA: the kernels' rule already
                piece[: min(hi, decay_end) - lo].mul_(shrink)
            for step, query, alpha in terms:
                for _, _, z in self.chunks(lo, hi, total, step, block_id, query):
                    add_scaled(piece, piece, z, alpha)
