"""LOZO's low-rank noise on CUDA: its perturbation and its update of a matrix's elements as
one Triton kernel each (``lowrank_kernels``), z = U V^T formed in registers.

The generic path (``NoiseSource``'s chunks) writes a piece of z, a product buffer per
further rank and then reads them back for the add: several passes over memory per
element. Here a launch covers a run of rows whose U is in the source's U buffer
(``LowRankNoise`` draws it, and the matrix's V, with the same keyed draws as the generic
path) and reads theta once and writes it (or the perturbed copy) once. Same operations in
the same order on every element: the generic path's bits (``tests/helpers/
triton_lowrank_probe.py`` holds them to it under the interpreter).

Import this module only where Triton is installed (``triton_noise.available()``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from distzo.zo.triton_noise import as_operand

# Elements per program: 4 warps, 4 elements a thread (at rank 4, 40 registers a thread
# on sm_90: 48 warps per SM; 1,024 took 79, 24 warps; tests/helpers/triton_compile_probe.py)
BLOCK = 512
KERNEL_NAMES = ("lowrank_perturb", "lowrank_update")
# Both form z by separate multiplies and adds (the generic path's torch ops) and spell out
# their one fused multiply-add: compiled without fp fusion.
COMPILE_OPTIONS: dict[str, Any] = {"enable_fp_fusion": False}
# the dtypes of masters, outs and factors the kernels take
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _kernels() -> dict[str, Any]:
    from distzo.zo import lowrank_kernels
    from distzo.zo.triton_noise import _kernels as noise_kernels

    noise_kernels()  # a read-only home's private kernel cache, as the Gaussian kernels'
    return {name: getattr(lowrank_kernels, f"{name}_kernel") for name in KERNEL_NAMES}


def _launch(name: str, n: int, rank: int) -> Any:
    grid = ((n + BLOCK - 1) // BLOCK,)
    return functools.partial(_kernels()[name][grid], RANK=rank, BLOCK=BLOCK, **COMPILE_OPTIONS)


def perturb(
    out: torch.Tensor,
    theta: torch.Tensor,
    u: torch.Tensor,
    v: torch.Tensor,
    first: int,
    scale: float,
) -> None:
    """out <- theta + scale * z over a run of a matrix's elements: its first element is
    ``first`` elements into the row that ``u``'s first row (rank wide) belongs to; ``v``
    is the matrix's V (cols x rank). ``noise.add_scaled``'s rounding."""
    n, (cols, rank) = theta.numel(), v.shape
    _launch("lowrank_perturb", n, rank)(
        out, theta, u, v, n, first, cols, as_operand(scale, theta.dtype)
    )


def update(
    theta: torch.Tensor,
    u: torch.Tensor,
    v: torch.Tensor,
    first: int,
    decay_left: int,
    shrink: float,
    alpha: float,
) -> None:
    """theta <- theta * shrink on its first ``decay_left`` elements, then + alpha * z, over
    a run of a matrix's elements laid out as ``perturb``'s: ``NoiseSource.apply_terms``'s
    arithmetic for one term."""
    n, (cols, rank) = theta.numel(), v.shape
    decay_left = min(max(decay_left, 0), n)
    _launch("lowrank_update", n, rank)(
        theta, u, v, n, first, cols, decay_left, shrink, as_operand(alpha, theta.dtype)
    )
