"""Options: the engine's (``ZOConfig``), the training job's tree, and the command line's errors."""

from distzo.config.engine_options import ZOConfig

__all__ = ["ZOConfig"]
