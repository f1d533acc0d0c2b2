"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE): Llama's layout with
the MLP replaced by a sparse block of routed experts (Qwen2-MoE's with a shared expert
beside them). The block is the model's own and returns only the hidden states; the router's
logits, which transformers records for its auxiliary load-balancing loss, are not read:
distzo's objective is its own (``distzo.objectives``), so that loss is not part of it."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from distzo.models.llama import LlamaFamily

# The experts' implementation a float64 model computes with: transformers' default,
# ``grouped_mm``, is torch's grouped matmul, which takes 16- and 32-bit floats only.
FLOAT64_EXPERTS = "eager"


class MoEFamily(LlamaFamily):
    model_types: ClassVar[tuple[str, ...]] = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        # a float64 model (--dtype fp64) failed at its first forward: "Expected mat_a to be
        # Float32, BFloat16 or Float16 matrix, got Double"
        if self.model.dtype == torch.float64:
            self.model.set_experts_implementation(FLOAT64_EXPERTS)
