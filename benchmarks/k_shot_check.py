"""distzo's --train-per-class/--dev-per-class draw against LM-BFF's own k-shot script.

    python benchmarks/k_shot_check.py --mezo path/to/MeZO [--rows train.tsv] [--k 16 512]
        [--task cola]

MeZO's copy of LM-BFF's ``tools/generate_k_shot_data.py`` (``medium_models/tools/``) is
read from its checkout with ``ast`` and its functions run as written: its ``main`` reads
``--rows`` (GLUE SST-2's ``train.tsv`` layout: a ``sentence\\tlabel`` header, one row a
line; by default ``benchmarks/data/sst2-sample/train.tsv``, which ``sst2_sample.py``
writes) as its ``SST-2/train.tsv``, and writes the k-shot ``train.tsv`` and ``dev.tsv`` of
each data seed (13, 21, 42, 87, 100). distzo loads the same file with ``--task sst2``
(a masked LM's rows), ``--train-per-class K --dev-per-class K --train-set-seed SEED``;
both must give the same rows in the same order. ``--task cola``: the same rows written as
GLUE's CoLA ``train.tsv`` (no header; source, label, original label, sentence), which the
script shuffles in place across its seeds, against ``--task cola``'s draw. (Its pandas, for
the non-GLUE tasks' CSV files, is not needed for these and not imported.)
"""

from __future__ import annotations

import argparse
import ast
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distzo.data.sampling import Sampling  # noqa: E402
from distzo.data.task_data import load_task_rows  # noqa: E402

SEEDS = (13, 21, 42, 87, 100)  # LM-BFF's and MeZO's data seeds
SAMPLE = Path(__file__).resolve().parent / "data" / "sst2-sample" / "train.tsv"


def lm_bff_main(checkout: Path) -> Any:
    """``generate_k_shot_data.py``'s ``main`` and the functions it calls, compiled from
    MeZO's copy (its imports but pandas': numpy, os, argparse)."""
    source = checkout / "medium_models" / "tools" / "generate_k_shot_data.py"
    tree = ast.parse(source.read_text(), filename=str(source))
    functions: list[ast.stmt] = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    import argparse as argparse_module
    import os

    import numpy

    namespace: dict[str, Any] = {"np": numpy, "os": os, "argparse": argparse_module}
    namespace |= {"pd": None, "DataFrame": None}
    exec(compile(ast.Module(body=functions, type_ignores=[]), str(source), "exec"), namespace)
    return namespace["main"]


GLUE = {"sst2": "SST-2", "cola": "CoLA"}


def lm_bff_sets(
    main: Any, rows: Path, k: int, work: Path, task: str = "sst2"
) -> dict[int, tuple[list, list]]:
    """LM-BFF's train and dev rows of each seed: ``(sentence, label)`` pairs in order."""
    glue = work / "original" / GLUE[task]
    glue.mkdir(parents=True)
    text = rows.read_text()
    if task == "cola":  # GLUE's CoLA layout: no header, the label second, the text last
        pairs = [line.split("\t") for line in text.splitlines()[1:]]
        text = "".join(f"gj04\t{label}\t\t{sentence}\n" for sentence, label in pairs)
    for split in ("train", "dev"):  # its main writes the dev split as the test set
        (glue / f"{split}.tsv").write_text(text)
    argv = sys.argv
    # its default --seed (100, 13, 21, 42, 87, in that order, as MeZO's data were made):
    # CoLA's list is shuffled in place seed after seed, so the order matters there
    sys.argv = ["generate_k_shot_data.py", "--task", GLUE[task], "--k", str(k)]
    sys.argv += ["--data_dir", str(work / "original"), "--output_dir", str(work / "out")]
    try:
        main()
    finally:
        sys.argv = argv
    sets = {}
    for seed in SEEDS:
        folder = work / "out" / "k-shot" / GLUE[task] / f"{k}-{seed}"
        sets[seed] = (_pairs(folder / "train.tsv", task), _pairs(folder / "dev.tsv", task))
    return sets


def _pairs(path: Path, task: str) -> list[tuple[str, int]]:
    if task == "cola":
        fields = [line.split("\t") for line in path.read_text().splitlines()]
        return [(field[3], int(field[1])) for field in fields]
    lines = path.read_text().split("\n")[1:-1]  # its header, and the last line's end
    return [(line.split("\t")[0], int(line.split("\t")[1])) for line in lines]


def distzo_sets(rows: Path, k: int, seed: int, task: str = "sst2") -> tuple[list, list]:
    sampling = Sampling(seed=seed, train_per_class=k, dev_per_class=k)
    loaded = load_task_rows(task, str(rows), str(rows), sampling, masked=True)
    assert loaded is not None
    return tuple(  # type: ignore[return-value]
        [(row.sentences[0], row.label) for row in part] for part in (loaded.train, loaded.dev)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mezo", type=Path, required=True, help="a checkout of MeZO")
    parser.add_argument("--rows", type=Path, default=SAMPLE, help="GLUE SST-2's train.tsv")
    parser.add_argument("--k", type=int, nargs="+", default=[16])
    parser.add_argument("--task", choices=sorted(GLUE), default="sst2", help="GLUE layout")
    args = parser.parse_args()
    main_of_lm_bff = lm_bff_main(args.mezo)
    agree = True
    for k in args.k:
        with tempfile.TemporaryDirectory() as work:
            theirs = lm_bff_sets(main_of_lm_bff, args.rows, k, Path(work), args.task)
        for seed in SEEDS:
            ours = distzo_sets(args.rows, k, seed, args.task)
            same = ours == theirs[seed]
            agree &= same
            sizes = f"{len(ours[0])} train, {len(ours[1])} dev"
            print(f"k={k} seed={seed}: {'same' if same else 'DIFFER'} ({sizes})")
    print(f"per-class draw vs LM-BFF's generate_k_shot_data.py: {'AGREE' if agree else 'DIFFER'}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
