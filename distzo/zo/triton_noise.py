"""The portable noise on CUDA: Triton kernels that draw z inside the op that uses it.

Each kernel program takes one tile of ``distzo.zo.philox``'s layout (512 Philox
counters; 4,096 elements of 16-bit lanes or 2,048 of 32-bit lanes), runs Philox4x32-10
on its counters once, and then, lane by lane, reads, transforms and writes 512
contiguous elements: z is never written to memory.

* ``fill``: the draws themselves (z, +-1 or uniforms) into a buffer (tests, and the
  rounding of formats without a fused kernel);
* ``perturb``: ``out = theta + scale * z`` (the scratch of a pass);
* ``update``: ``theta = theta * shrink (on the decayed prefix) + sum_j alpha_j z_j``, one
  launch, one read and one write of the bucket for all the terms (a step's queries, or a
  recomputed momentum's window of steps), decay included;
* ``perturb`` and ``update`` of a model held in fp16 or bf16 (no float32 masters): z
  and alpha rounded to its dtype and each op's float32 result rounded to nearest even
  in it, as ``NoiseSource``'s chunked path computes them on every device;
* ``rebuild_perturb``: ``update`` then ``perturb`` of a 16-bit block's values at rest, in
  registers: a pass's scratch from a master that is never stored
  (``low_bit_master="recompute"``); ``rebuild_round``: ``update`` then the stochastic
  rounding, in place: that block's write-back;
* ``momentum`` and ``adam``: the stored moments' rules (``distzo.zo.moments``), theta and
  its moments read once and written once, the step's estimate formed in registers
  (momentum's one query lane by lane, as ``update``'s one term).

* ``round_bf16`` and ``round_low_bit``: stochastic rounding of a float32 range into
  bfloat16, float16 or float8 e4m3fn (the AMP wire formats), its uniforms drawn in
  place: one read, one write (the low-bit values built from integer and exact float
  ops, so fp8 needs no hardware conversion).

Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (slowly): the tests
hold them to the reference generator bit for bit on every CI run. Import this module
only where Triton is installed (``available()``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from distzo.zo.philox import TILE_BLOCKS


@functools.cache
def available() -> bool:
    """Triton is importable, and there is a GPU for it (or its interpreter is asked for)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _kernels():
    from distzo.zo import triton_kernels
    from distzo.zo.triton_cache import writable_kernel_cache

    if os.environ.get("TRITON_INTERPRET") != "1":  # the interpreter compiles nothing
        writable_kernel_cache()  # a read-only home: compiled into a private folder
    return {
        "fill": triton_kernels.fill_kernel,
        "perturb": triton_kernels.perturb_kernel,
        "update": triton_kernels.update_kernel,
        "update_one": triton_kernels.update_one_kernel,
        "rebuild_perturb": triton_kernels.rebuild_perturb_kernel,
        "rebuild_perturb_one": triton_kernels.rebuild_perturb_one_kernel,
        "rebuild_round": triton_kernels.rebuild_round_kernel,
        "rebuild_round_one": triton_kernels.rebuild_round_one_kernel,
        "momentum": triton_kernels.momentum_kernel,
        "momentum_one": triton_kernels.momentum_one_kernel,
        "adam": triton_kernels.adam_kernel,
        "round_bf16": triton_kernels.round_bf16_kernel,
        "round_low_bit": triton_kernels.round_low_bit_kernel,
    }


