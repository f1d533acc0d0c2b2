"""Run by tests/unit/test_noise.py under TRITON_INTERPRET=1: the Triton noise kernels on the
CPU against the reference generator. Exits non-zero (an assertion) on any difference."""

import contextlib
import itertools
import math
import os

import numpy as np
import torch

from distzo.offload import BucketLayout
from distzo.zo import NoiseSource, triton_noise
from distzo.zo.gaussian_table import gaussian_table
from distzo.zo.lowrank import LowRankNoise
from distzo.zo.philox import TILE_BLOCKS

assert os.environ.get("TRITON_INTERPRET") == "1", "run me with TRITON_INTERPRET=1"
assert triton_noise.available()

table = gaussian_table()
ranges = [(0, 1), (0, 37), (5, 4096), (4090, 4100), (4095, 12289), (20_000, 20_003)]
# Bucket offsets where int32 arithmetic wraps: each range is small (the offsets are keys),
# ending at, straddling or starting past 2^31 and 2^32, so that a bound computed as a sum
# of two int32 arguments would wrap and store nothing.
LARGE = [
    (2**31 - 4096, 2**31),
    (2**31 - 100, 2**31 + 100),
    (2**31, 2**31 + 37),
    (2**32 - 50, 2**32 + 50),
    (2**32 + 4095, 2**32 + 4097),
]
ranges += LARGE
for kind, distribution in [
    ("gaussian", "normal"),
    ("rademacher", "normal"),
    ("gaussian", "uniform"),
]:
    src = NoiseSource(3, 1000, torch.device("cpu"), torch.float32, distribution, kind=kind)
    draw = "uniform" if distribution == "uniform" else kind
    for step, block in [(0, 0), (123456, 77)]:
        key = src.key(step, block)
        for start, stop in ranges:
            out = torch.full((stop - start,), float("nan"))
            triton_noise.fill(out, start, key, draw, table)
            expected = src.reference(start, stop, key)
            assert torch.equal(out.view(torch.int32), expected.view(torch.int32)), (
                kind,
                distribution,
                start,
                stop,
            )


# A master of another dtype (16-bit, float64) on CUDA draws through the fill kernel into
# float32 staging, then takes the copy: the reference's draws in its dtype. (On the CPU
# the source would use the C kernel; here it is made to take the CUDA path.)
for dtype in (torch.float16, torch.bfloat16, torch.float64):
    src = NoiseSource(3, 1000, torch.device("cpu"), dtype)
    src._triton, src._c, src._float32 = True, False, torch.empty(src.piece)
    z = src.full(2500, 4, 9)
    assert z.dtype == dtype
    assert torch.equal(z, src.reference(0, 2500, src.key(4, 9)).to(dtype)), dtype


def within_one_rounding(out, theta, z, scale):
    """out is theta + scale * z rounded once (a fused multiply-add) or twice (the product
    first, as a CPU without fusion may): within a float32 epsilon of |theta| + |scale z|,
    whatever cancels (a count of ulps of the result is not a bound where it does)."""
    exact = theta.double() + scale * z.double()
    bound = torch.finfo(torch.float32).eps * (theta.double().abs() + (scale * z.double()).abs())
    return bool(((out.double() - exact).abs() <= bound).all())


class Launches:
    """Counts the launches of a kernel (``kernel[grid](...)``) in ``triton_noise``."""

    def __init__(self, name):
        self.name, self.kernel, self.count = name, triton_noise._kernels()[name], 0

    def __enter__(self):
        triton_noise._kernels()[self.name] = self
        return self

    def __exit__(self, *exc):
        triton_noise._kernels()[self.name] = self.kernel

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


