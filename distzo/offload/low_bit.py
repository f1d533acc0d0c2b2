"""Low-bit transfer formats and the rounding back into them (ZO2's AMP mode).

Blocks may rest in host memory and cross the link as bf16/fp16/fp8 while the device
keeps an fp32 master for the update. A ZO update is tiny (lr * g * z), usually far
below half an ulp of a bf16 weight: round-to-nearest would drop it every time, so the
way back rounds stochastically, up or down with probabilities that make the expected
result the exact value (unbiased).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # takes a noise source, never imports the zo package
    from distzo.zo import NoiseSource

TRANSFER_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,
}
COMPUTE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}

_INT_VIEW = {1: torch.int8, 2: torch.int16}


def _order_key(x: torch.Tensor) -> torch.Tensor:
    """Map low-bit floats to int32 keys that are consecutive for neighbouring values
    (sign-magnitude bits -> two's-complement order; +0 and -0 both map to 0)."""
    bits = x.view(_INT_VIEW[x.element_size()]).to(torch.int32)
    sign_bit = 1 << (8 * x.element_size() - 1)
    magnitude = bits & (sign_bit - 1)
    return torch.where(bits < 0, -magnitude, magnitude)


def _from_key(key: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    sign_bit = 1 << (8 * size - 1)
    magnitude = key.abs()
    bits = torch.where(key < 0, magnitude - sign_bit, magnitude)  # sign bit set, as a signed int
    return bits.to(_INT_VIEW[size]).view(dtype)


HOST_ROUND_CHUNK = 1 << 22  # elements the host clamps at a time: a 16 MB float32 scratch


def round_nearest_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Round-to-nearest into ``dst``'s format, saturating instead of overflowing. On the
    host a piece at a time: the clamp's scratch stays small enough for the allocator to
    reuse, where a whole block's (1.3 GB at OPT-13B's width) is fresh pages every time."""
    limit = torch.finfo(dst.dtype).max
    if src.device.type != "cpu" or src.dim() != 1 or src.numel() <= HOST_ROUND_CHUNK:
        dst.copy_(src.clamp(-limit, limit))
        return
    for lo in range(0, src.numel(), HOST_ROUND_CHUNK):
        hi = lo + HOST_ROUND_CHUNK
        dst[lo:hi].copy_(src[lo:hi].clamp(-limit, limit))


def round_stochastic_(dst: torch.Tensor, src: torch.Tensor, uniform: torch.Tensor) -> None:
    """Round ``src`` into ``dst``'s format, to the neighbour above with probability
    (src - below) / (above - below), driven by ``uniform`` draws in [0, 1).

    Exactly representable values stay as they are; values beyond the format's range
    saturate. Works for any IEEE-like low-bit format (bf16, fp16, fp8 e4m3/e5m2). A float64
    ``src`` (an fp64 master) is rounded from its own value: through float32 the part below
    half a float32 ulp would be rounded to nearest first, lost every time.
    """
    limit = torch.finfo(dst.dtype).max
    x = (src if src.dtype == torch.float64 else src.float()).clamp(-limit, limit)
    if dst.dtype == torch.bfloat16 and x.dtype == torch.float32:
        _round_stochastic_bf16_(dst, x, uniform)
        return
    # x's format's nearest (float64 may take a second rounding, yet lands on a neighbour:
    # the rule below holds for either)
    nearest = x.to(dst.dtype)
    nearest_value = nearest.to(x.dtype)
    direction = torch.sign(x - nearest_value).to(torch.int32)  # towards the other neighbour
    other = _from_key(_order_key(nearest) + direction, dst.dtype)
    gap = (other.to(x.dtype) - nearest_value).abs()
    p_other = torch.where(direction == 0, torch.zeros_like(x), (x - nearest_value).abs() / gap)
    dst.copy_(torch.where(uniform < p_other, other, nearest))


def _round_stochastic_bf16_(dst: torch.Tensor, x: torch.Tensor, uniform: torch.Tensor) -> None:
    """bf16 is fp32 with the low 16 bits cut: adding 16 random bits to the bit pattern
    and cutting them carries into the kept bits with probability equal to the cut
    fraction (on the magnitude, so for either sign), which is exactly stochastic rounding."""
    bits = (uniform * 65536.0).to(torch.int32)  # uniform in [0, 2^16)
    # in place from here: a chunk's fresh temporaries cost page faults, not arithmetic
    bits.add_(x.view(torch.int32)).bitwise_and_(-65536)  # clear the low 16 bits (0xFFFF0000)
    limit = torch.finfo(torch.bfloat16).max
    dst.copy_(bits.view(torch.float32).clamp_(-limit, limit))  # exact: the low bits are zero


def round_keyed_(
    dst: torch.Tensor,
    src: torch.Tensor,
    noise: NoiseSource,
    lo: int,
    total: int,
    step: int,
    stream: int,
) -> None:
    """Stochastic rounding of bucket elements [lo, lo + n) of a ``total``-element bucket,
    its uniform draws keyed by (step, stream) and each element's place: one fused kernel
    where ``noise`` has one (bf16, fp16, fp8 on CUDA), else chunk by chunk through
    ``round_stochastic_``."""
    if noise.round_into(dst, src, lo, step, stream):
        return
    for a, b, u in noise.chunks(lo, lo + src.numel(), total, step, stream):
        round_stochastic_(dst[a - lo : b - lo], src[a - lo : b - lo], u)
