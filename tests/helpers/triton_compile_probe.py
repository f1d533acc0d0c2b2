"""Run by tests/unit/test_noise.py without TRITON_INTERPRET: compile every Triton noise kernel
for NVIDIA GPUs (PTX and cubin, with the ptxas that Triton ships) on a machine with no
GPU, so code the interpreter accepts but the compiler refuses fails on every CI run."""

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from distzo.zo import triton_kernels as k

RANGE = {"start": "i64", "n": "i64", "k0": "i64", "k1": "i64"}
KERNELS = [
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
    (
        k.perturb_kernel,
        {
            "out_ptr": "*fp32",
            "theta_ptr": "*fp32",
            "table_ptr": "*fp32",
            **RANGE,
            "scale": "fp32",
            "KIND": "constexpr",
            "BLOCKS": "constexpr",
        },
        [{"KIND": 1, "BLOCKS": 512}],
    ),  # Rademacher
    (
        k.update_kernel,
        {
            "theta_ptr": "*fp32",
            "table_ptr": "*fp32",
            **RANGE,
            "alpha": "fp32",
            "decay_end": "i64",
            "shrink": "fp32",
            "KIND": "constexpr",
            "BLOCKS": "constexpr",
        },
        [{"KIND": 0, "BLOCKS": 512}],
    ),  # Gaussian
    (
        k.round_bf16_kernel,
        {"dst_ptr": "*bf16", "src_ptr": "*fp32", **RANGE, "BLOCKS": "constexpr"},
        [{"BLOCKS": 512}],
    ),
]
targets = [GPUTarget("cuda", arch, 32) for arch in (int(a) for a in sys.argv[1:] or ["90"])]
for target in targets:
    for fn, signature, variants in KERNELS:
        for constexprs in variants:
            source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
            compiled = triton.compile(source, target=target, options={"enable_fp_fusion": True})
            assert compiled.asm.get("cubin"), (fn.__name__, constexprs)
            print(
                f"sm_{target.arch} {fn.__name__} {constexprs}: {len(compiled.asm['cubin'])} bytes"
            )
print("triton kernels compile")
