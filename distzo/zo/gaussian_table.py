"""The transform from 16 random bits to a Gaussian z: a table, so it is exact everywhere.

Box-Muller's ``log`` and ``cos`` differ by an ulp between math libraries and devices;
over 1e11 elements a step that is many different z. A table lookup is the same value
on every device. ``TABLE[i]`` is the Gaussian quantile at ``(i + 1/2) / 65536``, the
upper half the mirror of the lower (so the mean is exactly 0), scaled so that the
variance of the 65,536 float32 values is 1 (it is 1 - 5.7e-10). The tails stop at
+-4.325 (the table's extreme quantiles): kurtosis 2.99925 instead of 3. The quantiles
come from Python's ``statistics.NormalDist`` in float64 and are rounded to float32; a
SHA-256 of the result pins the table, so a platform whose math library would round a
value differently refuses to run rather than draw another z.
"""

from __future__ import annotations

import functools
import hashlib
import math
import statistics

import torch

TABLE_SIZE = 1 << 16
TABLE_SHA256 = "8babbcaf96568f10165a1eab530c0e5c92d04de96761b6dbb3dadfa94baba37f"


@functools.cache
def gaussian_table() -> torch.Tensor:
    """The float32 table on the host (build once, copy to each device)."""
    normal = statistics.NormalDist()
    half = [normal.inv_cdf((i + 0.5) / TABLE_SIZE) for i in range(TABLE_SIZE // 2)]
    values = half + [-x for x in reversed(half)]
    scale = 1.0 / math.sqrt(math.fsum(x * x for x in values) / TABLE_SIZE)
    table = torch.tensor([x * scale for x in values], dtype=torch.float32)
    digest = hashlib.sha256(table.numpy().tobytes()).hexdigest()
    if digest != TABLE_SHA256:
        raise RuntimeError(
            "this platform's inverse normal CDF rounds differently: its Gaussian noise table "
            "would not match other machines'; use --noise rademacher here"
        )
    return table
