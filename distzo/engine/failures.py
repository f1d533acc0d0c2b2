"""Whether an engine may go on after a failure.

A pass that fails while it writes the buckets leaves some updated and others not: the
engine refuses every later call until a state is loaded. A failure that wrote nothing (a
measure's bug, a refused batch, a pass that had no update to take) leaves every bucket as
it was, and the engine goes on.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class FailureLatch:
    """Closed by a failure while writing; opened again by a loaded state."""

    def __init__(self) -> None:
        self.reason: str | None = None  # the failure that left the buckets half-written

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Refuse to run the body after a pass failed half-way."""
        if self.reason is not None:
            raise RuntimeError(
                f"the engine is unusable after an earlier failure ({self.reason}); "
                "reload a checkpoint with load_state_dict"
            )
        yield

    @contextmanager
    def writing(self, writes: bool = True) -> Iterator[None]:
        """Close the latch if the body fails while it ``writes`` the buckets; a body that
        only reads them leaves them whole."""
        try:
            yield
        except BaseException as exc:
            if writes:
                self.reason = f"{type(exc).__name__}: {exc}"
            raise

    def reset(self) -> None:
        """A state was loaded into every bucket: the engine is whole again."""
        self.reason = None
