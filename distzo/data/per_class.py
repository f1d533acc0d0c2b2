"""LM-BFF's k-shot sets, which MeZO's RoBERTa runs train on: ``--train-per-class K`` and
``--dev-per-class D`` draw K training rows and D dev rows of each label.

LM-BFF's ``tools/generate_k_shot_data.py`` seeds numpy's global generator with the data
seed (13, 21, 42, 87, 100), shuffles the training split's rows with ``np.random.shuffle``,
groups the shuffled rows by label (the labels in the order they first come), and writes
the first K of each label as the training set and the next K (``[K:2K]``) as the dev set.
``numpy.random.RandomState(seed).permutation(n)`` shuffles ``range(n)`` with the same
draws, so given the same rows in the same order the sets are LM-BFF's row for row, in its
files' order (``benchmarks/k_shot_check.py`` runs its code on the same rows and compares).
One exception: GLUE's CoLA ``train.tsv`` has no header, so the script shuffles that file's
own list in place, once per seed of its default order (100, 13, 21, 42, 87): CoLA's set of
seed 13 is the shuffle of 13 applied to the shuffle of 100, and so on (``_lm_bff_order``).

Its ``--mode k-shot-1k-test`` (the evaluation rows of MeZO's RoBERTa table) also cuts the
test set, a GLUE task's dev file, to 1,000 rows: ``lm_bff_test_draw``, which ``--num-eval``
beside ``--train-per-class`` takes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

Row = TypeVar("Row")

LM_BFF_SEEDS = (100, 13, 21, 42, 87)  # generate_k_shot_data.py's default --seed, in its order
# tasks whose training and dev lists the script shuffles in place across its seeds
# (split_header returns the list itself where a GLUE file has no header line: CoLA's)
IN_PLACE_TASKS = ("cola",)
LM_BFF_TEST_SEED = 42  # the 1k-test mode's np.random.seed (and pandas' random_state)


def per_class_draw(
    rows: Sequence[Row],
    labels: Sequence[int],
    num_labels: int,
    train_per_class: int,
    dev_per_class: int,
    seed: int,
    train_file: str,
    task: str = "",
) -> tuple[list[Row], list[Row]]:
    """The training and dev rows: of each label, the first ``train_per_class`` of the
    seeded shuffle and the ``dev_per_class`` after them. A label with fewer rows than that
    (none, say, where a file lacks a class) is refused in one line naming it."""
    wanted = train_per_class + dev_per_class
    counts = Counter(labels)
    counts.update({label: 0 for label in range(num_labels)})  # a label no row has: 0
    short = [(label, counts[label]) for label in sorted(counts) if counts[label] < wanted]
    if short:
        raise ValueError(_too_few(short, train_per_class, dev_per_class, train_file))
    groups: dict[int, list[int]] = {}  # by label, in the order each label first comes
    for index in _lm_bff_order(len(rows), seed, task):
        group = groups.setdefault(labels[index], [])
        if len(group) < wanted:
            group.append(index)
    train = [rows[i] for group in groups.values() for i in group[:train_per_class]]
    dev = [rows[i] for group in groups.values() for i in group[train_per_class:]]
    return train, dev


def _lm_bff_order(count: int, seed: int, task: str) -> list[int]:
    """The row indices in the order LM-BFF's shuffle leaves them for ``seed``: its one
    shuffle, or, for a task shuffled in place (CoLA), those of every default seed up to
    ``seed`` in the script's order (a seed outside them: its own shuffle alone)."""
    seeds = [seed]
    if task in IN_PLACE_TASKS and seed in LM_BFF_SEEDS:
        seeds = list(LM_BFF_SEEDS[: LM_BFF_SEEDS.index(seed) + 1])
    return _shuffled(count, seeds)


def lm_bff_test_draw(count: int, wanted: int, seed: int, task: str = "") -> list[int]:
    """The indices of the test rows LM-BFF's ``--mode k-shot-1k-test`` writes for the data
    seed ``seed`` (``wanted``: its 1,000): MeZO's RoBERTa table reports those, not a draw
    of the data seed. A file of more than ``wanted`` rows is shuffled under seed 42 whatever
    the data seed (GLUE's ``np.random.shuffle``; the other tasks' ``DataFrame.sample(n,
    random_state=42)``, numpy's ``permutation(count)[:n]`` too) and its first ``wanted``
    kept; one of ``wanted`` or fewer is whole, in its order (the script's ``len > 1000``).
    CoLA's dev file, headerless, is shuffled in place once per seed of the script's order,
    so a seed's set is that shuffle applied once per seed up to it (13's: twice)."""
    if count <= wanted:
        return list(range(count))
    times = 1
    if task in IN_PLACE_TASKS and seed in LM_BFF_SEEDS:
        times = LM_BFF_SEEDS.index(seed) + 1
    return _shuffled(count, [LM_BFF_TEST_SEED] * times)[:wanted]


def _shuffled(count: int, seeds: list[int]) -> list[int]:
    """The indices of ``count`` rows after numpy's seeded shuffles of one list, in turn."""
    order = np.arange(count)
    for each in seeds:  # list[i] = previous[perm[i]]: the shuffles compose as indices
        order = order[np.random.RandomState(each).permutation(count)]
    return order.tolist()


def _too_few(short: list[tuple[int, int]], train: int, dev: int, train_file: str) -> str:
    """The line for labels the file holds too few rows of: each with its count."""
    asked = f"--train-per-class {train}" + (f" and --dev-per-class {dev}" if dev else "")
    labels = ", ".join(f"label {label} has {count}" for label, count in short)
    fewest = min(count for _, count in short)
    if dev == train and fewest >= 2:  # LM-BFF's sets: as many dev rows as training rows
        fix = f"give --train-per-class and --dev-per-class {fewest // 2} or less"
    elif fewest > dev:
        fix = f"give --train-per-class {fewest - dev} or less"
    else:
        fix = "add rows of that label"
    return (
        f"{asked} {'ask' if dev else 'asks'} {train + dev} rows of each label, but in "
        f"--train-file {train_file} "
        f"{labels}; {fix} (LM-BFF's draw takes K of every label)"
    )


def example_labels(rows: Sequence[Any]) -> list[int]:
    """Each built row's label (an ``Example``'s or a ``MaskedExample``'s)."""
    return [row.label for row in rows]
