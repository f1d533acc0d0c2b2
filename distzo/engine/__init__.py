"""The ZO engine: one step over embed -> streamed blocks -> head."""

from distzo.engine.engine import PendingUpdate, StepResult, ZOEngine

__all__ = ["PendingUpdate", "StepResult", "ZOEngine"]