KINDS = {"gaussian": 0, "rademacher": 1, "uniform": 2}
# Launch options by kernel name (Triton's default otherwise: 4 warps). The kernels that hold
# a whole [8, 512] tile in registers need more threads to spread it over: compiled for sm_90
# with 4 warps, ptxas gives update 168 registers a thread, momentum 247 and Adam 255 with a
# 776-byte spill, so 2-3 programs (8-12 of an SM's 64 warps) fit an SM, too few to hide
# the table reads and memory latency (the H100 measured the update at 0.13 of a copy's
# bandwidth, the perturb kernel, 48 registers, at 0.36). With these, every kernel keeps
# at least half an SM's warps resident and spills nothing (tests/helpers/
# triton_compile_probe.py checks it on every CI run). The options change how a tile is
# spread over threads, not the arithmetic: the results are the same bits.
# benchmarks/noise.py --warps times other choices side by side.
LAUNCH_OPTIONS: dict[str, dict[str, int]] = {
    "update": {"num_warps": 16},  # 32 registers: 4 programs, 64 warps per SM
    "rebuild_perturb": {"num_warps": 16},  # the update's [8, 512] tile, and one more z
    # fp16's rounding rule took 87 registers a thread at 16 warps (16 warps per SM); at 32,
    # 55: one program, 32 warps per SM
    "rebuild_round": {"num_warps": 32},
    # lane by lane, fp16's rule took 90 registers a thread at 4 warps (20 warps per SM)
    "rebuild_round_one": {"num_warps": 8},
    "momentum": {"num_warps": 16},  # 32 registers: 64 warps per SM
    "adam": {"num_warps": 32},  # 58 registers: 1 program, 32 warps per SM
    "round_low_bit": {"num_warps": 8},  # 48 registers: 5 programs, 40 warps per SM
}
KERNEL_NAMES = (
    "fill",
    "perturb",
    "update",
    "update_one",
    "rebuild_perturb",
    "rebuild_perturb_one",
    "rebuild_round",
    "rebuild_round_one",
    "momentum",
    "momentum_one",
    "adam",
    "round_bf16",
    "round_low_bit",
)
# The kernels that spell out each fused multiply-add (tl.fma) compile without fp fusion:
# no other product and sum of theirs may fuse, or they would round unlike torch. The others
# (the draws, the perturbation, bf16's rounding) compile with it: theta + a * z as one fused
# multiply-add, as torch's CPU kernels compute add(..., alpha=a), so that the CPU and the
# GPU round the perturbation alike.
EXACT_KERNELS = frozenset(KERNEL_NAMES) - {"fill", "perturb", "round_bf16"}
# the at-rest formats rebuild_perturb upcasts (fp8 takes the buffered ops: no load of it
# below compute capability 8.9)
REBUILDS_FROM = (torch.bfloat16, torch.float16)


