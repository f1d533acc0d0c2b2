"""Pinned (page-locked) host memory at its exact size.

``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator,
which rounds every allocation up to a power of two: 50 GB of OPT-13B blocks would pin
64 GB per rank, 14 GB the memory plan never sees. Here the memory is an ordinary host
mapping registered in place with ``cudaHostRegister`` (what PyTorch's own checkpoint
stager does), so exactly its pages are locked, and they are unregistered when the
tensor is freed.
"""

from __future__ import annotations

import mmap
import sys

import torch

from distzo.runtime.units import format_bytes

PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process
PAGE = mmap.PAGESIZE


class _LockedPages(mmap.mmap):
    """Anonymous pages of this store alone, registered with CUDA by ``pinned_zeros``.

    An mmap starts on a page boundary, so the tensor's storage begins exactly where the
    registration does: ``Tensor.is_pinned`` asks CUDA about the storage's first byte, and a
    view into a larger malloc'd buffer would start in an unregistered page. ``__del__`` runs
    when the last tensor viewing these pages is freed, before the pages are unmapped."""

    address = 0  # set once registered

    def __del__(self) -> None:
        # at interpreter exit the process and its pages go anyway, and torch may be half gone
        if self.address and not sys.is_finalizing():
            # A copy from or to these pages may still be in flight on a stream;
            # unregistering under it is undefined behaviour, so the device finishes first.
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self.address)


def pinned_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor of exactly ``numel`` elements, page-locked for async copies.

    The registered range is whole pages that belong to this tensor alone (registering a
    page twice fails, ``cudaErrorHostMemoryAlreadyRegistered``, 712, so a small tensor
    must not share a malloc page with its neighbour): an anonymous mapping of the rounded
    size, whose first byte is the tensor's storage. The pages stay registered while any
    view of the tensor lives."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(0, dtype=dtype)
    span = -(-nbytes // PAGE) * PAGE  # whole pages
    pages = _LockedPages(-1, span)  # zero-filled by the kernel
    raw = torch.frombuffer(pages, dtype=torch.uint8)  # the storage holds ``pages``
    error = int(torch.cuda.cudart().cudaHostRegister(raw.data_ptr(), span, PORTABLE))
    if error != 0:
        raise RuntimeError(
            f"could not pin {format_bytes(nbytes)} of host memory "
            f"(cudaHostRegister error {error}); "
            "raise the locked-memory limit (ulimit -l) or use a low-bit --transfer-dtype"
        )
    pages.address = raw.data_ptr()
    return raw[:nbytes].view(dtype)
