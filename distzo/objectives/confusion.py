"""GLUE's metrics of a two-label task, read off its confusion counts: CoLA's Matthews
correlation (``mcc``) and MRPC's and QQP's F1 of label 1 (``f1``), the figures LM-BFF's
``glue_compute_metrics`` reports and MeZO's RoBERTa runs choose their best dev step by.

Neither is a mean over examples, so ranks cannot average their own: each counts its true
and false positives and negatives (``confusion_counts``, on the device), the counts are
summed over the ranks, and the metric is read off the sums once (``binary_metric``).
Where the metric's denominator is zero (every pick one label) it is 0.0, as scikit-learn's
``matthews_corrcoef`` and ``f1_score`` give it: a model that picks one label is no better
than chance, and a NaN would stop the run as broken weights do.
"""

from __future__ import annotations

import math

import torch

# The metrics of a two-label task besides accuracy, by the name its records take
# (``eval_mcc``, ``dev_f1``); label 1, the second candidate, is the positive class.
BINARY_METRICS = ("mcc", "f1")
POSITIVE = 1


def confusion_counts(scores: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """[4] int64 on ``scores``' device: true positives, false positives, false negatives
    and true negatives of the picks (the argmax of ``scores`` [E, 2], the first on ties,
    as ``hits`` picks) against the labels (the right candidate of ``right`` [E, 2])."""
    picked = scores.argmax(dim=1) == POSITIVE
    gold = right[:, POSITIVE].bool()
    return torch.stack(
        [
            (picked & gold).sum(),
            (picked & ~gold).sum(),
            (~picked & gold).sum(),
            (~picked & ~gold).sum(),
        ]
    ).long()


def matthews_correlation(tp: float, fp: float, fn: float, tn: float) -> float:
    """The Matthews correlation of the picks and the labels, in [-1, 1]; 0.0 where a
    margin is empty (no pick or no label of one class)."""
    denominator = (tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)
    return (tp * tn - fp * fn) / math.sqrt(denominator) if denominator else 0.0


def positive_f1(tp: float, fp: float, fn: float) -> float:
    """F1 of label 1: 2 TP / (2 TP + FP + FN); 0.0 where no pick and no label is 1."""
    denominator = 2 * tp + fp + fn
    return 2 * tp / denominator if denominator else 0.0


def binary_metric(name: str, counts: list[float]) -> float:
    """Metric ``name`` (one of ``BINARY_METRICS``) of the summed ``confusion_counts``."""
    tp, fp, fn, tn = counts
    if name == "mcc":
        return matthews_correlation(tp, fp, fn, tn)
    if name == "f1":
        return positive_f1(tp, fp, fn)
    raise ValueError(f"no binary metric {name!r}; choose one of {', '.join(BINARY_METRICS)}")
