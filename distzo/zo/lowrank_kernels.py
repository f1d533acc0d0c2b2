"""The Triton kernels of ``distzo.zo.triton_lowrank`` (imported only where Triton is).

Each program takes ``BLOCK`` consecutive elements of a run of one matrix's rows, ``theta``
and its out read and written once. The matrix's z there, ``sum_k U[i,k] V[j,k]``, is
formed in registers from the U rows of the run (drawn beforehand into a small buffer) and
the matrix's V: as ``LowRankNoise._rows_into`` forms it, a product for k = 0, then one
product and one add per further k, each rounded to the source's dtype (``ZDT``): compiled
without fp fusion, so no product and sum fuse. The perturbation and the update then take
``noise.add_scaled``'s one fused multiply-add (``tl.fma``) and, for a 16-bit master, its
rounding rule, as ``triton_kernels``' Gaussian kernels do.

Offsets: a launch's pointers start at its run's first element, so every index is an
offset below ``n`` (int64); the run's first element's place in its first row (``first``)
and each program's row and column are int64 scalars, and only a program's columns past its
first (fewer than ``BLOCK`` rows' worth) are int32.
"""

import triton
import triton.language as tl

from distzo.zo.triton_kernels import nearest

# changed every launch: typed by annotation and never specialized (one compile per rank,
# dtypes and pointer alignment)
SCALARS = ["n", "first", "cols", "scale", "alpha", "decay_left", "shrink"]


@triton.jit
def lowrank_z(u_ptr, v_ptr, n, first, cols, RANK: tl.constexpr, BLOCK: tl.constexpr):
    """This program's elements of the run: their offsets, mask, and z (float32 values of
    the source's dtype), row i of the run taking U row i of ``u_ptr``."""
    ZDT: tl.constexpr = u_ptr.dtype.element_ty
    at = tl.program_id(0).to(tl.int64) * BLOCK
    offsets = at + tl.arange(0, BLOCK)
    inside = offsets < n
    place = first + at  # the program's first element, from the run's first row's start
    row = place // cols
    col = (place - row * cols).to(tl.int32) + tl.arange(0, BLOCK)
    width = cols.to(tl.int32)
    rows = col // width
    col = col - rows * width
    u_at = (row + rows) * RANK
    v_at = col.to(tl.int64) * RANK
    u = tl.load(u_ptr + u_at, mask=inside, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + v_at, mask=inside, other=0.0).to(tl.float32)
    z = nearest(u * v, ZDT)
    for k in tl.static_range(1, RANK):
        u = tl.load(u_ptr + u_at + k, mask=inside, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + v_at + k, mask=inside, other=0.0).to(tl.float32)
        z = nearest(z + nearest(u * v, ZDT), ZDT)
    return offsets, inside, z


@triton.jit(do_not_specialize=SCALARS)
def lowrank_perturb_kernel(
    out_ptr,
    theta_ptr,
    u_ptr,
    v_ptr,
    n: tl.int64,
    first: tl.int64,
    cols: tl.int64,
    scale: tl.float32,
    RANK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out <- theta + scale * z: one fused multiply-add, rounded to a 16-bit theta's dtype
    (``scale`` the wrapper's, in it), then to out's."""
    DT: tl.constexpr = theta_ptr.dtype.element_ty
    offsets, inside, z = lowrank_z(u_ptr, v_ptr, n, first, cols, RANK, BLOCK)
    theta = tl.load(theta_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    out = nearest(nearest(tl.fma(z, scale, theta), DT), out_ptr.dtype.element_ty)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=SCALARS)
def lowrank_update_kernel(
    theta_ptr,
    u_ptr,
    v_ptr,
    n: tl.int64,
    first: tl.int64,
    cols: tl.int64,
    decay_left: tl.int64,
    shrink: tl.float32,
    alpha: tl.float32,
    RANK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """theta <- theta * shrink on the run's first ``decay_left`` elements, then + alpha * z
    (one fused multiply-add), each rounded to a 16-bit theta's dtype."""
    DT: tl.constexpr = theta_ptr.dtype.element_ty
    offsets, inside, z = lowrank_z(u_ptr, v_ptr, n, first, cols, RANK, BLOCK)
    theta = tl.load(theta_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    theta = tl.where(offsets < decay_left, nearest(theta * shrink, DT), theta)
    theta = nearest(tl.fma(z, alpha, theta), DT)
    tl.store(theta_ptr + offsets, theta.to(DT), mask=inside)
