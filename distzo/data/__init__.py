"""Tasks and batches."""

from distzo.data.synthetic import CountingTask

__all__ = ["CountingTask"]
