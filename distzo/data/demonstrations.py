"""MeZO's in-context learning: demonstrations put before every evaluation prompt.

MeZO's ICL baseline (``large_models/icl.sh``: ``run.py --num_train 32 --trainer none``)
trains nothing. Each evaluation row's prompt is preceded by ``num_train`` training rows,
each verbalized with its right candidate (``utils.py``'s ``encode_prompt``:
``template.verbalize(sample, sample.correct_candidate).strip()``), joined by the task's
``train_sep``, ``"\\n\\n"`` for every task, and that separator again before the row's own
prompt. The rows are drawn as ``tasks.py``'s ``sample_train_sets`` draws them:

* without ``--train_set_seed``, one set per evaluation row: the seeds are numpy's
  ``randint(0, 10000, rows)`` under seed 0, and row ``i``'s set is the first ``num_train``
  of a permutation of the training split under seed ``i`` of them (``sample_subset``);
* with ``--train_set_seed S``, one set under ``S`` for every row.

``--num-demos N`` is MeZO's ``--num_train N`` there, and ``--demo-sets`` says which draw:
``per-row`` (its seeds drawn under ``--train-set-seed``, 0 by default, MeZO's fixed 0) or
``shared`` (under ``--train-set-seed``). The evaluation rows themselves are drawn under
``--train-set-seed`` too (``--num-eval``), as MeZO draws them under 0 or ``S``. A
demonstrated row is an ``Example`` like any other, its prompt longer: the encoder cuts it
from the left as MeZO does, keeping the tokenizer's leading special token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from distzo.data.sampling import mezo_draw
from distzo.data.templates import TASKS, Example

TRAIN_SEP = "\n\n"  # MeZO's Dataset.train_sep, which no task of large_models/tasks.py changes
DEMO_SETS = ("per-row", "shared")
SEED_RANGE = 10000  # MeZO's np.random.randint(0, 10000, ...) of the per-row seeds


def demo_seeds(rows: int, seed: int) -> list[int]:
    """The seed of each evaluation row's set: ``sample_train_sets``' numpy ``randint``
    under ``temp_seed(seed)`` (MeZO's ``seed`` is 0)."""
    return np.random.RandomState(seed).randint(0, SEED_RANGE, rows).tolist()


def demo_draws(train_rows: int, eval_rows: int, num: int, sets: str, seed: int) -> list[list[int]]:
    """The training rows each evaluation row is shown, as indices: one set per row
    (``per-row``) or one for all (``shared``), each MeZO's ``sample_subset``."""
    if sets == "shared":
        return [mezo_draw(train_rows, num, seed)] * eval_rows
    seeds = demo_seeds(eval_rows, seed)
    # seeds repeat (10,000 of them): one permutation of the training rows per distinct seed
    drawn = {s: mezo_draw(train_rows, num, s) for s in dict.fromkeys(seeds)}
    return [drawn[s] for s in seeds]


def demonstration(example: Example) -> str:
    """A training row as MeZO shows it: its prompt and right continuation, stripped."""
    return (example.prompt + example.continuations[example.label]).strip()


def demonstrated(demos: Sequence[Example], example: Example) -> Example:
    """``example`` with ``demos`` before its prompt, as ``encode_prompt`` joins them (its
    eval prompt's leading spaces stripped; the end, the candidate's, as it was)."""
    shown = TRAIN_SEP.join(demonstration(d) for d in demos).strip()
    return dataclasses.replace(example, prompt=shown + TRAIN_SEP + example.prompt.lstrip(" "))


def with_demonstrations(
    train: Sequence[Example],
    evals: Sequence[Example],
    num: int,
    sets: str,
    seed: int,
    train_file: str,
) -> list[Example]:
    """Every evaluation row with its ``num`` demonstrations drawn from ``train`` (MeZO's
    ICL); a count the training rows cannot give is one line."""
    if num > len(train):
        raise ValueError(
            f"--num-demos {num} asks more rows than the {len(train)} of --train-file "
            f"{train_file}; give --num-demos {len(train)} or less"
        )
    draws = demo_draws(len(train), len(evals), num, sets, seed)
    return [demonstrated([train[i] for i in d], e) for d, e in zip(draws, evals, strict=True)]


def check_demonstrable(task: str, masked: bool) -> None:
    """``--num-demos`` prepends demonstrations to a causal LM's prompts (MeZO's ICL); a
    masked LM's prompt is scored at its one ``<mask>``, and raw text has no prompt."""
    if masked:
        raise ValueError(
            f"--num-demos puts demonstrations before a causal LM's prompts (MeZO's ICL on "
            f"OPT); a masked LM's --task {task} scores its own <mask> alone: drop --num-demos"
        )
    if task not in TASKS:
        raise ValueError(
            f"--num-demos puts demonstrations before a prompt task's prompts; --task {task} "
            f"has none: drop --num-demos, or pick one of {', '.join(TASKS)}"
        )
