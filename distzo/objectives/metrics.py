"""SQuAD's answer metrics (the official script's normalisation), and the answer a
generation stands for: its text up to the first newline (MeZO stops decoding there, and at
the end-of-sequence token, which the ``decode`` it is given cuts at)."""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Callable, Sequence


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, gold: str) -> float:
    """Token F1 as SQuAD v1.1's script and MeZO score it: no token in common is 0, also
    where both sides normalise to nothing (v2.0 would give 1 there, as exact match does)."""
    predicted, truth = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum((collections.Counter(predicted) & collections.Counter(truth)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(truth)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def answer_text(decode: Callable[[Sequence[int]], str], ids: Sequence[int]) -> str:
    """The generated text up to its first newline, stripped."""
    return decode(ids).split("\n")[0].strip()
