"""The export's tensors under the keys ``save_pretrained`` writes: the checkpoint's own.

transformers converts some checkpoints as it loads them (a mixture's experts, stored one
a key, become fused 3-D parameters such as ``mlp.experts.gate_up_proj``) and converts them
back as it saves (``revert_weight_conversion``), so what it writes is what transformers 4.x,
vLLM's loaders and llama.cpp's converter read. The export does the same, by that very
function, one parameter at a time so the write stays streamed: reverting a fused parameter
needs only itself (a test holds each family distzo trains to it). A parameter's keys go
in its shard together, as ``save_pretrained`` keeps tensors of one storage together. For a
model transformers does not convert, both are the identity."""

from __future__ import annotations

import torch
from torch import nn


def original_tensors(model: nn.Module, name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """Parameter ``name`` of ``model`` (a transformers model, perhaps a meta skeleton) as
    the tensors ``save_pretrained`` writes for it, by key: itself, or a fused parameter's
    per-expert slices (views of ``value``; meta for a meta ``value``)."""
    from transformers import PreTrainedModel
    from transformers.core_model_loading import revert_weight_conversion

    if not isinstance(model, PreTrainedModel):  # no conversion of transformers' to revert
        return {name: value}
    reverted = revert_weight_conversion(model, {name: value})
    return {key: tensor.contiguous() for key, tensor in reverted.items()}


def original_keys(model: nn.Module, shapes: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Each parameter of ``shapes`` (meta tensors by name) with the keys it is written
    under."""
    return {name: list(original_tensors(model, name, shape)) for name, shape in shapes.items()}