def _grid(start: int, n: int, lanes: int) -> tuple[int]:
    tile = TILE_BLOCKS * lanes
    return ((start + n + tile - 1) // tile - start // tile,)


def compile_options(name: str) -> dict[str, Any]:
    """What kernel ``name`` compiles with: the fp fusion its rounding needs (off for the
    ``EXACT_KERNELS``) and its ``LAUNCH_OPTIONS``. One home for the launches here, the
    probes' direct launches and the compile probe's check of the variant a run uses."""
    return {"enable_fp_fusion": name not in EXACT_KERNELS, **LAUNCH_OPTIONS.get(name, {})}


def _launch(name: str, start: int, n: int, lanes: int) -> Callable[..., Any]:
    """Kernel ``name`` bound to its grid over elements [start, start + n) (tiles of
    ``lanes`` lanes), its tile width and its ``compile_options``: call it with the
    kernel's own arguments."""
    grid = _grid(start, n, lanes)
    return functools.partial(_kernels()[name][grid], BLOCKS=TILE_BLOCKS, **compile_options(name))


def fill(
    out: torch.Tensor, start: int, key: tuple[int, int], kind: str, table: torch.Tensor
) -> None:
    """out[0:n] <- the draws of elements [start, start + n) (float32, contiguous)."""
    lanes = 4 if kind == "uniform" else 8
    _launch("fill", start, out.numel(), lanes)(
        out,
        table,
        start,
        out.numel(),
        key[0],
        key[1],
        KIND=KINDS[kind],
    )


def perturb(
    out: torch.Tensor,
    theta: torch.Tensor,
    scale: float,
    key: tuple[int, int],
    kind: str,
    table: torch.Tensor,
    start: int = 0,
) -> None:
    """out[0:n] <- theta[0:n] + scale * z of elements [start, start + n) (one pass, z never
    stored). A 16-bit theta (``out`` of its dtype) rounds as ``noise.add_scaled`` does."""
    n = theta.numel()
    scale = as_operand(scale, theta.dtype)
    _launch("perturb", start, n, 8)(
        out,
        theta,
        table,
        start,
        n,
        key[0],
        key[1],
        scale,
        KIND=KINDS[kind],
    )


def packed_terms(
    keys: Sequence[tuple[int, int]], alphas: Sequence[float], device: torch.device
) -> torch.Tensor:
    """A launch's terms as one [K, 3] int32 table on ``device``: each key's two 32-bit
    words and its alpha's float32 bits (alpha rounded to float32, as torch rounds a
    scalar for a float32 op). One copy, from pinned memory and without a host sync on
    CUDA (the caching host allocator keeps the page until the copy has run). No terms
    still make one (unused) row: a kernel is refused a pointer to no memory."""
    rows = max(len(keys), 1)
    host = torch.zeros((rows, 3), dtype=torch.int32, pin_memory=device.type == "cuda")
    words = torch.tensor(keys, dtype=torch.int64).reshape(-1, 2)
    host[: len(keys), :2] = words.to(torch.uint32).view(torch.int32)
    host[: len(keys), 2] = torch.tensor(alphas, dtype=torch.float32).view(torch.int32)
    return host.to(device, non_blocking=True)


LOW_BIT_MASTERS = (torch.float16, torch.bfloat16)


def as_operand(alpha: float, dtype: torch.dtype) -> float:
    """``alpha`` as an op on a ``dtype`` master takes it: rounded to a 16-bit dtype (as
    torch's vectorised CPU ``add`` rounds it; its sum is then formed in float32), kept for
    float32 and wider (the kernel rounds it to float32)."""
    if dtype not in LOW_BIT_MASTERS:
        return alpha
    return torch.full((), alpha, dtype=dtype).item()


def update(
    theta: torch.Tensor,
    decay_end: int,
    shrink: float,
    keys: Sequence[tuple[int, int]],
    alphas: Sequence[float],
    kind: str,
    table: torch.Tensor,
    start: int = 0,
) -> None:
    """theta <- theta * shrink on [0, decay_end), then + sum_j alpha_j z_j: one launch,
    one read and one write of theta for all the terms. ``theta`` holds bucket elements
    [start, start + n); ``decay_end`` counts from the bucket's start. One term (ZO-SGD's
    step) takes ``update_one_kernel``, shaped as the perturbation (the H100 ran the
    tiled kernel's one-term update at 0.68x the legacy path's speed, where the
    perturbation, the same bytes, ran at 1.07x); more take the tiled kernel, their keys
    and alphas in a tiny table on the device. A 16-bit theta is rounded to its dtype after
    the decay and after each term, as ``NoiseSource.apply_terms``'s chunked path rounds it."""
    n = theta.numel()
    if len(keys) == 1:
        _launch("update_one", start, n, 8)(
            theta,
            table,
            start,
            n,
            decay_end,
            shrink,
            keys[0][0],
            keys[0][1],
            as_operand(alphas[0], theta.dtype),
            KIND=KINDS[kind],
        )
        return
    update_table(theta, decay_end, shrink, keys, alphas, kind, table, start)


def update_table(
    theta: torch.Tensor,
    decay_end: int,
    shrink: float,
    keys: Sequence[tuple[int, int]],
    alphas: Sequence[float],
    kind: str,
    table: torch.Tensor,
    start: int = 0,
) -> None:
    """``update`` through the tiled kernel and its table of terms, whatever their number
    (what ``update`` launches for other than one term; benchmarks/noise.py times its
    one-term launch beside ``update_one_kernel``)."""
    n = theta.numel()
    alphas = [as_operand(a, theta.dtype) for a in alphas]
    _launch("update", start, n, 8)(
        theta,
        table,
        packed_terms(keys, alphas, theta.device),
        len(keys),
        start,
        n,
        decay_end,
        shrink,
        KIND=KINDS[kind],
    )


def rebuild_perturb(
    out: torch.Tensor,
    rest: torch.Tensor,
    decay_end: int,
    shrink: float,
    keys: Sequence[tuple[int, int]],
    alphas: Sequence[float],
    key: tuple[int, int],
    scale: float,
    kind: str,
    table: torch.Tensor,
    start: int = 0,
) -> None:
    """out[0:n] <- (rest[0:n] upcast, then ``update``'s decay and terms) + scale * z_key: a
    block's pass scratch from its 16-bit values at rest, one launch; ``rest`` holds the
    block's elements [start, start + n) (a module's, or the whole block at 0) and takes
    their z. At most one term (ZO-SGD's) takes ``rebuild_perturb_one_kernel``, lane by lane
    as ``update_one``."""
    n = rest.numel()
    if len(keys) <= 1:
        uk0, uk1, alpha = _at_most_one(keys, alphas)
        _launch("rebuild_perturb_one", start, n, 8)(
            out,
            rest,
            table,
            start,
            n,
            decay_end,
            shrink,
            uk0,
            uk1,
            alpha,
            key[0],
            key[1],
            scale,
            KIND=KINDS[kind],
            TERM=len(keys),
            PART=int(start != 0),
        )
        return
    rebuild_perturb_table(
        out, rest, decay_end, shrink, keys, alphas, key, scale, kind, table, start
    )


def _at_most_one(
    keys: Sequence[tuple[int, int]], alphas: Sequence[float]
) -> tuple[int, int, float]:
    """The one term's key words and alpha, as a one-term kernel takes them (zeros, unused,
    where there is none)."""
    return (*keys[0], alphas[0]) if keys else (0, 0, 0.0)


def rebuild_perturb_table(
    out: torch.Tensor,
    rest: torch.Tensor,
    decay_end: int,
    shrink: float,
    keys: Sequence[tuple[int, int]],
    alphas: Sequence[float],
    key: tuple[int, int],
    scale: float,
    kind: str,
    table: torch.Tensor,
    start: int = 0,
) -> None:
    """``rebuild_perturb`` through the tiled kernel and its table of terms, whatever their
    number (benchmarks/noise.py times it beside the one-term kernel)."""
    n = rest.numel()
    _launch("rebuild_perturb", start, n, 8)(
        out,
        rest,
        table,
        packed_terms(keys, alphas, rest.device),
        len(keys),
        start,
        n,
        decay_end,
        shrink,
        key[0],
        key[1],
        scale,
        KIND=KINDS[kind],
    )


def rebuild_round(
    rest: torch.Tensor,
    start: int,
    decay_end: int,
    shrink: float,
    keys: Sequence[tuple[int, int]],
    alphas: Sequence[float],
    round_key: tuple[int, int],
    kind: str,
    table: torch.Tensor,
) -> None:
    """rest[0:n] (bucket elements [start, start + n) of a bf16 or fp16 block at rest) <-
    itself upcast, then ``update``'s decay and terms, rounded stochastically back with the
    uniforms ``round_stochastic`` draws for ``round_key``: one launch, in place. At most
    one term (ZO-SGD's) takes ``rebuild_round_one_kernel``, lane by lane."""
    if len(keys) > 1:
        rebuild_round_table(rest, start, decay_end, shrink, keys, alphas, round_key, kind, table)
        return
    n = rest.numel()
    dst, (mantissa, bias, limit) = _round_target(rest)
    uk0, uk1, alpha = _at_most_one(keys, alphas)
    _launch("rebuild_round_one", start, n, 8)(
        dst,
        rest,
        table,
        start,
        n,
        decay_end,
        shrink,
        uk0,
        uk1,
        alpha,
        round_key[0],
        round_key[1],
        KIND=KINDS[kind],
        TERM=len(keys),
        MANTISSA=mantissa,
        BIAS=bias,
        LIMIT=limit,
    )


def _round_target(rest: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, float]]:
    """What a round kernel writes for a 16-bit block (bf16 itself, fp16 as its integer
    bits) and the format's mantissa bits, exponent bias and largest value."""
    if rest.dtype == torch.bfloat16:
        return rest, (7, 127, 0.0)  # bf16's rule takes no limit
    mantissa, bias, limit, as_int = LOW_BIT[rest.dtype]
    return rest.view(as_int), (mantissa, bias, limit)


