"""distzo's --train-per-class/--dev-per-class/--num-eval draw against LM-BFF's own k-shot
script.

    python benchmarks/k_shot_check.py --mezo path/to/MeZO [--rows train.tsv]
        [--eval-rows dev.tsv] [--k 16 512] [--task cola]

MeZO's copy of LM-BFF's ``tools/generate_k_shot_data.py`` (``medium_models/tools/``) is
read from its checkout with ``ast`` and its functions run as written: its ``main``, in
``--mode k-shot-1k-test`` (MeZO's, whose k-shot train and dev sets are ``k-shot``'s),
reads ``--rows`` (GLUE SST-2's ``train.tsv`` layout: a ``sentence\tlabel`` header, one row
a line; by default ``benchmarks/data/sst2-sample/train.tsv``, which ``sst2_sample.py``
writes) as its ``SST-2/train.tsv`` and ``--eval-rows`` (by default the same 2,000 rows,
more than the 1,000 it keeps) as its ``SST-2/dev.tsv``, and writes the k-shot
``train.tsv`` and ``dev.tsv`` and the 1k ``test.tsv`` of each data seed (13, 21, 42, 87,
100). distzo loads the same files with ``--task sst2`` (a masked LM's rows),
``--train-per-class K --dev-per-class K --num-eval 1000 --train-set-seed SEED``; all
three sets must be the same rows in the same order. ``--task cola``: the same rows
written as GLUE's CoLA files (no header; source, label, original label, sentence), which
the script shuffles in place across its seeds, against ``--task cola``'s draw. (Its
pandas, for the non-GLUE tasks' CSV files, is not needed for these and not imported.)
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
MODE = "k-shot-1k-test"  # MeZO's medium_models/README.md: its data/k-shot-1k-test
TEST_ROWS = 1000  # the most rows that mode keeps of a test file
Sets = tuple[list, list, list]  # training, dev and test rows: (sentence, label) pairs


def lm_bff_sets(
    main: Any, rows: Path, eval_rows: Path, k: int, work: Path, task: str = "sst2"
) -> dict[int, Sets]:
    """LM-BFF's train, dev and test rows of each seed: ``(sentence, label)`` pairs in order."""
    glue = work / "original" / GLUE[task]
    glue.mkdir(parents=True)
    for split, source in (("train", rows), ("dev", eval_rows)):  # its dev split: the test set
        (glue / f"{split}.tsv").write_text(_glue_layout(source.read_text(), task))
    argv = sys.argv
    # its default --seed (100, 13, 21, 42, 87, in that order, as MeZO's data were made):
    # CoLA's lists are shuffled in place seed after seed, so the order matters there
    sys.argv = ["generate_k_shot_data.py", "--task", GLUE[task], "--k", str(k)]
    sys.argv += ["--data_dir", str(work / "original"), "--output_dir", str(work / "out")]
    sys.argv += ["--mode", MODE]
    try:
        main()
    finally:
        sys.argv = argv
    sets = {}
    for seed in SEEDS:
        folder = work / "out" / MODE / GLUE[task] / f"{k}-{seed}"
        split_files = ("train.tsv", "dev.tsv", "test.tsv")
        sets[seed] = tuple(_pairs(folder / name, task) for name in split_files)
    return sets  # type: ignore[return-value]


def _glue_layout(text: str, task: str) -> str:
    """An SST-2 file's text as ``task``'s GLUE file: CoLA's has no header, the label
    second, the sentence last."""
    if task != "cola":
        return text
    pairs = [line.split("\t") for line in text.splitlines()[1:]]
    return "".join(f"gj04\t{label}\t\t{sentence}\n" for sentence, label in pairs)


def _pairs(path: Path, task: str) -> list[tuple[str, int]]:
    if task == "cola":
        fields = [line.split("\t") for line in path.read_text().splitlines()]
        return [(field[3], int(field[1])) for field in fields]
    lines = path.read_text().split("\n")[1:-1]  # its header, and the last line's end
    return [(line.split("\t")[0], int(line.split("\t")[1])) for line in lines]


def distzo_sets(rows: Path, eval_rows: Path, k: int, seed: int, task: str = "sst2") -> Sets:
    sampling = Sampling(seed=seed, train_per_class=k, dev_per_class=k, num_eval=TEST_ROWS)
    loaded = load_task_rows(task, str(rows), str(eval_rows), sampling, masked=True)
    assert loaded is not None
    parts = (loaded.train, loaded.dev, loaded.eval)
    return tuple([(row.sentences[0], row.label) for row in part] for part in parts)  # type: ignore[return-value]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mezo", type=Path, required=True, help="a checkout of MeZO")
    parser.add_argument("--rows", type=Path, default=SAMPLE, help="GLUE SST-2's train.tsv")
    parser.add_argument(
        "--eval-rows", type=Path, default=SAMPLE, help="GLUE SST-2's dev.tsv (default: --rows)"
    )
    parser.add_argument("--k", type=int, nargs="+", default=[16])
    parser.add_argument("--task", choices=sorted(GLUE), default="sst2", help="GLUE layout")
    args = parser.parse_args()
    main_of_lm_bff = lm_bff_main(args.mezo)
    agree = True
    for k in args.k:
        with tempfile.TemporaryDirectory() as work:
            theirs = lm_bff_sets(
                main_of_lm_bff, args.rows, args.eval_rows, k, Path(work), args.task
            )
        for seed in SEEDS:
            ours = distzo_sets(args.rows, args.eval_rows, k, seed, args.task)
            same = [part == their for part, their in zip(ours, theirs[seed], strict=True)]
            agree &= all(same)
            sizes = ", ".join(
                f"{len(part)} {name}{'' if ok else ' DIFFER'}"
                for part, name, ok in zip(ours, ("train", "dev", "test"), same, strict=True)
            )
            print(f"k={k} seed={seed}: {'same' if all(same) else 'DIFFER'} ({sizes})")
    verdict = "AGREE" if agree else "DIFFER"
    print(f"per-class and 1k-test draws vs LM-BFF's generate_k_shot_data.py: {verdict}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
