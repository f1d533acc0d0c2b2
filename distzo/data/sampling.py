"""MeZO's sampled sets: ``--num-train``, ``--num-dev``, ``--num-eval`` and
``--train-set-seed`` draw a run's rows from its files as MeZO's ``run.py`` does.

MeZO (``large_models/tasks.py``) seeds numpy's global generator with the train-set seed
and takes the first rows of ``np.random.permutation`` of a split: ``num_train + num_dev``
rows of the training split, the dev rows being the last ``num_dev`` of them (cut from the
sample, never from the rest of the file), and ``num_eval`` rows of the validation split
under the same seed. ``numpy.random.RandomState(seed)`` is that generator seeded that way,
so given the same rows in the same order (GLUE's splits through ``datasets``) the draw is
MeZO's row for row. Where MeZO asks more rows than a split holds it takes them all; here
that is a one-line error naming the file's count, since a count that silently means
"all" would record a run's size wrongly.

Beside ``--train-per-class`` (LM-BFF's k-shot sets, MeZO's RoBERTa runs) ``--num-eval``
draws LM-BFF's 1k-test rows instead (``per_class.lm_bff_test_draw``: seed 42, and a file
of N rows or fewer whole, as that script takes it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from distzo.data.per_class import example_labels, lm_bff_test_draw, per_class_draw

Row = TypeVar("Row")
SEED_LIMIT = 2**32  # numpy's legacy generator takes seeds below this


@dataclass(frozen=True)
class Sampling:
    """The sampling options; a count of None takes the file whole, as without sampling."""

    num_train: int | None = None
    num_dev: int | None = None
    num_eval: int | None = None
    seed: int = 0  # --train-set-seed
    train_per_class: int | None = None  # LM-BFF's k-shot draw (``distzo.data.per_class``)
    dev_per_class: int | None = None
    num_demos: int | None = None  # MeZO's ICL (``distzo.data.demonstrations``)
    demo_sets: str = "per-row"

    @property
    def samples(self) -> bool:
        """Whether any set is drawn (else every file's rows are taken as they are)."""
        counts = (self.num_train, self.num_dev, self.num_eval, self.train_per_class)
        return counts != (None, None, None, None) or self.num_demos is not None


WHOLE_FILES = Sampling()


def mezo_draw(count: int, wanted: int, seed: int) -> list[int]:
    """The indices MeZO's ``sample_subset`` takes: the first ``wanted`` of a permutation of
    ``count`` rows drawn by numpy's generator seeded with ``seed``."""
    return np.random.RandomState(seed).permutation(count)[:wanted].tolist()


def sample_sets(
    train: list[Row],
    evals: list[Any],
    sampling: Sampling,
    train_file: str,
    eval_file: str,
    num_labels: int = 0,
    task: str = "",
) -> tuple[list[Row], list[Row], list[Any]]:
    """The training, dev and evaluation rows ``sampling`` draws from the files' rows
    (``num_labels``, ``task``: the task's, for a draw per class of built rows)."""
    dev: list[Row] = []
    if sampling.train_per_class is not None:
        train, dev = per_class_draw(
            train,
            example_labels(train),
            num_labels,
            sampling.train_per_class,
            sampling.dev_per_class or 0,
            sampling.seed,
            train_file,
            task,
        )
    elif (sampling.num_train, sampling.num_dev) != (None, None):
        dev_count = sampling.num_dev or 0
        # without --num-train, every row is drawn and the last --num-dev of them are dev
        wanted = len(train) if sampling.num_train is None else sampling.num_train + dev_count
        if wanted > len(train) or dev_count >= len(train):
            raise ValueError(_too_many(sampling, len(train), train_file))
        drawn = [train[i] for i in mezo_draw(len(train), wanted, sampling.seed)]
        train, dev = drawn[: wanted - dev_count], drawn[wanted - dev_count :]
    if sampling.num_eval is not None and sampling.train_per_class is not None:
        drawn_eval = lm_bff_test_draw(len(evals), sampling.num_eval, sampling.seed, task)
        evals = [evals[i] for i in drawn_eval]
    elif sampling.num_eval is not None:
        if sampling.num_eval > len(evals):
            raise ValueError(
                f"--num-eval {sampling.num_eval} asks more rows than the {len(evals)} of "
                f"--eval-file {eval_file}; give --num-eval {len(evals)} or less (MeZO's "
                "run.py takes them all where it asks more)"
            )
        evals = [evals[i] for i in mezo_draw(len(evals), sampling.num_eval, sampling.seed)]
    return train, dev, evals


def _too_many(sampling: Sampling, rows: int, train_file: str) -> str:
    """The one line for training and dev counts that the training file cannot give."""
    dev = sampling.num_dev or 0
    if sampling.num_train is None:
        return (
            f"--num-dev {dev} leaves no training rows of the {rows} of --train-file "
            f"{train_file}; give --num-dev {rows - 1} or less"
        )
    asked = f"--num-train {sampling.num_train}" + (f" and --num-dev {dev}" if dev else "")
    room = max(rows - dev, 0)
    fix = f"give --num-train {room} or less" if room else _dev_fix(sampling.num_train, rows)
    taken = f": {room} to train, {dev} dev" if dev and room else ""
    return (
        f"{asked} {'ask' if dev else 'asks'} {sampling.num_train + dev} rows, more than the "
        f"{rows} of --train-file {train_file}; {fix} (MeZO's run.py takes the {rows} there "
        f"are{taken})"
    )


def _dev_fix(num_train: int, rows: int) -> str:
    """The fix where --num-dev alone fills the file: the dev count that leaves room for
    --num-train's rows, so that following it is not refused again."""
    if num_train < rows:
        return f"give --num-dev {rows - num_train} or less"
    return f"give a --num-train and --num-dev that add up to {rows} or less"
