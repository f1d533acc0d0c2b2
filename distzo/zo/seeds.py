"""Seeds as pure functions of coordinates: splitmix64 chained over them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

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


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """``_splitmix64`` of every element of a uint64 array (numpy's uint64 arithmetic wraps
    modulo 2**64, as the masks above do)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def noise_seeds(
    run_seed: int,
    steps: Sequence[int] | np.ndarray,
    block_ids: Sequence[int] | np.ndarray,
    chunk: int,
    query: int = 0,
) -> np.ndarray:
    """``noise_seed`` of every (step, block): uint64 ``[steps, blocks]``, by array ops.
    Many steps' seeds (a runtime's table of keys) at once: the same chain, each link over
    all of them, where a Python loop took seconds for 100,000 steps."""

    def coordinates(values: Sequence[int] | np.ndarray) -> np.ndarray:
        # a negative one as ``part & _MASK64`` takes it: its two's complement
        return np.asarray(values, dtype=np.int64).astype(np.uint64)

    h = _splitmix64_array(np.full((1, 1), run_seed & _MASK64, dtype=np.uint64))
    h = _splitmix64_array(h ^ coordinates(steps)[:, None])
    h = _splitmix64_array(h ^ coordinates(block_ids)[None, :])
    for part in (chunk,) + ((query,) if query else ()):
        h = _splitmix64_array(h ^ np.uint64(part & _MASK64))
    return h >> np.uint64(1)
