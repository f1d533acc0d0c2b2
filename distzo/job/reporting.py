"""The run's dashboard: ``--report-to tensorboard|wandb|none`` (transformers' ``report_to``).

Rank 0 reports every step's scalars (loss, g, lr, tokens/s, memory, the host link's
GB/s) and every evaluation. TensorBoard writes event files through
``torch.utils.tensorboard`` under ``<run>/tensorboard``; Weights & Biases runs in
whatever mode the environment sets (``WANDB_MODE=offline`` included), one wandb run per
distzo run directory, resumed with it. Each is an optional extra
(``pip install 'distzo[tensorboard]'`` / ``'distzo[wandb]'``); asking for one that is
not installed, or a wandb run that cannot start (not logged in), is a one-line error
before any model is built.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from typing import Any, Protocol

_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


class Reporter(Protocol):
    # Whether a resumed run's earlier reports of its steps from the resumed one on are
    # dropped (the run reports them again; what it keeps from there is reported again).
    purges: bool

    def start(self, resume_step: int) -> None:
        """Begin reporting a run that goes on after ``resume_step`` steps."""

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def drop_from(self, step: int) -> None:
        """Drop the reports of steps from ``step`` on, which the run reports again (an
        evaluation replaced): only a dashboard that ``purges``."""

    def close(self) -> None: ...


def check_reporter(kind: str) -> None:
    """Refuse, in one line, a dashboard whose package is not installed."""
    package = _PACKAGES.get(kind)
    if package is not None and importlib.util.find_spec(package) is None:
        raise ValueError(
            f"--report-to {kind} needs the {package} package: pip install 'distzo[{kind}]', "
            "or drop --report-to"
        )


class TensorBoardReporter:
    purges = True

    def __init__(self, run_dir: Path) -> None:
        self.log_dir = run_dir / "tensorboard"
        self.writer: Any = None

    def start(self, resume_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run's events of its steps from ``resume_step`` on, which it writes
        # again (a diverged run's cut-back steps with another lr, say), are dropped by
        # TensorBoard's readers (purge_step), so that no step is drawn twice.
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=resume_step or None)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)

    def drop_from(self, step: int) -> None:
        """A new events file whose session starts at ``step``: TensorBoard's readers drop
        every earlier event from that step on, as at a resume (``start``)."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer.close()
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbReporter:
    purges = False  # wandb ignores a step below its last one

    def __init__(self, run_dir: Path, config: dict) -> None:
        """The wandb run, started now: one that cannot start (not logged in, no network)
        is a one-line error, and the trainer makes its reporter before any model."""
        import wandb

        # One wandb run per run directory: a resumed or restarted run appends to it.
        run_id = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]
        try:
            self.run = wandb.init(
                project="distzo",
                name=run_dir.name,
                id=run_id,
                resume="allow",
                dir=str(run_dir),
                config=config,
            )
        except wandb.errors.Error as err:
            raise ValueError(
                f"--report-to wandb could not start its run ({err}): log in (wandb login), "
                "set WANDB_MODE=offline, or drop --report-to"
            ) from None

    def start(self, resume_step: int) -> None:
        """Nothing to do: the run resumes by its id."""

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def drop_from(self, step: int) -> None:
        """Never called (``purges`` is False): a wandb run keeps what it logged."""

    def close(self) -> None:
        self.run.finish()


def make_reporter(kind: str, run_dir: Path, config: dict) -> Reporter | None:
    """The dashboard ``--report-to`` names (``start`` it once the resumed step is known)."""
    if kind == "tensorboard":
        return TensorBoardReporter(run_dir)
    if kind == "wandb":
        return WandbReporter(run_dir, config)
    return None
