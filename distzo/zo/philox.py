"""Philox4x32-10 keyed by element: the bits behind every z, the same on every device.

Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11;
Random123) maps a 128-bit counter and a 64-bit key to 128 random bits with 10 rounds
of 32x32->64-bit multiplies, xors and key additions: exact integer arithmetic, so its
output is the same on a CPU, any GPU model or a MIG slice, whatever the thread grid.

**Element -> bits.** A bucket is cut into tiles; a tile is ``TILE_BLOCKS`` (512)
consecutive Philox counters, each giving ``lanes`` lanes (8 of 16 bits for z, 4 of 32
bits for uniform draws). Element ``e`` of a bucket takes::

    tile t = e // (512 * lanes),  r = e % (512 * lanes)
    lane j = r // 512,            counter = t * 512 + r % 512

so the elements a lane covers are contiguous (a GPU kernel loads them coalesced) and
every element's bits are a pure function of ``(key, e)``: any chunking, slicing or
order draws the same values. The counter is ``(counter low 32, counter high 32, 0,
0)`` and the key two 32-bit words from ``noise_key``.

Three implementations of the same function: ``reference_lanes`` (Python integers, the
definition, slow), ``torch_lanes`` (torch int64 ops on any device; a 32x32 product is
split at 16 bits so no intermediate reaches 2^63: exact, no overflow), and the fast
paths in ``distzo.zo.fast_noise`` (C on CPU, Triton on CUDA). Tests hold them equal.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from distzo.zo.seeds import noise_seed, noise_seeds

M0, M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
ROUNDS = 10
TILE_BLOCKS = 512  # Philox counters per tile
LANES16, LANES32 = 8, 4  # lanes per counter: 16-bit (z), 32-bit (uniform draws)
_MASK32 = 0xFFFFFFFF

STREAM_NOISE, STREAM_ROUNDING = 0, 1  # what a key draws: the perturbation z, or rounding's uniforms
# the factors of the low-rank kind (``distzo.zo.lowrank``): U per step, V per window of steps
STREAM_LOWRANK_U, STREAM_LOWRANK_V = 2, 3


def noise_key(run_seed: int, step: int, block_id: int, query: int, stream: int) -> tuple[int, int]:
    """The Philox key of one (step, block, query) draw: two 32-bit words."""
    # 63 bits, splitmix64-chained coordinates
    h = noise_seed(run_seed, step, block_id, stream, query)
    return h & _MASK32, h >> 32


def noise_keys(
    run_seed: int,
    steps: Sequence[int] | np.ndarray,
    block_ids: Sequence[int] | np.ndarray,
    query: int,
    stream: int,
) -> np.ndarray:
    """``noise_key`` of every (step, block): int64 ``[steps, blocks, 2]`` (the two words)."""
    h = noise_seeds(run_seed, steps, block_ids, stream, query)
    return np.stack([h & np.uint64(_MASK32), h >> np.uint64(32)], axis=-1).astype(np.int64)


def counters_and_lanes(start: int, stop: int, lanes: int) -> tuple[range, list[tuple[int, int]]]:
    """Elements [start, stop) as (counter, lane) pairs, by the tile layout above."""
    tile = TILE_BLOCKS * lanes
    pairs = []
    for e in range(start, stop):
        t, r = divmod(e, tile)
        pairs.append((t * TILE_BLOCKS + r % TILE_BLOCKS, r // TILE_BLOCKS))
    return range(start, stop), pairs


def philox4x32(
    counter: tuple[int, int, int, int], key: tuple[int, int]
) -> tuple[int, int, int, int]:
    """The reference Philox4x32-10 block function on Python integers."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(ROUNDS):
        p0, p1 = M0 * c0, M1 * c2
        c0, c1, c2, c3 = (
            ((p1 >> 32) ^ c1 ^ k0) & _MASK32,
            p1 & _MASK32,
            ((p0 >> 32) ^ c3 ^ k1) & _MASK32,
            p0 & _MASK32,
        )
        k0, k1 = (k0 + W0) & _MASK32, (k1 + W1) & _MASK32
    return c0, c1, c2, c3


def lane_bits(words: tuple[int, int, int, int], lane: int, lanes: int) -> int:
    """Lane ``lane`` of a counter's 128 bits: 16-bit lanes take words in order, low half first."""
    if lanes == LANES16:
        return (words[lane // 2] >> (16 * (lane % 2))) & 0xFFFF
    return words[lane]


def reference_lanes(key: tuple[int, int], start: int, stop: int, lanes: int) -> list[int]:
    """Each element's lane bits, one Philox call per element: the definition (slow)."""
    out = []
    for _, (counter, lane) in zip(*counters_and_lanes(start, stop, lanes)):
        out.append(
            lane_bits(philox4x32((counter & _MASK32, counter >> 32, 0, 0), key), lane, lanes)
        )
    return out


def _shr(a: torch.Tensor, bits: int) -> torch.Tensor:
    """``a >> bits`` for a non-negative int64 tensor, as a floor division: the shift
    operators are not in the core ATen opset that exported programs (ExecuTorch) run."""
    return torch.div(a, 1 << bits, rounding_mode="floor")


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * m for 32-bit ``a`` (int64 tensor) and constant m,
    with every intermediate below 2^49: exact in int64 on every device."""
    high_m, low_m = m >> 16, m & 0xFFFF
    t_low, t_high = a * low_m, a * high_m  # each < 2^48
    s = t_low + (t_high & 0xFFFF) * (1 << 16)  # < 2^49
    return _shr(t_high, 16) + _shr(s, 32), s & _MASK32


def torch_philox(c0: torch.Tensor, c1: torch.Tensor, key: tuple[int, int]):
    """Philox4x32-10 of counters (c0, c1, 0, 0) as int64 tensors of 32-bit values."""
    c2, c3 = torch.zeros_like(c0), torch.zeros_like(c0)
    k0, k1 = key
    for _ in range(ROUNDS):
        hi0, lo0 = _mulhilo(c0, M0)
        hi1, lo1 = _mulhilo(c2, M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + W0) & _MASK32, (k1 + W1) & _MASK32
    return c0, c1, c2, c3


def torch_lanes(
    key: tuple, start: int, stop: int, lanes: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Each element's lane bits for elements [start, stop) as an int64 tensor on ``device``
    (whole tiles are computed, then cut to the range). ``key`` is two ints, or two int64
    tensors of one shape ``[*keys, 1]`` (many keys drawn by one set of ops, as an exported
    program wants): the result is then ``[*keys, stop - start]``, one row per key."""
    tile = TILE_BLOCKS * lanes
    first, last = start // tile, (stop + tile - 1) // tile
    counters = torch.arange(
        first * TILE_BLOCKS, last * TILE_BLOCKS, dtype=torch.int64, device=device
    )
    words = torch.stack(
        torch.broadcast_tensors(*torch_philox(counters & _MASK32, _shr(counters, 32), key))
    )
    if lanes == LANES16:  # [4, *keys, counters] -> [8, ...]: lane j = word j//2, half j%2
        words = torch.stack((words & 0xFFFF, _shr(words, 16)), dim=1).flatten(0, 1)
    # [lanes, *keys, tiles, 512] -> per tile, lane-major: element order within a tile
    bits = words.unflatten(-1, (last - first, TILE_BLOCKS)).movedim(0, -2).flatten(-3)
    offset = first * tile
    return bits[..., start - offset : stop - offset]
