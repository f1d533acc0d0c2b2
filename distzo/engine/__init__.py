"""The ZO engine: one step over embed -> streamed blocks -> head.

``engine`` holds ``ZOEngine`` (the step and the forward); ``parts`` assembles it from
``layouts`` (which parameter goes into which bucket), ``build`` (transfer, noise, stores,
moments), ``scratch`` (the buffers the model computes with; ``resident_sides``: the
embedding and an untied head taking turns in the resident one; ``module_scratch`` and
``vocab_slices``: a block, and those sides, perturbed a module or a vocabulary slice at a
time) and ``tuning`` (full tuning or an adapter on a frozen base). ``updates`` holds the
update not yet applied and the momentum, ``passes`` one pass over the blocks,
``rebuilt_master`` a low-bit block's master rebuilt a chunk at a time, ``state`` reading
back, saving and loading, ``batches`` what the engine reads of a batch, ``failures``
whether it may go on after a failure.
"""

from distzo.engine.build import resolve_transfer
from distzo.engine.engine import StepResult, ZOEngine, count_tokens
from distzo.engine.layouts import (
    RESIDENT_BLOCK_ID,
    bucket_layouts,
    bucket_range,
    split_layouts,
    unwrap_peft,
)
from distzo.engine.passes import UNPERTURBED
from distzo.engine.updates import PendingUpdate

__all__ = [
    "RESIDENT_BLOCK_ID",
    "UNPERTURBED",
    "PendingUpdate",
    "StepResult",
    "ZOEngine",
    "bucket_layouts",
    "bucket_range",
    "count_tokens",
    "resolve_transfer",
    "split_layouts",
    "unwrap_peft",
]