gen = torch.Generator().manual_seed(0)
for kind in ("gaussian", "rademacher"):
    src = NoiseSource(3, 1000, torch.device("cpu"), torch.float32, kind=kind)
    for n in (1, 4095, 4096, 9000):
        theta = torch.randn(n, generator=gen)
        key = src.key(4, 9)
        z = src.reference(0, n, key)
        out = torch.full((n + 7,), float("nan"))
        triton_noise.perturb(out[:n], theta, -1e-3, key, kind, table)
        assert within_one_rounding(out[:n], theta, z, -1e-3), (kind, n)
        assert out[n:].isnan().all()  # nothing past the bucket is written
        # a run of a bucket at an offset takes the z of its places there (a resident side):
        # the same bits as those elements of the whole bucket's perturbation, and past 2^31
        # the reference's z
        whole = torch.randn(4090 + n, generator=torch.Generator().manual_seed(n))
        perturbed = torch.empty_like(whole)
        triton_noise.perturb(perturbed, whole, 1e-3, key, kind, table)
        for start in (37, 4090, 2**31 - 100):
            out = torch.full((n + 7,), float("nan"))
            run = whole[start : start + n] if start < len(whole) else theta
            triton_noise.perturb(out[:n], run, 1e-3, key, kind, table, start)
            if start < len(whole):
                assert torch.equal(out[:n], perturbed[start : start + n]), (kind, n, start)
            else:
                z = src.reference(start, start + n, key)
                torch.testing.assert_close(out[:n], theta + 1e-3 * z, rtol=0, atol=1e-6)
            assert out[n:].isnan().all()

        # every term in one launch (ZO-SGD's one term, through update_one_kernel; a step's
        # 3 queries; a recomputed momentum's 4 steps x 3 queries): NoiseSource.apply_terms's
        # CPU path, which defines the trajectory, bit for bit (alphas that are not float32
        # values: rounded as torch rounds them)
        for steps, queries in ((1, 1), (1, 3), (4, 3)):
            terms = [
                (4 - s, q, (-1) ** q * 0.3 / (s + q + 1))
                for s in range(steps)
                for q in range(queries)
            ]
            keys = [src.key(step, 9, q) for step, q, _ in terms]
            alphas, shrink, decay_end = [a for _, _, a in terms], 0.999, n // 2
            updated = theta.clone()
            with Launches("update_one") as one, Launches("update") as tiled_launch:
                triton_noise.update(updated, decay_end, shrink, keys, alphas, kind, table)
            assert one.count == (len(terms) == 1), (one.count, len(terms))
            assert tiled_launch.count == (len(terms) > 1), (tiled_launch.count, len(terms))
            expected = theta.clone()
            src.apply_terms(expected, decay_end, shrink, terms, 9)
            assert torch.equal(updated.view(torch.int32), expected.view(torch.int32)), (
                kind,
                n,
                steps,
                queries,
            )
            if one.count:  # the tiled kernel with the one term: the same bits (with more
                # terms, update launched it above with these arguments: a second launch
                # would repeat the same interpreted run)
                tiled = theta.clone()
                triton_noise.update_table(tiled, decay_end, shrink, keys, alphas, kind, table)
                assert torch.equal(tiled.view(torch.int32), updated.view(torch.int32))
            # a piece of a bucket at an offset (a master rebuilt a chunk at a time) takes
            # the operations of its places there: the bits of the whole bucket's update,
            # the decay ending inside the piece; past 2^31, the CPU path's at that offset
            bucket = 4090 + n
            decay_end = 4090 + n // 2
            whole = torch.randn(bucket, generator=gen)
            updated = whole.clone()
            triton_noise.update(updated, decay_end, shrink, keys, alphas, kind, table)
            for start in (37, 4090, 2**31 - 100):
                inside = start < bucket
                piece = whole[start : start + n].clone() if inside else theta.clone()
                ends = decay_end if inside else start + n // 2
                triton_noise.update(piece, ends, shrink, keys, alphas, kind, table, start)
                if inside:
                    expected = updated[start : start + n]
                else:
                    expected = theta.clone()
                    src.apply_terms(expected, ends, shrink, terms, 9, start, start + n)
                assert torch.equal(piece.view(torch.int32), expected.view(torch.int32)), (
                    kind,
                    n,
                    steps,
                    start,
                )


def on_triton(source):
    """``source`` taking its CUDA path: the Triton kernels, here on CPU tensors (interpreted),
    with the float32 staging its constructor gives a 16-bit source on CUDA (on a CPU it had
    one only where the optional C kernel was built: without it the chunked path failed)."""
    source._triton = True
    if source._workspace.dtype != torch.float32 and source._float32 is None:
        source._float32 = torch.empty(source.piece, dtype=torch.float32)
    return source


