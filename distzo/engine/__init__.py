"""The ZO engine: one step over embed -> streamed blocks -> head."""

from distzo.engine.engine import (
    RESIDENT_BLOCK_ID,
    UNPERTURBED,
    PendingUpdate,
    StepResult,
    ZOEngine,
    bucket_layouts,
    count_tokens,
    resolve_transfer,
    split_layouts,
    unwrap_peft,
)
from distzo.engine.engine import _bucket_range as bucket_range

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
