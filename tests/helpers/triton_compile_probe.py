"""Run by tests/unit/test_noise.py without TRITON_INTERPRET: compile every Triton noise kernel
for NVIDIA GPUs (PTX and cubin, with the ptxas that Triton ships) on a machine with no
GPU, so code the interpreter accepts but the compiler refuses fails on every CI run; check,
with the cuobjdump Triton ships, that each kernel launched with the engine's options
(``triton_noise.LAUNCH_OPTIONS``) spills nothing and leaves at least half of an SM's warps
resident; and check, with the binder Triton's launcher uses to pick a compiled variant, that
the keys and offsets of 50 steps select one variant per kernel (no recompile as they
change)."""

import os
import random
import re
import subprocess
import sys
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from distzo.zo import lowrank_kernels as lk
from distzo.zo import triton_kernels as k
from distzo.zo import triton_lowrank, triton_noise

RANGE = {"start": "i64", "n": "i64", "k0": "u32", "k1": "u32"}
TERMS = {"terms_ptr": "*i32", "num_terms": "i32"}  # a launch's keys and alphas, on the device
UPDATE = {"start": "i64", "n": "i64", "decay_end": "i64", "shrink": "fp32"}
# a one-term kernel's range, decay and term (no start: a bucket's moments from element 0)
ONE_TERM = {
    "n": "i64",
    "decay_end": "i64",
    "shrink": "fp32",
    "k0": "u32",
    "k1": "u32",
    "alpha": "fp32",
}
ADAM = ["beta1", "beta2", "one_minus_beta1", "one_minus_beta2", "eps", "neg_step_size"]
LOW_BIT = ["MANTISSA", "BIAS", "LIMIT", "BLOCKS"]
# The ops on a master (theta_ptr; out_ptr of its dtype), float32 or a 16-bit model's
MASTER_OPS = {
    k.perturb_kernel: {
        "out_ptr": "*fp32",
        "theta_ptr": "*fp32",
        "table_ptr": "*fp32",
        **RANGE,
        "scale": "fp32",
        "KIND": "constexpr",
        "BLOCKS": "constexpr",
    },
    k.update_kernel: {
        "theta_ptr": "*fp32",
        "table_ptr": "*fp32",
        **TERMS,
        **UPDATE,
        "KIND": "constexpr",
        "BLOCKS": "constexpr",
    },
    k.update_one_kernel: {
        "theta_ptr": "*fp32",
        "table_ptr": "*fp32",
        **UPDATE,
        "k0": "u32",
        "k1": "u32",
        "alpha": "fp32",
        "KIND": "constexpr",
        "BLOCKS": "constexpr",
    },
}


def master_signature(signature: dict[str, str], held: str) -> dict[str, str]:
    """``signature`` with the master and its out in the pointer type ``held``."""
    return {name: held if name in ("theta_ptr", "out_ptr") else t for name, t in signature.items()}


