"""A linear layer whose batch is split into passes, each with its own weight (P-RGE's
dual-forward LoRA: one forward computes the +eps and -eps losses, and those of several
queries, reading the frozen base weights once).

The engine turns the trainable LoRA factors (``lora_A`` / ``lora_B`` of peft, plain
``nn.Linear`` without bias) into this class in place: while ``stacked`` holds
``(passes, out, in)`` weights, a ``(passes * b, ..., in)`` input is computed as one
batched matrix product per pass slice, rows ``[k b, (k + 1) b)`` with weight ``k``;
otherwise it is the plain linear layer it was.
"""

from __future__ import annotations

import torch
from torch import nn


class PassBatchedLinear(nn.Linear):
    stacked: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.stacked
        if weights is None:
            return super().forward(x)
        passes, out_features, in_features = weights.shape
        rows = x.reshape(passes, -1, in_features)  # the passes' slices, each b * T rows
        y = torch.bmm(rows, weights.transpose(1, 2))
        return y.reshape(*x.shape[:-1], out_features)


def make_pass_batched(module: nn.Module, attr: str = "weight", name: str = "") -> PassBatchedLinear:
    """Turn a bias-free ``nn.Linear`` whose trained tensor is ``attr`` into a
    ``PassBatchedLinear`` (the same object, the same parameters); anything else is refused,
    naming the trained tensor ``name``."""
    if type(module) is PassBatchedLinear and attr == "weight":
        return module
    if type(module) is not nn.Linear or module.bias is not None or attr != "weight":
        kind = type(module).__name__ + (" with a bias" if isinstance(module, nn.Linear) else "")
        raise ValueError(
            "batched passes need the trained tensors to be bias-free linear factors "
            f"(LoRA's A and B), got {name or attr} of a {kind}; train --peft lora, lora-fa "
            "or prefix without such tensors, or drop --dual-forward and --batch-queries"
        )
    module.__class__ = PassBatchedLinear
    return module
