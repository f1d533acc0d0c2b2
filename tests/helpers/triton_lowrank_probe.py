"""Run by tests/unit/test_lowrank.py (``python -m``) under TRITON_INTERPRET=1: LOZO's
low-rank kernels (``triton_lowrank``) on the CPU against ``LowRankNoise``'s generic path,
bit for bit, on ranges that cut rows across runs and chunks, ranks 1, 2 and 4, 1-D entries
and padding between matrices, float32 and 16-bit masters and factors, and bucket offsets
past 2^31 and 2^32. Exits non-zero (an assertion) on any difference."""

import os

import torch

from distzo.zo import triton_lowrank, triton_noise
from distzo.zo.lowrank import LowRankNoise
from tests.helpers.lowrank_layouts import LAYOUT, Entry, Layout

assert os.environ.get("TRITON_INTERPRET") == "1", "run me with TRITON_INTERPRET=1"
assert triton_noise.available()
CPU = torch.device("cpu")


class Launches:
    """Counts the launches of each low-rank kernel (``kernel[grid](...)``)."""

    def __init__(self):
        self.kernels, self.count = (
            dict(triton_lowrank._kernels()),
            dict.fromkeys(triton_lowrank.KERNEL_NAMES, 0),
        )
        for name, kernel in self.kernels.items():
            triton_lowrank._kernels()[name] = self.counted(name, kernel)

    def counted(self, name, kernel):
        probe = self

        class Counted:
            def __getitem__(self, grid):
                probe.count[name] += 1
                return kernel[grid]

        return Counted()


launches = Launches()


def pair(chunk, dtype, rank, layouts=(LAYOUT,)):
    """(the kernels' source, the generic path's), alike but for the path."""
    fused = LowRankNoise(3, chunk, CPU, dtype, list(layouts), rank, 5)
    fused._triton = True
    generic = LowRankNoise(3, chunk, CPU, dtype, list(layouts), rank, 5)
    # U and V drawn by the generic source's draws (the fill kernel's bits: the noise probe
    # holds it to them), so that the interpreter's time goes to the kernels under test
    fused._fill = generic._fill
    return fused, generic


def same(a, b, where):
    assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), where


gen = torch.Generator().manual_seed(0)
total = LAYOUT.numel + 11  # a padded slot: elements past the layout
CASES = [  # (source dtype, master dtype, perturbation's out dtype, rank, chunk)
    *((torch.float32, torch.float32, torch.float32, r, 4096) for r in (1, 2, 4)),
    (torch.float32, torch.float32, torch.float32, 2, 40),  # runs of 1 to 3 rows
    (torch.float32, torch.float32, torch.bfloat16, 2, 150),
    (torch.float32, torch.bfloat16, torch.bfloat16, 2, 150),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16, 4, 150),
    (torch.float16, torch.float16, torch.float16, 2, 150),
    (torch.bfloat16, torch.float32, torch.float32, 2, 150),
]
RANGES = [(0, total), (5, 300), (180, 181), (530, 1500)]  # cutting rows; one element
for zdt, tdt, odt, rank, chunk in CASES:
    fused, generic = pair(chunk, zdt, rank)
    whole = (torch.randn(total, generator=gen) * 0.1).to(tdt)
    # the dtypes' rules on the whole bucket and a range that starts mid-row
    for start, stop in RANGES if chunk == 4096 else RANGES[:2]:
        where = (zdt, tdt, odt, rank, chunk, start, stop)
        theta = whole[start:stop]
        assert fused.fuses_master(theta, torch.empty(0, dtype=odt)), where
        before = dict(launches.count)
        out, expected = (torch.full((stop - start,), float("nan"), dtype=odt) for _ in "ab")
        fused.perturb_into(out, theta, -1e-3, 7, 0, 1, start, total)
        generic.perturb_into(expected, theta, -1e-3, 7, 0, 1, start, total)
        same(out, expected, ("perturb", *where))
        assert launches.count["lowrank_perturb"] > before["lowrank_perturb"], where
        # one term (ZO-SGD) with the decay ending inside a matrix, and two (n-SPSA)
        for terms, decay_end in (([(7, 0, -0.3)], 300), ([(7, 0, -0.3), (9, 1, 0.2)], total)):
            updated, expected = theta.clone(), theta.clone()
            fused.apply_terms(updated, decay_end, 0.99, terms, 0, start, total)
            generic.apply_terms(expected, decay_end, 0.99, terms, 0, start, total)
            same(updated, expected, ("update", len(terms), decay_end, *where))
            assert not torch.equal(updated, theta), where
        assert launches.count["lowrank_update"] > before["lowrank_update"], where


