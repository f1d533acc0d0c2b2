"""The ZO engine: one step over embed -> streamed blocks -> head."""

from distzo.engine.engine import (
    UNPERTURBED,
    StepResult,
    ZOEngine,
    count_tokens,
    resolve_transfer,
)
from distzo.engine.layouts import (
    RESIDENT_BLOCK_ID,
    bucket_layouts,
    bucket_range,
    split_layouts,
    unwrap_peft,
)
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