# A model held in fp16 or bf16 (ZO2's precision): its perturbation and its update are one
# kernel each (the perturb kernel, update_one_kernel for one term, the tiled kernel for
# more), bit for bit the CPU path's rule (NoiseSource's add_scaled: z and alpha rounded to
# the dtype, each op's float32 result rounded to nearest even in it), here and past 2^31.
# A shrink of 1.5 puts many products exactly halfway between two 16-bit values: a
# truncating or ties-away conversion fails.
for dtype, kind in itertools.product((torch.float16, torch.bfloat16), ("gaussian", "rademacher")):
    reference = NoiseSource(3, 1000, torch.device("cpu"), dtype, kind=kind)
    fused = on_triton(NoiseSource(3, 1000, torch.device("cpu"), dtype, kind=kind))
    for n, start in ((1, 0), (9000, 0), (4100, 2**31 - 100)):
        theta = (torch.randn(n, generator=gen) * 0.05).to(dtype)
        total = start + n
        expected, out = torch.empty_like(theta), torch.full_like(theta, float("nan"))
        reference.perturb_into(expected, theta, -1e-3, 4, 9, 0, start, total)
        with Launches("perturb") as launches:
            fused.perturb_into(out, theta, -1e-3, 4, 9, 0, start, total)
        assert launches.count == 1
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), (dtype, kind, n)
        for terms, shrink, name in (
            ([(4, 0, -3e-4)], 0.999, "update_one"),
            ([(4, 0, -3e-4)], 1.5, "update_one"),
            ([(4, 0, -3e-4), (4, 1, 2e-4), (3, 0, 1e-5)], 0.99, "update"),
        ):
            decay_end = start + n // 2
            expected, updated = theta.clone(), theta.clone()
            reference.apply_terms(expected, decay_end, shrink, terms, 9, start, total)
            with Launches(name) as launches:
                fused.apply_terms(updated, decay_end, shrink, terms, 9, start, total)
            assert launches.count == 1, (name, launches.count)
            assert torch.equal(updated.view(torch.int16), expected.view(torch.int16)), (
                dtype,
                kind,
                n,
                shrink,
                len(terms),
            )
    # an out of another dtype keeps the chunked path (the kernel rounds to theta's dtype)
    with Launches("perturb") as launches:
        fused.perturb_into(torch.empty(8), theta[:8], 1e-3, 4, 9)
    assert launches.count == 0


# NoiseSource's wiring: a recomputed momentum's 4 steps x 2 queries, decay included, are one
# launch over the bucket (not one per term), bit for bit the CPU path's result
cpu_source = NoiseSource(3, 1000, torch.device("cpu"), torch.float32)
triton_source = on_triton(NoiseSource(3, 1000, torch.device("cpu"), torch.float32))
terms = [(9 - s, q, 0.01 * (s + 1) * (q - 0.5)) for s in range(4) for q in range(2)]
theta = torch.randn(5000, generator=gen)
on_cpu, fused = theta.clone(), theta.clone()
cpu_source.apply_terms(on_cpu, 3000, 0.99, terms, 4)
with Launches("update") as launches:
    triton_source.apply_terms(fused, 3000, 0.99, terms, 4)
assert launches.count == 1, launches.count
assert torch.equal(fused.view(torch.int32), on_cpu.view(torch.int32))


