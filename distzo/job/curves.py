"""``curves.png``: the run's training loss and each evaluation metric by step, one panel
each, drawn from metrics.jsonl and eval.jsonl (so a resumed run's picture covers the
whole run). Rank 0 redraws it at each evaluation, from the loss its logs keep as they
write it (``LossCurve``, metrics.jsonl read once), and at the end.

matplotlib draws through its Agg canvas directly (``Figure`` + ``FigureCanvasAgg``, no
pyplot): the process's backend, pyplot's figures and a user's settings stay as they
were. It is imported on the first drawing, so ``import distzo`` does not pay for it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from distzo.config.field_types import is_of_type

CURVES = "curves.png"
SMOOTH_POINTS = 50  # the training loss's moving mean spans 1/50 of the steps drawn


def eval_metric_names(evals: list[dict[str, Any]]) -> list[str]:
    """The metrics the evaluations hold, in the order they first appear."""
    names: list[str] = []
    for record in evals:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and key not in names:
                names.append(key)
    return names


class LossCurve:
    """The training loss by step as metrics.jsonl holds it, kept as its records are
    written: each evaluation redraws the curves, and reading the file back each time cost
    a dict per step (1 GB and 13 s at each evaluation of a run of a million steps) where
    this keeps 16 bytes a step."""

    def __init__(self) -> None:
        self.steps = array("d")
        self.losses = array("d")

    def add(self, record: dict[str, Any]) -> None:
        """A metrics record's loss (one without a number for its loss and its step adds
        nothing: it draws nothing, and a damaged file's stopped a resume with a KeyError)."""
        if is_of_type(record.get("step"), float) and is_of_type(record.get("loss"), float):
            self.steps.append(float(record["step"]))
            self.losses.append(float(record["loss"]))

    @classmethod
    def of(cls, records: Iterable[dict[str, Any]]) -> LossCurve:
        """The curve of a metrics log's records (``run_logs.iter_records``: one line at a
        time, never the whole file's dicts at once)."""
        curve = cls()
        for record in records:
            curve.add(record)
        return curve


def _moving_mean(values: np.ndarray, window: int) -> np.ndarray:
    """The mean of each ``window`` consecutive values, from running sums: linear in the
    steps (a convolution costs steps x window, and the window is 1/50 of the steps, so a
    run of a million steps took minutes at each evaluation's redraw)."""
    sums = np.concatenate(([0.0], np.cumsum(values, dtype=np.float64)))
    return (sums[window:] - sums[:-window]) / window


def draw_curves(
    path: Path, steps: Sequence[float], losses: Sequence[float], evals: list[dict[str, Any]]
) -> Path:
    """Draw the training loss by step (``LossCurve``'s) and the evaluation records into
    ``path`` (PNG), through a temporary file and a rename."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = eval_metric_names(evals)
    panels = 1 + len(names)
    figure = Figure(figsize=(4.5 * panels, 3.6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, panels, squeeze=False)[0]
    x, loss = np.asarray(steps, dtype=float), np.asarray(losses, dtype=float)
    axes[0].plot(x, loss, color="C0", linewidth=0.6, alpha=0.4, label="each step")
    window = len(loss) // SMOOTH_POINTS
    if window > 1:
        axes[0].plot(
            x[window - 1 :],
            _moving_mean(loss, window),
            color="C0",
            label=f"mean of {window} steps",
        )
    axes[0].set_title("training loss")
    if len(loss):
        axes[0].legend(loc="upper right", fontsize="small")
    for i, (ax, name) in enumerate(zip(axes[1:], names), start=1):
        points = [(r["step"], r[name]) for r in evals if isinstance(r.get(name), (int, float))]
        ax.plot(*zip(*points), marker="o", color=f"C{i}")
        split, _, metric = name.partition("_")  # eval_accuracy, dev_accuracy: the rows scored
        ax.set_title(f"{split} {metric}" if split in ("eval", "dev") else f"eval {name}")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    tmp = path.with_name(path.name + ".tmp")
    figure.savefig(tmp, format="png", dpi=100)
    tmp.replace(path)
    return path
