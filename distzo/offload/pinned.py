"""Pinned (page-locked) host memory at its exact size.

``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator,
which rounds every allocation up to a power of two: 50 GB of OPT-13B blocks would pin
64 GB per rank, 14 GB the memory plan never sees. Here the memory is an ordinary host
tensor registered in place with ``cudaHostRegister`` (what PyTorch's own checkpoint
stager does), so exactly its bytes are locked, and it is unregistered when the tensor
is freed.
"""

from __future__ import annotations

import mmap
import weakref

import torch

from distzo.runtime.units import format_bytes

PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process
PAGE = mmap.PAGESIZE


def _unregister(pointer: int) -> None:
    # A copy from or to these pages may still be in flight on a stream when the tensor is
    # freed; unregistering under it is undefined behaviour, so the device finishes first.
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaHostUnregister(pointer)


def pinned_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor of exactly ``numel`` elements, page-locked for async copies.

    The registered range is whole pages that belong to this tensor alone: a small tensor
    from the malloc heap would share its first or last page with its neighbour, and
    registering a page twice fails (``cudaErrorHostMemoryAlreadyRegistered``, 712). So
    the memory is a byte buffer one page longer than the rounded size, registered from its
    first page boundary; the tensor is a view at that boundary. Keep the tensor (or a view
    of it) alive while it is used: the pages are unregistered when it is collected."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(0, dtype=dtype)
    span = -(-nbytes // PAGE) * PAGE  # whole pages
    raw = torch.zeros(span + PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % PAGE
    tensor = raw[offset : offset + nbytes].view(dtype)
    error = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), span, PORTABLE))
    if error != 0:
        raise RuntimeError(
            f"could not pin {format_bytes(nbytes)} of host memory "
            f"(cudaHostRegister error {error}); "
            "raise the locked-memory limit (ulimit -l) or use a low-bit --transfer-dtype"
        )
    weakref.finalize(tensor, _unregister, tensor.data_ptr())
    return tensor