# Offsets where int32 arithmetic wraps (the offsets are keys; nothing that large is held):
# a matrix past 2^31 in its bucket, and one of 2^32 elements whose rows pass 2^31 and 2^32
# elements in (runs that start, cross and end there).
BIG = Layout(
    (
        Entry(("a",), 0, (1000,)),
        Entry(("b",), 2**31 - 77, (300, 50)),
        Entry(("c",), 2**31 + 20_000, (2**22, 1024)),
    ),
    2**31 + 20_000 + 2**32 + 64,
)
c0 = 2**31 + 20_000
BIG_RANGES = [
    (2**31 - 200, 2**31 + 200),  # the 1-D padding, then matrix b across 2^31
    (c0 + 2**31 - 1500, c0 + 2**31 + 1300),
    (c0 + 2**32 - 3000, BIG.numel),  # to the end: the matrix's last rows, then padding
    (2**32 - 5, 2**32 + 2100),
]
for rank, chunk, zdt in [(2, 1000, torch.float32), (1, 1 << 16, torch.float32)]:
    fused, generic = pair(chunk, zdt, rank, (BIG,))
    for start, stop in BIG_RANGES:
        theta = torch.randn(stop - start, generator=gen)
        out, expected = torch.empty_like(theta), torch.empty_like(theta)
        fused.perturb_into(out, theta, 1e-3, 11, 0, 0, start, BIG.numel)
        generic.perturb_into(expected, theta, 1e-3, 11, 0, 0, start, BIG.numel)
        same(out, expected, ("big perturb", rank, start, stop))
        assert not torch.equal(out, theta)
        updated, expected = theta.clone(), theta.clone()
        decay_end = (start + stop) // 2
        fused.apply_terms(updated, decay_end, 0.9, [(11, 0, 0.5)], 0, start, BIG.numel)
        generic.apply_terms(expected, decay_end, 0.9, [(11, 0, 0.5)], 0, start, BIG.numel)
        same(updated, expected, ("big update", rank, start, stop))

# A run's place in its first row is int64 in the kernel: one that starts 2^31 - 1000
# elements into the U buffer's rows (past 2^31 in its run) against torch's arithmetic.
cols, first = 1 << 20, 2**31 - 1000
u, v = torch.randn(2050, 2, generator=gen), torch.randn(cols, 2, generator=gen)
theta, out = torch.randn(3000, generator=gen), torch.empty(3000)
places = first + torch.arange(3000)
rows, at = places // cols, places % cols
z = u[rows, 0] * v[at, 0]
z += u[rows, 1] * v[at, 1]
triton_lowrank.perturb(out, theta, u.flatten(), v, first, 1e-3)
same(out, torch.add(theta, z, alpha=1e-3), "a run's place past 2^31")

# Not fused: a float64 master or source, a non-contiguous theta, a 16-bit master into an
# out of another dtype (add_scaled's rule rounds to theta's dtype)
fused, _ = pair(150, torch.float32, 2)
assert not fused.fuses_master(torch.zeros(4, dtype=torch.float64))
assert not fused.fuses_master(torch.zeros(4, 2).t())
assert not fused.fuses_master(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4))
assert not pair(150, torch.float64, 2)[0].fuses_master(torch.zeros(4))
assert not fused.fuses()  # the stored moments' and the rebuilt master's kernels
# the fused path refuses what the generic one does, before any launch
before = dict(launches.count)
for call, message in (
    (lambda: fused.perturb_into(torch.empty(3), torch.zeros(10), 1e-3, 0, 0), "fewer than"),
    (lambda: fused.perturb_into(torch.empty(10), torch.zeros(10), 1e-3, 0, 0, 0, 5, 9), "outside"),
    (lambda: fused.apply_terms(torch.zeros(10), 0, 1.0, [(0, 0, 1.0)], 0, 5, 9), "outside"),
    (lambda: fused.apply_terms(torch.zeros(10), 0, 1.0, [(0, 0, 1.0)], 3), "no layout"),
):
    try:
        call()
        raise AssertionError(f"not refused: {message}")
    except ValueError as err:
        assert message in str(err), err
assert launches.count == before
print("low-rank kernels == generic path", launches.count)
