"""The CPU fast path of the portable noise: the C kernel built with the package.

``distzo/csrc/philox_noise.c`` fills a float32 buffer with the z (or uniform draws) of
a range of elements, by the layout of ``distzo.zo.philox``. It is loaded with ctypes
(plain C, no Python or torch headers). Where it was not built, ``available()`` is
False and the noise comes from the torch implementation, the same bits, slower.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util

import torch

from distzo.zo.gaussian_table import TABLE_SIZE

KINDS = {"gaussian": 0, "rademacher": 1, "uniform": 2}


@functools.cache
def _library() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec("distzo.zo._philox_noise")
    if spec is None or spec.origin is None:
        return None
    library = ctypes.CDLL(spec.origin)
    library.distzo_philox_fill.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_uint32,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    library.distzo_philox_fill.restype = None
    return library


def available() -> bool:
    return _library() is not None


def _is_float32_on_cpu(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def fill(
    out: torch.Tensor, start: int, key: tuple[int, int], kind: str, table: torch.Tensor | None
) -> None:
    """``out`` (contiguous float32 on the CPU) <- the draws of elements [start, start + len).
    ``table`` (the Gaussian table, read by C through a bare pointer) only for ``gaussian``:
    refused here, not dereferenced there, where it is missing or not the table's shape."""
    if not _is_float32_on_cpu(out):
        raise ValueError("the C noise kernel fills contiguous float32 CPU tensors")
    if kind not in KINDS:
        raise ValueError(f"noise draw must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "gaussian" and (
        table is None or not _is_float32_on_cpu(table) or table.numel() != TABLE_SIZE
    ):
        raise ValueError(
            f"gaussian draws read the Gaussian table: pass gaussian_table() ({TABLE_SIZE} "
            "contiguous float32 values on the CPU)"
        )
    library = _library()
    if library is None:
        raise RuntimeError("the C noise kernel was not built (see available())")
    table_pointer = table.data_ptr() if table is not None and kind == "gaussian" else None
    library.distzo_philox_fill(
        out.data_ptr(), start, out.numel(), key[0], key[1], KINDS[kind], table_pointer
    )
