"""Seeds as pure functions of coordinates: splitmix64 chained over them."""

from __future__ import annotations

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