# The fused kernels at large bucket offsets (the wrappers start at element 0 of a bucket,
# so the kernels are launched directly on a window of the bucket: out/theta hold elements
# [start, start + n)). Values chosen so that the arithmetic is exact (theta 0 or 2, scale
# 1, shrink 0.5): any difference is a wrong z or a missed store, never a rounding.
kernels = triton_noise._kernels()
for kind in ("gaussian", "rademacher"):
    src = NoiseSource(3, 1000, torch.device("cpu"), torch.float32, kind=kind)
    key = src.key(4, 9)
    for start, stop in LARGE:
        n = stop - start
        z = src.reference(start, stop, key)
        out = torch.full((n,), float("nan"))
        kernels["perturb"][triton_noise._grid(start, n, 8)](
            out, torch.zeros(n), table, start, n, key[0], key[1], 1.0,
            KIND=triton_noise.KINDS[kind], BLOCKS=TILE_BLOCKS,
            **triton_noise.compile_options("perturb"),
        )  # fmt: skip
        assert torch.equal(out, z), ("perturb", kind, start)
        decay_end = start + n // 2  # absolute, like the bucket's resident prefix
        theta = torch.full((n,), 2.0)
        second = src.key(5, 9, 1)  # two terms: + z - 2 z' (one rounding each, as below)
        pair = triton_noise.packed_terms([key, second], [1.0, -2.0], theta.device)
        kernels["update"][triton_noise._grid(start, n, 8)](
            theta, table, pair, 2, start, n, decay_end, 0.5,
            KIND=triton_noise.KINDS[kind], BLOCKS=TILE_BLOCKS,
            **triton_noise.compile_options("update"),
        )  # fmt: skip
        expected = torch.full((n,), 2.0)
        expected[: n // 2] = 1.0
        expected = expected + z - 2 * src.reference(start, stop, second)
        assert torch.equal(theta, expected), ("update", kind, start)
        theta = torch.full((n,), 2.0)  # one term: update_one_kernel, lane by lane
        kernels["update_one"][triton_noise._grid(start, n, 8)](
            theta, table, start, n, decay_end, 0.5, key[0], key[1], -2.0,
            KIND=triton_noise.KINDS[kind], BLOCKS=TILE_BLOCKS,
            **triton_noise.compile_options("update_one"),
        )  # fmt: skip
        expected = torch.full((n,), 2.0)
        expected[: n // 2] = 1.0
        assert torch.equal(theta, expected - 2 * z), ("update_one", kind, start)

# The stored moments' rules, one kernel per bucket: MomentUpdater's CPU path (chunk by chunk,
# 1000-element pieces) bit for bit, with the square root correctly rounded, as CUDA's and the
# kernel's sqrt_rn are (torch's CPU sqrt, MKL's, misses it by an ulp at times: then Adam's
# theta differs by an ulp at most). Then at large bucket offsets, the same code drawing there.
from distzo.zo.moments import MomentRule, MomentUpdater  # noqa: E402


@contextlib.contextmanager
def correctly_rounded_sqrt():
    original = torch.sqrt

    def sqrt(x, out=None):
        root = torch.from_numpy(np.sqrt(x.numpy()))
        return root if out is None else out.copy_(root)

    torch.sqrt = sqrt
    try:
        yield
    finally:
        torch.sqrt = original


class Shifted(NoiseSource):
    """A CPU source that draws bucket elements [base, base + n) as its [0, n)."""

    def __init__(self, base, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.base = base

    def chunks(self, start, stop, total, step, block_id, query=0):
        b = self.base
        for lo, hi, z in super().chunks(b + start, b + stop, b + total, step, block_id, query):
            yield lo - b, hi - b, z


def moment_state(rule, n):
    theta = torch.randn(n, generator=gen)
    moments = [torch.randn(n, generator=gen) * 1e-2, torch.rand(n, generator=gen) * 1e-4]
    return theta, moments[: rule.num_moments]


def bits(tensors):
    return [t.view(torch.int32) for t in tensors]


RULES = [MomentRule("momentum", 0.9), MomentRule("adam", 0.9, 0.999, 1e-8)]
for rule in RULES:
    for kind in ("gaussian", "rademacher"):
        cpu_source = NoiseSource(3, 1000, torch.device("cpu"), torch.float32, kind=kind)
        triton_source = on_triton(
            NoiseSource(3, 1000, torch.device("cpu"), torch.float32, kind=kind)
        )
        for n, grads in [
            (1, (0.7,)),
            (4097, (0.5, -1.5, 0.25)),
            (9000, (-0.3, 2.0)),
            (4097, (0.9,)),
        ]:
            # momentum's one query: the lane-by-lane kernel; more, and Adam: the tiled one
            one = len(grads) == 1 and rule.optimizer == "momentum"
            name = rule.optimizer + ("_one" if one else "")
            theta, moments = moment_state(rule, n)
            exact_state = [t.clone() for t in (theta, *moments)]
            fused_state = [t.clone() for t in (theta, *moments)]
            plain_state = [t.clone() for t in (theta, *moments)]
            for step in (6, 7):  # two steps: the second from the first's moments
                with Launches(name) as launches:
                    MomentUpdater(rule, triton_source).apply(
                        triton_source,
                        fused_state[0],
                        fused_state[1:],
                        n // 3,
                        1e-2,
                        0.1,
                        step,
                        grads,
                        4,
                    )
                assert launches.count == 1, (name, launches.count)
                with correctly_rounded_sqrt():
                    MomentUpdater(rule, cpu_source).apply(
                        cpu_source,
                        exact_state[0],
                        exact_state[1:],
                        n // 3,
                        1e-2,
                        0.1,
                        step,
                        grads,
                        4,
                    )
                MomentUpdater(rule, cpu_source).apply(
                    cpu_source, plain_state[0], plain_state[1:], n // 3, 1e-2, 0.1, step, grads, 4
                )
            for a, b in zip(bits(fused_state), bits(exact_state)):
                assert torch.equal(a, b), (rule.optimizer, kind, n)
            # torch's own CPU sqrt: the moments alike, theta within an ulp of itself and
            # of the two steps' change (the update term is what the denominator scales)
            for a, b in zip(bits(fused_state[1:]), bits(plain_state[1:])):
                assert torch.equal(a, b), (rule.optimizer, kind, n)
            bound = 2**-22 * (plain_state[0].abs() + (plain_state[0] - theta).abs())
            assert ((fused_state[0] - plain_state[0]).abs() <= bound).all(), (
                rule.optimizer,
                kind,
                n,
            )
    for start, stop in LARGE:
        n = stop - start
        grads = (0.5, -1.5)
        cpu_source = Shifted(start, 3, 1000, torch.device("cpu"), torch.float32)
        theta, moments = moment_state(rule, n)
        large_expected = [t.clone() for t in (theta, *moments)]
        with correctly_rounded_sqrt():
            MomentUpdater(rule, cpu_source).apply(
                cpu_source, large_expected[0], large_expected[1:], n // 2, 1e-2, 0.1, 6, grads, 4
            )
        keys = [cpu_source.key(6, 4, query) for query in range(2)]
        large_terms = triton_noise.packed_terms(keys, [g / 2 for g in grads], theta.device)
        common = (large_terms, 2, start, n, start + n // 2, 1.0 - 1e-2 * 0.1)
        scalars: tuple[float, ...] = (rule.beta1, -1e-2)
        if rule.optimizer == "adam":
            step_size = 1e-2 * math.sqrt(1.0 - rule.beta2**7) / (1.0 - rule.beta1**7)
            scalars = (rule.beta1, rule.beta2, 1 - rule.beta1, 1 - rule.beta2, rule.eps, -step_size)
        kernels[rule.optimizer][triton_noise._grid(start, n, 8)](
            theta, *moments, table, *common, *scalars,
            KIND=0, BLOCKS=TILE_BLOCKS,
            **triton_noise.compile_options(rule.optimizer),
        )  # fmt: skip
        for a, b in zip(bits((theta, *moments)), bits(large_expected)):
            assert torch.equal(a, b), (rule.optimizer, start)

# stochastic rounding to bf16, fp16 and fp8 (e4m3fn): the fused kernels equal offload.low_bit's
# rule on the reference uniforms, bit for bit (values spread over the format's binades and
# below its subnormals, both signs and zeros, exact values, saturation)
from distzo.offload.low_bit import round_keyed_, round_stochastic_  # noqa: E402

rounding = NoiseSource(3, 1000, torch.device("cpu"), torch.float32, "uniform")
SPREAD = {torch.bfloat16: (-30, 30), torch.float16: (-9, 6), torch.float8_e4m3fn: (-4, 3)}
for dtype, (low, high) in SPREAD.items():
    limit = torch.finfo(dtype).max
    for start, n in [(0, 1), (0, 2048), (5, 3000), (2047, 4100)] + [(a, b - a) for a, b in LARGE]:
        values = torch.randn(n, generator=gen) * torch.logspace(low, high, n).to(torch.float32)
        values[:6] = torch.tensor([2 * limit, -2 * limit, 0.0, -0.0, limit, -1.5])[: min(6, n)]
        key = rounding.key(7, 1 << 40)
        dst = torch.empty(n, dtype=dtype)
        triton_noise.round_stochastic(dst, values, start, key)
        expected = torch.empty(n, dtype=dtype)
        round_stochastic_(expected, values, rounding.reference(start, start + n, key))
        as_int = torch.int8 if dtype == torch.float8_e4m3fn else torch.int16
        assert torch.equal(dst.view(as_int), expected.view(as_int)), (dtype, start, n)
    if dtype != torch.bfloat16:  # every value of the format, each tie, a float32 ulp off each
        as_int = torch.int8 if dtype == torch.float8_e4m3fn else torch.int16
        codes = torch.arange(0, int(torch.tensor(limit, dtype=dtype).view(as_int)) + 1)
        exact = codes.to(as_int).view(dtype).float()
        ties = (exact[:-1] + exact[1:]) / 2
        # a float32 ulp either side of each: an ulp's fraction at its least and its most
        above = torch.nextafter(exact, torch.full_like(exact, float("inf")))
        below = torch.nextafter(exact, torch.zeros_like(exact))
        values = torch.cat([exact, ties, -exact, -ties, above, -above, below, -below])
        dst, expected = torch.empty(len(values), dtype=dtype), torch.empty(len(values), dtype=dtype)
        triton_noise.round_stochastic(dst, values, 0, key)
        round_stochastic_(expected, values, rounding.reference(0, len(values), key))
        assert torch.equal(dst.view(as_int), expected.view(as_int)), dtype
    # the wiring: round_keyed_ on a source that takes the Triton path launches one kernel
    wire, wire_cpu = torch.empty(5000, dtype=dtype), torch.empty(5000, dtype=dtype)
    values = torch.randn(5000, generator=gen)
    name = "round_bf16" if dtype == torch.bfloat16 else "round_low_bit"
    with Launches(name) as launches:
        fused_rounding = NoiseSource(3, 1000, torch.device("cpu"), torch.float32, "uniform")
        round_keyed_(wire, values, on_triton(fused_rounding), 100, 5100, 7, 1 << 40)
    round_keyed_(wire_cpu, values, rounding, 100, 5100, 7, 1 << 40)
    assert launches.count == 1, (dtype, launches.count)
    assert torch.equal(wire.view(as_int), wire_cpu.view(as_int)), dtype
# A NaN (a diverged master) rounds to NaN, as in the reference, through the round kernels
# and the write-back of a block at rest (one term and two: both kernels): Triton's min and
# max return the operand that is not NaN, so a bare clamp writes the format's -max instead.
nan_values = torch.tensor([float("nan"), -float("nan"), 1.5, -float("inf"), 0.0])
nan_key = rounding.key(7, 1 << 40)
for dtype in SPREAD:
    dst, expected = torch.empty(5, dtype=dtype), torch.empty(5, dtype=dtype)
    triton_noise.round_stochastic(dst, nan_values, 3, nan_key)
    round_stochastic_(expected, nan_values, rounding.reference(3, 8, nan_key))
    torch.testing.assert_close(dst.float(), expected.float(), rtol=0, atol=0, equal_nan=True)
nan_source = NoiseSource(3, 1000, torch.device("cpu"), torch.float32)
for rest_dtype, queries in itertools.product(triton_noise.REBUILDS_FROM, (1, 2)):
    piece = nan_values.to(rest_dtype)
    nan_keys = [nan_source.key(6, 5, q) for q in range(queries)]
    triton_noise.rebuild_round(
        piece, 0, 5, 0.999, nan_keys, [1e-3] * queries, nan_key, "gaussian", table
    )
    assert piece.isnan().tolist() == [True, True, False, False, False], (rest_dtype, queries)

# rebuild_perturb: a 16-bit block at rest upcast, updated and perturbed in registers, the
# master never stored: the bits of the ops it stands for (the upcast copy, update, perturb),
# from bf16 and fp16, into every scratch format, the decay ending inside the block, with the
# step's update (two queries: the tiled kernel; one, and none: the lane-by-lane kernel, the
# tiled one's bits too), and from NoiseSource's wiring; a LOZO source, whose z is no
# kernel's, declines it. The update it stands for is the CPU path's (apply_terms, the update
# kernels' bits above); the perturbation, a fused multiply-add, the perturb kernel's.
for kind in ("gaussian", "rademacher"):
    src = on_triton(NoiseSource(3, 1000, torch.device("cpu"), torch.float32, kind=kind))
    src_cpu = NoiseSource(3, 1000, torch.device("cpu"), torch.float32, kind=kind)
    values = torch.randn(9000, generator=gen) * 0.05
    for rest_dtype in triton_noise.REBUILDS_FROM:
        rest = values.to(rest_dtype)
        for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
            for terms in ([(6, 0, -2e-3), (6, 1, 1e-3)], [(6, 0, -2e-3)], []):
                keys, alphas = [src.key(s, 5, q) for s, q, _ in terms], [a for *_, a in terms]
                master = rest.float()
                src_cpu.apply_terms(master, 4321, 0.999, terms, 5)
                expected = torch.empty(9000, dtype=out_dtype)
                triton_noise.perturb(expected, master, -1e-3, src.key(7, 5, 1), kind, table)
                out = torch.full((9000,), float("nan"), dtype=out_dtype)
                with (
                    Launches("rebuild_perturb_one") as one,
                    Launches("rebuild_perturb") as tiled_launch,
                ):
                    triton_noise.rebuild_perturb(
                        out, rest, 4321, 0.999, keys, alphas, src.key(7, 5, 1), -1e-3, kind, table
                    )
                assert one.count == (len(terms) <= 1), (one.count, terms)
                assert tiled_launch.count == (len(terms) > 1), (tiled_launch.count, terms)
                word = torch.int32 if out_dtype == torch.float32 else torch.int16
                assert torch.equal(out.view(word), expected.view(word)), (kind, rest_dtype, terms)
                if one.count:  # else the tiled kernel's own launch, with these arguments, above
                    tiled = torch.full((9000,), float("nan"), dtype=out_dtype)
                    triton_noise.rebuild_perturb_table(
                        tiled, rest, 4321, 0.999, keys, alphas, src.key(7, 5, 1), -1e-3, kind, table
                    )
                    assert torch.equal(tiled.view(word), out.view(word)), (kind, rest_dtype, terms)
                wired = torch.full((9000,), float("nan"), dtype=out_dtype)
                assert src.rebuild_perturb_into(wired, rest, 4321, 0.999, terms, 5, -1e-3, 7, 1)
                assert torch.equal(wired.view(word), expected.view(word))
        # one module's part of the block (perturb_scope="module"), at an offset inside a
        # tile, on a tile's edge and past 2^31: the z and the decay of its places
        for start, used in itertools.product((37, 4096, 2**31 - 100), ([(6, 0, -2e-3)], [])):
            keys, alphas = [src.key(s, 5, q) for s, q, _ in used], [a for *_, a in used]
            part = rest[:5000]
            master = part.float()
            src_cpu.apply_terms(master, start + 2500, 0.999, used, 5, start, start + 5000)
            expected = torch.empty(5000)
            triton_noise.perturb(expected, master, 1e-3, src.key(7, 5, 0), kind, table, start)
            out = torch.full((5000,), float("nan"))
            with Launches("rebuild_perturb_one") as one:
                assert src.rebuild_perturb_into(
                    out, part, start + 2500, 0.999, used, 5, 1e-3, 7, 0, start
                )
            assert one.count == 1
            assert torch.equal(out.view(torch.int32), expected.view(torch.int32)), (start, used)
            tiled = torch.full((5000,), float("nan"))
            triton_noise.rebuild_perturb_table(
                tiled,
                part,
                start + 2500,
                0.999,
                keys,
                alphas,
                src.key(7, 5, 0),
                1e-3,
                kind,
                table,
                start,
            )
            assert torch.equal(tiled.view(torch.int32), out.view(torch.int32)), (start, used)
    rest32 = values.clone()  # a float32 block at rest has no low-bit copy to rebuild from
    assert not src.rebuild_perturb_into(values.clone(), rest32, 0, 1.0, [], 5, 1e-3, 7)

# rebuild_round: the write-back of such a block, in place: the bits of the upcast copy, the
# update and the stochastic rounding, at offsets inside a tile, on a tile's edge and past
# 2^31 (its uniforms drawn four lanes to a counter, the update's z eight), with and without
# the decay inside the piece, with two terms (the tiled kernel), one and none (the lane-by-lane
# kernel, the tiled one's bits too); through NoiseSource's wiring too, with the rounding's
# source. The ops it stands for are the CPU path's (apply_terms, round_keyed_), which the
# sections above find equal to the update and rounding kernels bit for bit: the expectation
# costs no interpreted launch.
rounding_src = on_triton(NoiseSource(8, 1000, torch.device("cpu"), torch.float32, "uniform"))
rounding_cpu = NoiseSource(8, 1000, torch.device("cpu"), torch.float32, "uniform")
for kind in ("gaussian", "rademacher"):
    src = on_triton(NoiseSource(3, 1000, torch.device("cpu"), torch.float32, kind=kind))
    src_cpu = NoiseSource(3, 1000, torch.device("cpu"), torch.float32, kind=kind)
    terms = [(6, 0, -2e-3), (6, 1, 1e-3)]
    values = torch.randn(6000, generator=gen) * 0.05
    for rest_dtype in triton_noise.REBUILDS_FROM:
        rest = values.to(rest_dtype)
        for start, decay_end, used in itertools.product(
            (0, 37, 4096, 2**31 - 100), (2500, None), (terms, terms[:1], [])
        ):
            decay_end = 0 if decay_end is None else start + decay_end
            keys, alphas = [src.key(s, 5, q) for s, q, _ in used], [a for *_, a in used]
            round_key = rounding_src.key(7, 2**40 + 5)
            master = rest.float()
            src_cpu.apply_terms(master, decay_end, 0.999, used, 5, start, start + len(rest))
            expected = torch.empty_like(rest)
            round_keyed_(expected, master, rounding_cpu, start, start + len(rest), 7, 2**40 + 5)
            piece = rest.clone()
            with Launches("rebuild_round_one") as one, Launches("rebuild_round") as tiled_launch:
                triton_noise.rebuild_round(
                    piece, start, decay_end, 0.999, keys, alphas, round_key, kind, table
                )
            assert one.count == (len(used) <= 1), (one.count, used)
            assert tiled_launch.count == (len(used) > 1), (tiled_launch.count, used)
            where = (kind, rest_dtype, start, decay_end, len(used))
            assert torch.equal(piece.view(torch.int16), expected.view(torch.int16)), where
            if used or decay_end:  # else the values at rest may all round back to themselves
                assert not torch.equal(piece.view(torch.int16), rest.view(torch.int16)), where
            if one.count:  # else the tiled kernel's own launch, with these arguments, above
                tiled = rest.clone()
                triton_noise.rebuild_round_table(
                    tiled, start, decay_end, 0.999, keys, alphas, round_key, kind, table
                )
                assert torch.equal(tiled.view(torch.int16), piece.view(torch.int16)), where
        wired = rest.clone()
        args = (4096, 6596, 0.999, terms, 5, rounding_src, 7, 2**40 + 5)
        assert src.rebuild_round_into(wired, *args)
        master = rest.float()
        src_cpu.apply_terms(master, 6596, 0.999, terms, 5, 4096, 4096 + 6000)
        expected = torch.empty_like(rest)
        round_keyed_(expected, master, rounding_cpu, 4096, 4096 + 6000, 7, 2**40 + 5)
        assert torch.equal(wired.view(torch.int16), expected.view(torch.int16))
legacy = NoiseSource(8, 1000, torch.device("cpu"), torch.float32, "uniform", kind="legacy")
assert not src.rebuild_round_into(rest.clone(), 0, 0, 1.0, [], 5, legacy, 7, 2**40)

lowrank = on_triton(
    LowRankNoise(
        3,
        1000,
        torch.device("cpu"),
        torch.float32,
        [BucketLayout((), 9000, 0, torch.float32)],
        2,
        5,
    )
)
bf16_rest = torch.zeros(9000, dtype=torch.bfloat16)
assert not lowrank.rebuild_perturb_into(torch.empty(9000), bf16_rest, 0, 1.0, [], 0, 1e-3, 7)

print("triton kernels == reference")