KERNELS: list[tuple[Any, dict[str, str], list[dict[str, Any]]]] = [
    (
        k.fill_kernel,
        {
            "out_ptr": "*fp32",
            "table_ptr": "*fp32",
            **RANGE,
            "KIND": "constexpr",
            "BLOCKS": "constexpr",
        },
        [{"KIND": kind, "BLOCKS": 512} for kind in (0, 2)],
    ),  # 16-bit lanes through the table; 32-bit uniforms
    *(
        (fn, master_signature(signature, held), [{"KIND": kind, "BLOCKS": 512} for kind in kinds])
        for held, kinds in (("*fp32", (0, 1)), ("*fp16", (0,)), ("*bf16", (0,)))
        for fn, signature in MASTER_OPS.items()
    ),  # Gaussian and Rademacher (update_one: ZO-SGD's one term, lane by lane); a model held
    # in a 16-bit dtype, rounded to it after each op
    *(
        (
            k.rebuild_perturb_kernel,
            {
                "out_ptr": out,
                "rest_ptr": rest,
                "table_ptr": "*fp32",
                **TERMS,
                **UPDATE,
                "k0": "u32",
                "k1": "u32",
                "scale": "fp32",
                "KIND": "constexpr",
                "BLOCKS": "constexpr",
            },
            [{"KIND": kind, "BLOCKS": 512} for kind in (0, 1)],
        )
        for rest, out in (("*bf16", "*bf16"), ("*fp16", "*fp16"), ("*bf16", "*fp32"))
    ),  # at rest in bf16 or fp16, the scratch in the compute dtype (or float32)
    *(
        (
            k.rebuild_perturb_one_kernel,
            {
                "out_ptr": out,
                "rest_ptr": rest,
                "table_ptr": "*fp32",
                "start": "i64",
                "n": "i64",
                "decay_end": "i64",
                "shrink": "fp32",
                "uk0": "u32",
                "uk1": "u32",
                "alpha": "fp32",
                "k0": "u32",
                "k1": "u32",
                "scale": "fp32",
                "KIND": "constexpr",
                "TERM": "constexpr",
                "PART": "constexpr",
                "BLOCKS": "constexpr",
            },
            [
                {"KIND": kind, "TERM": term, "PART": part, "BLOCKS": 512}
                for kind in (0, 1)
                for term in (0, 1)
                for part in (0, 1)
            ],
        )
        for rest, out in (("*bf16", "*bf16"), ("*fp16", "*fp16"), ("*bf16", "*fp32"))
    ),  # at most one pending term, lane by lane; a whole block, or a module's part of it
    *(
        (
            k.rebuild_round_kernel,
            {
                "dst_ptr": dst,
                "rest_ptr": rest,
                "table_ptr": "*fp32",
                **TERMS,
                **UPDATE,
                "k0": "u32",
                "k1": "u32",
                **{c: "constexpr" for c in ("KIND", *LOW_BIT)},
            },
            [{"KIND": kind, **dict(zip(LOW_BIT, fmt))} for kind in (0, 1)],
        )
        for dst, rest, fmt in (
            ("*bf16", "*bf16", (7, 127, 0.0, 512)),
            ("*i16", "*fp16", (10, 15, 65504.0, 512)),
        )
    ),  # the write-back in place: bf16, and fp16 as its integer bits
    *(
        (
            k.rebuild_round_one_kernel,
            {
                "dst_ptr": dst,
                "rest_ptr": rest,
                "table_ptr": "*fp32",
                **UPDATE,
                "uk0": "u32",
                "uk1": "u32",
                "alpha": "fp32",
                "k0": "u32",
                "k1": "u32",
                **{c: "constexpr" for c in ("KIND", "TERM", *LOW_BIT)},
            },
            [
                {"KIND": kind, "TERM": term, **dict(zip(LOW_BIT, fmt))}
                for kind in (0, 1)
                for term in (0, 1)
            ],
        )
        for dst, rest, fmt in (
            ("*bf16", "*bf16", (7, 127, 0.0, 512)),
            ("*i16", "*fp16", (10, 15, 65504.0, 512)),
        )
    ),  # the same with at most one term, lane by lane
    (
        k.momentum_kernel,
        {
            "theta_ptr": "*fp32",
            "m_ptr": "*fp32",
            "table_ptr": "*fp32",
            **TERMS,
            **UPDATE,
            "beta1": "fp32",
            "neg_lr": "fp32",
            "KIND": "constexpr",
            "BLOCKS": "constexpr",
        },
        [{"KIND": kind, "BLOCKS": 512} for kind in (0, 1)],
    ),
    (
        k.adam_kernel,
        {
            "theta_ptr": "*fp32",
            "m_ptr": "*fp32",
            "v_ptr": "*fp32",
            "table_ptr": "*fp32",
            **TERMS,
            **UPDATE,
            **{name: "fp32" for name in ADAM},
            "KIND": "constexpr",
            "BLOCKS": "constexpr",
        },
        [{"KIND": kind, "BLOCKS": 512} for kind in (0, 1)],
    ),
    (
        k.momentum_one_kernel,
        {
            "theta_ptr": "*fp32",
            "m_ptr": "*fp32",
            "table_ptr": "*fp32",
            **ONE_TERM,
            "beta1": "fp32",
            "neg_lr": "fp32",
            "KIND": "constexpr",
            "BLOCKS": "constexpr",
        },
        [{"KIND": kind, "BLOCKS": 512} for kind in (0, 1)],
    ),  # one query, lane by lane
    (
        k.round_bf16_kernel,
        {"dst_ptr": "*bf16", "src_ptr": "*fp32", **RANGE, "BLOCKS": "constexpr"},
        [{"BLOCKS": 512}],
    ),
    (
        k.round_low_bit_kernel,
        {"dst_ptr": "*i16", "src_ptr": "*fp32", **RANGE, **{c: "constexpr" for c in LOW_BIT}},
        [dict(zip(LOW_BIT, (10, 15, 65504.0, 512)))],
    ),  # fp16
    (
        k.round_low_bit_kernel,
        {"dst_ptr": "*i8", "src_ptr": "*fp32", **RANGE, **{c: "constexpr" for c in LOW_BIT}},
        [dict(zip(LOW_BIT, (3, 7, 448.0, 512)))],
    ),  # fp8 e4m3fn (integer and float ops only: any GPU)
]
NAMES = {getattr(k, f"{name}_kernel"): name for name in triton_noise.KERNEL_NAMES}
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
SM_REGISTERS, SM_WARPS, SM_PROGRAMS = 65536, 64, 32  # per SM, sm_80 to sm_120


