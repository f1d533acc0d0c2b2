"""Pinned (page-locked) host memory at its exact size.

``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator,
which rounds every allocation up to a power of two: 50 GB of OPT-13B blocks would pin
64 GB per rank, 14 GB the memory plan never sees. Here the memory is an ordinary host
tensor registered in place with ``cudaHostRegister`` (what PyTorch's own checkpoint
stager does), so exactly its bytes are locked, and it is unregistered when the tensor
is freed.
"""

from __future__ import annotations

import weakref

import torch

from distzo.runtime.units import format_bytes

PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process


def _unregister(pointer: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(pointer)


def pinned_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor of exactly ``numel`` elements, page-locked for async copies."""
    tensor = torch.zeros(numel, dtype=dtype)
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return tensor
    error = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, PORTABLE))
    if error != 0:
        raise RuntimeError(
            f"could not pin {format_bytes(nbytes)} of host memory "
            f"(cudaHostRegister error {error}); "
            "raise the locked-memory limit (ulimit -l) or use a low-bit --transfer-dtype"
        )
    weakref.finalize(tensor, _unregister, tensor.data_ptr())
    return tensor
