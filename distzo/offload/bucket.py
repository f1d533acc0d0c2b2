"""The flat layout of one bucket: where each parameter of a block lives in one buffer.

With every parameter a view into one contiguous buffer, perturbing or updating a
block is one fused pass over the buffer and moving it is one copy. Parameters that
take weight decay come first, so the decayed region is the prefix ``[0, decay_end)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

# Offsets are multiples of this many elements, so every view is aligned for vector and
# GEMM kernels (256 bytes in fp32).
ALIGN_ELEMENTS = 64


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def takes_weight_decay(param: torch.Tensor) -> bool:
    """Matrices decay; biases and norm scales (1-D) do not, as in MeZO and HF's Trainer."""
    return param.ndim >= 2


@dataclass(frozen=True)
class Entry:
    """One parameter's place in the bucket; ``names`` holds every alias of a tied parameter."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class BucketLayout:
    entries: tuple[Entry, ...]
    numel: int  # padded length of the flat buffer
    decay_end: int  # elements [0, decay_end) take weight decay
    dtype: torch.dtype

    @classmethod
    def build(
        cls,
        params: Iterable[tuple[tuple[str, ...], nn.Parameter]],
        empty_dtype: torch.dtype | None = None,
    ) -> tuple[BucketLayout, list[nn.Parameter]]:
        """Lay out ``(aliases, parameter)`` pairs: decayed first, each offset aligned.

        Returns the layout and the parameters in layout order (for ``pack``/``bind``).
        ``empty_dtype``: an empty bucket is allowed, with that dtype (a block whose
        adapter trains nothing, the resident modules of a LoRA run).
        """
        params = list(params)
        if not params:
            if empty_dtype is None:
                raise ValueError("a bucket needs at least one parameter")
            return cls((), 0, 0, empty_dtype), []
        dtypes = {p.dtype for _, p in params}
        if len(dtypes) != 1:
            raise ValueError(
                f"a bucket holds one dtype, got {sorted(map(str, dtypes))}; cast the model first"
            )
        ordered = [x for x in params if takes_weight_decay(x[1])] + [
            x for x in params if not takes_weight_decay(x[1])
        ]
        entries, offset, decay_end = [], 0, 0
        for names, p in ordered:
            entries.append(Entry(tuple(names), tuple(p.shape), offset, p.numel()))
            offset = round_up(offset + p.numel(), ALIGN_ELEMENTS)
            if takes_weight_decay(p):
                decay_end = offset
        return cls(tuple(entries), offset, decay_end, dtypes.pop()), [p for _, p in ordered]

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every parameter name (aliases included) -> its view into ``flat``."""
        out = {}
        for e in self.entries:
            view = flat[e.offset : e.offset + e.numel].view(e.shape)
            for name in e.names:
                out[name] = view
        return out

    def pack(self, params: list[torch.Tensor], flat: torch.Tensor) -> None:
        """Copy parameter values (in layout order) into ``flat``; padding becomes 0."""
        flat.zero_()
        for e, p in zip(self.entries, params, strict=True):
            flat[e.offset : e.offset + e.numel].copy_(p.detach().reshape(-1))

    @property
    def num_parameters(self) -> int:
        return sum(e.numel for e in self.entries)


def bind(model: nn.Module, layout: BucketLayout, flat: torch.Tensor) -> None:
    """Make each of the model's parameters a view into ``flat``: the modules then compute
    with whatever the buffer holds, without re-pointing anything per step.

    Each parameter is replaced (at every name it is reachable by, so tied weights stay one
    object) rather than re-pointed, which also works for a skeleton on the meta device.
    """
    bind_entries(model, layout.entries, flat)


def bind_entries(model: nn.Module, entries: Iterable[Entry], flat: torch.Tensor) -> None:
    """``bind`` for entries placed at offsets of their own (a scratch packing some of a
    bucket's runs)."""
    for e in entries:
        param = nn.Parameter(flat[e.offset : e.offset + e.numel].view(e.shape), requires_grad=False)
        for name in e.names:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, param)