def rebuild_round_table(
    rest: torch.Tensor,
    start: int,
    decay_end: int,
    shrink: float,
    keys: Sequence[tuple[int, int]],
    alphas: Sequence[float],
    round_key: tuple[int, int],
    kind: str,
    table: torch.Tensor,
) -> None:
    """``rebuild_round`` through the tiled kernel and its table of terms, whatever their
    number (benchmarks/noise.py times it beside the one-term kernel)."""
    n = rest.numel()
    dst, (mantissa, bias, limit) = _round_target(rest)
    _launch("rebuild_round", start, n, 8)(
        dst,
        rest,
        table,
        packed_terms(keys, alphas, rest.device),
        len(keys),
        start,
        n,
        decay_end,
        shrink,
        round_key[0],
        round_key[1],
        KIND=KINDS[kind],
        MANTISSA=mantissa,
        BIAS=bias,
        LIMIT=limit,
    )


def momentum(
    theta: torch.Tensor,
    m: torch.Tensor,
    decay_end: int,
    shrink: float,
    keys: Sequence[tuple[int, int]],
    alphas: Sequence[float],
    beta1: float,
    lr: float,
    kind: str,
    table: torch.Tensor,
) -> None:
    """Stored momentum in one launch: m <- beta1 m + sum_j alpha_j z_j, theta <- theta *
    shrink on [0, decay_end), then - lr m (``MomentUpdater``'s arithmetic). One query
    takes ``momentum_one_kernel`` (lane by lane, as ``update`` takes ``update_one``: every
    tiled kernel ran at 5.5-9.8e10 elements/s on the H100 whatever its bytes, the
    lane-by-lane perturbation at 1.4-1.6e11); more, the tiled kernel."""
    n = theta.numel()
    if len(keys) == 1:
        _launch("momentum_one", 0, n, 8)(
            theta,
            m,
            table,
            n,
            decay_end,
            shrink,
            keys[0][0],
            keys[0][1],
            alphas[0],
            beta1,
            -lr,
            KIND=KINDS[kind],
        )
        return
    momentum_table(theta, m, decay_end, shrink, keys, alphas, beta1, lr, kind, table)