def resident_warps(cubin: bytes, warps: int, name: str) -> tuple[int, int]:
    """(registers per thread, warps resident per SM) of a compiled kernel, from cuobjdump's
    resource usage; fails if the kernel spills to local memory."""
    path = f"/tmp/distzo-probe-{os.getpid()}-{name}.cubin"
    with open(path, "wb") as f:
        f.write(cubin)
    try:
        usage = subprocess.run(
            [CUOBJDUMP, "--dump-resource-usage", path], capture_output=True, text=True, check=True
        ).stdout
    finally:
        os.remove(path)
    fields = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", usage))
    assert fields.get("STACK") == "0" and fields.get("LOCAL") == "0", (name, usage)
    registers = int(fields["REG"])
    per_warp = -(-registers * 32 // 256) * 256  # allocated per warp in units of 256
    programs = min(SM_PROGRAMS, SM_REGISTERS // (per_warp * warps))
    return registers, min(SM_WARPS, programs * warps)


targets = [GPUTarget("cuda", arch, 32) for arch in (int(a) for a in sys.argv[1:] or ["90"])]
for target in targets:
    for fn, signature, variants in KERNELS:
        for constexprs in variants:
            source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
            options = triton_noise.compile_options(NAMES[fn])  # what a run's launch compiles
            compiled = triton.compile(source, target=target, options=options)
            assert compiled.asm.get("cubin"), (fn.__name__, constexprs)
            if not options["enable_fp_fusion"]:  # torch's rounding: no approximate division
                assert ".approx" not in compiled.asm["ptx"], fn.__name__  # or square root
            warps = options.get("num_warps", 4)
            registers, resident = resident_warps(compiled.asm["cubin"], warps, fn.__name__)
            assert resident >= SM_WARPS // 2, (fn.__name__, constexprs, registers, resident)
            print(
                f"sm_{target.arch} {fn.__name__} {constexprs}: {len(compiled.asm['cubin'])} "
                f"bytes, {warps} warps, {registers} registers, {resident} warps per SM"
            )

# What a run passes: keys that change every step (any 32-bit values), chunk offsets and
# lengths of any size, both sides of 2^31 (one slot-aligned buffer, as the engine's are).
rng = random.Random(0)
buffer, table = torch.empty(4096), torch.empty(65536)
bf16 = torch.empty(4096, dtype=torch.bfloat16)
terms = torch.empty(96, 3, dtype=torch.int32)


def many(k0):
    """A number of terms (1 included): a step's queries or a momentum's window vary too."""
    return (1, 2, 8, 96)[k0 % 4]


CALLS = {
    k.fill_kernel: lambda s, n, k0, k1: (buffer, table, s, n, k0, k1),
    k.perturb_kernel: lambda s, n, k0, k1: (buffer, buffer, table, s, n, k0, k1, -1e-3),
    k.update_kernel: lambda s, n, k0, k1: (buffer, table, terms, many(k0), s, n, s // 2, 1.0),
    k.update_one_kernel: lambda s, n, k0, k1: (buffer, table, s, n, s // 2, 1.0, k0, k1, -1e-3),
    k.rebuild_perturb_kernel: lambda s, n, k0, k1: (
        *(bf16, bf16, table, terms, many(k0)),
        *(s, n, s // 2, 1.0, k0, k1, -1e-3),
    ),
    k.rebuild_perturb_one_kernel: lambda s, n, k0, k1: (
        *(bf16, bf16, table, s, n, s // 2, 1.0, k1, k0, -1e-3, k0, k1, -1e-3),
    ),
    k.momentum_kernel: lambda s, n, k0, k1: (
        *(buffer, buffer, table, terms, many(k0)),
        *(s, n, s // 2, 1.0, 0.9, -1e-3),
    ),
    k.adam_kernel: lambda s, n, k0, k1: (
        *(buffer, buffer, buffer, table, terms, many(k0)),
        *(s, n, s // 2, 1.0),
        *[1e-3] * 6,
    ),
    k.momentum_one_kernel: lambda s, n, k0, k1: (
        *(buffer, buffer, table, n, s // 2, 1.0, k0, k1, -1e-3, 0.9, -1e-3),
    ),
    k.rebuild_round_kernel: lambda s, n, k0, k1: (
        *(bf16, bf16, table, terms, many(k0)),
        *(s, n, s // 2, 1.0, k0, k1),
    ),
    k.rebuild_round_one_kernel: lambda s, n, k0, k1: (
        *(bf16, bf16, table, s, n, s // 2, 1.0, k1, k0, -1e-3, k0, k1),
    ),
    k.round_bf16_kernel: lambda s, n, k0, k1: (bf16, buffer, s, n, k0, k1),
    k.round_low_bit_kernel: lambda s, n, k0, k1: (bf16.view(torch.int16), buffer, s, n, k0, k1),
}
CONSTEXPRS: dict[Any, dict[str, Any]] = {
    k.rebuild_perturb_one_kernel: {"KIND": 0, "TERM": 1, "PART": 1, "BLOCKS": 512},
    k.rebuild_round_one_kernel: {"KIND": 0, "TERM": 1, **dict(zip(LOW_BIT, (7, 127, 0.0, 512)))},
    k.rebuild_round_kernel: {"KIND": 0, **dict(zip(LOW_BIT, (7, 127, 0.0, 512)))},
    k.round_bf16_kernel: {"BLOCKS": 512},
    k.round_low_bit_kernel: dict(zip(LOW_BIT, (10, 15, 65504.0, 512))),
}
backend = make_backend(targets[0])
for fn, arguments in CALLS.items():
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    seen: set[str] = set()
    for _ in range(50):  # steps
        start = rng.choice([0, 16, 4096, 12345, 2**31 - 4096, 2**31 + 8, 2**33 + 1])
        n = rng.choice([1, 16, 3000, 4096, 2**31 + 5])
        args = arguments(start, n, rng.getrandbits(32), rng.getrandbits(32))
        constexprs = CONSTEXPRS.get(fn, {"KIND": 0, "BLOCKS": 512})
        seen.add(repr(binder(*args, **constexprs)[1]))
    assert len(seen) == 1, (fn.__name__, sorted(seen))
    print(f"{fn.__name__}: one variant over 50 steps of keys and offsets")
# LOZO's low-rank kernels (``triton_lowrank``): a float32 master at ranks 1, 2 and 4 (the
# registers grow with the rank), its out in bf16 (a compute-dtype scratch), and models held
# in bf16 or fp16 (factors in their dtype, as the engine's source draws them)
RUN = {"n": "i64", "first": "i64", "cols": "i64"}
for theta, out, factors, rank in (
    *(("*fp32", "*fp32", "*fp32", rank) for rank in (1, 2, 4)),
    ("*fp32", "*bf16", "*fp32", 2),
    ("*bf16", "*bf16", "*bf16", 2),
    ("*fp16", "*fp16", "*fp16", 4),
):
    factor_ptrs = {"u_ptr": factors, "v_ptr": factors}
    for fn, signature in (
        (
            lk.lowrank_perturb_kernel,
            {"out_ptr": out, "theta_ptr": theta, **factor_ptrs, **RUN, "scale": "fp32"},
        ),
        (
            lk.lowrank_update_kernel,
            {
                "theta_ptr": theta,
                **factor_ptrs,
                **RUN,
                **{"decay_left": "i64", "shrink": "fp32", "alpha": "fp32"},
            },
        ),
    ):
        constexprs = {"RANK": rank, "BLOCK": triton_lowrank.BLOCK}
        source = ASTSource(
            fn=fn,
            signature={**signature, "RANK": "constexpr", "BLOCK": "constexpr"},
            constexprs=constexprs,
        )
        options = triton_lowrank.COMPILE_OPTIONS
        compiled = triton.compile(source, target=targets[0], options=options)
        assert ".approx" not in compiled.asm["ptx"], fn.__name__
        registers, resident = resident_warps(compiled.asm["cubin"], 4, fn.__name__)
        assert resident >= SM_WARPS // 2, (fn.__name__, signature, rank, registers, resident)
        print(
            f"{fn.__name__} {theta} into {out}, factors {factors}, rank {rank}: "
            f"{registers} registers, {resident} warps per SM"
        )
# a run's length, its first's place, the matrix's width (and the update's decay)
LOWRANK_CALLS = {
    lk.lowrank_perturb_kernel: lambda n, first, cols, d: (*[bf16] * 4, n, first, cols, -1e-3),
    lk.lowrank_update_kernel: lambda n, first, cols, d: (
        *(bf16, bf16, bf16, n, first, cols, d, 0.99, -1e-3),
    ),
}
for fn, run_arguments in LOWRANK_CALLS.items():  # one variant whatever the run and the matrix
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    seen.clear()
    for _ in range(50):
        args = run_arguments(
            *(rng.choice([1, 3000, 2**31 + 5]), rng.choice([0, 7, 2**31 + 3])),
            *(rng.choice([1, 16, 768, 3072]), rng.choice([0, 16, 2**33])),
        )
        seen.add(repr(binder(*args, RANK=2, BLOCK=triton_lowrank.BLOCK)[1]))
    assert len(seen) == 1, (fn.__name__, sorted(seen))
    print(f"{fn.__name__}: one variant over 50 runs")
print("triton kernels compile")
