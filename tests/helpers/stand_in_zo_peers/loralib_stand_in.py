"""A stand-in for loralib (the LoRA paper's package, arXiv 2106.09685) in the tests of
``benchmarks/peer_steps.py --mezo-medium PATH --peft lora``, installed as ``loralib``: its
``Linear`` adds ``(alpha / r) B A x`` to a linear layer, ``A`` Kaiming-uniform and ``B``
zero at init, and with ``merge_weights`` (its default) folds ``B A`` into the weight when
put in eval mode and computes with that weight alone until put back in training mode."""

import math

from torch import nn


class Linear(nn.Linear):
    def __init__(self, in_features, out_features, r=0, lora_alpha=1, merge_weights=True, **kw):
        super().__init__(in_features, out_features, **kw)
        self.r, self.lora_alpha, self.merge_weights, self.merged = (
            r,
            lora_alpha,
            merge_weights,
            False,
        )
        self.lora_A = nn.Parameter(self.weight.new_zeros((r, in_features)))
        self.lora_B = nn.Parameter(self.weight.new_zeros((out_features, r)))
        self.scaling = self.lora_alpha / self.r
        self.weight.requires_grad = False
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def train(self, mode=True):
        super().train(mode)
        if self.merge_weights and self.merged == mode:  # unmerge to train, merge to eval
            sign = -1 if mode else 1
            self.weight.data += sign * (self.lora_B @ self.lora_A) * self.scaling
            self.merged = not mode
        return self

    def forward(self, x):
        out = nn.functional.linear(x, self.weight, self.bias)
        if self.merged:
            return out
        return out + (x @ self.lora_A.T @ self.lora_B.T) * self.scaling