def momentum_table(
    theta: torch.Tensor,
    m: torch.Tensor,
    decay_end: int,
    shrink: float,
    keys: Sequence[tuple[int, int]],
    alphas: Sequence[float],
    beta1: float,
    lr: float,
    kind: str,
    table: torch.Tensor,
) -> None:
    """``momentum`` through the tiled kernel and its table of terms, whatever their number
    (benchmarks/noise.py times its one-query launch beside ``momentum_one_kernel``)."""
    n = theta.numel()
    _launch("momentum", 0, n, 8)(
        theta,
        m,
        table,
        packed_terms(keys, alphas, theta.device),
        len(keys),
        0,
        n,
        decay_end,
        shrink,
        beta1,
        -lr,
        KIND=KINDS[kind],
    )


def adam(
    theta: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    decay_end: int,
    shrink: float,
    keys: Sequence[tuple[int, int]],
    alphas: Sequence[float],
    coefficients: tuple[float, float, float, float],
    kind: str,
    table: torch.Tensor,
) -> None:
    """MeZO-Adam in one launch, ghat = sum_j alpha_j z_j; ``coefficients`` are
    (beta1, beta2, eps, step_size) (``MomentUpdater``'s arithmetic). The tiled kernel
    whatever the number of queries: lane by lane, Adam's one query took 72 registers a
    thread on sm_90 (Rademacher), too many for half an SM's warps."""
    beta1, beta2, eps, step_size = coefficients
    n = theta.numel()
    _launch("adam", 0, n, 8)(
        theta,
        m,
        v,
        table,
        packed_terms(keys, alphas, theta.device),
        len(keys),
        0,
        n,
        decay_end,
        shrink,
        beta1,
        beta2,
        1.0 - beta1,
        1.0 - beta2,
        eps,
        -step_size,
        KIND=KINDS[kind],
    )


def round_bf16(dst: torch.Tensor, src: torch.Tensor, start: int, key: tuple[int, int]) -> None:
    """dst[0:n] (bfloat16) <- src[0:n] (float32) rounded stochastically with the uniforms of
    bucket elements [start, start + n): one read of src, one write of dst."""
    n = src.numel()
    _launch("round_bf16", start, n, 4)(
        dst,
        src,
        start,
        n,
        key[0],
        key[1],
    )


# low-bit formats: (mantissa bits, exponent bias, largest finite value, integer view)
LOW_BIT = {
    torch.float16: (10, 15, 65504.0, torch.int16),
    torch.float8_e4m3fn: (3, 7, 448.0, torch.int8),
}


def rounds_into(dtype: torch.dtype) -> bool:
    """Whether ``round_stochastic`` has a kernel for ``dtype``."""
    return dtype == torch.bfloat16 or dtype in LOW_BIT


def round_stochastic(
    dst: torch.Tensor, src: torch.Tensor, start: int, key: tuple[int, int]
) -> None:
    """dst[0:n] (bfloat16, float16 or float8 e4m3fn) <- src[0:n] (float32) rounded
    stochastically with the uniforms of bucket elements [start, start + n), in one pass."""
    if dst.dtype == torch.bfloat16:
        round_bf16(dst, src, start, key)
        return
    mantissa, bias, limit, as_int = LOW_BIT[dst.dtype]
    n = src.numel()
    _launch("round_low_bit", start, n, 4)(
        dst.view(as_int),
        src,
        start,
        n,
        key[0],
        key[1],
        MANTISSA=mantissa,
        BIAS=bias,
        LIMIT=limit,
    )
