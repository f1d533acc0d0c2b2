"""The package is declared in setup.cfg; this adds the optional C noise kernel.

``distzo/csrc/philox_noise.c`` is the CPU fast path of the portable noise (plain C, no
Python or torch headers, loaded with ctypes). It is optional: where it cannot be built,
the same bits come from the torch implementation in ``distzo.zo.philox``, slower.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "distzo.zo._philox_noise",
            ["distzo/csrc/philox_noise.c"],
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        )
    ]
)
