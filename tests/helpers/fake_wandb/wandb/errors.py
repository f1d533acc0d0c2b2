"""wandb's error classes that distzo catches: ``Error``, the base of wandb's own."""


class Error(Exception):
    """The base of wandb's errors."""


class UsageError(Error):
    """What ``wandb.init`` raises when no API key is configured."""
