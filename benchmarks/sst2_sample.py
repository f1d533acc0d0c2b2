"""Write the SST-2 sample that ``learning.py`` trains and evaluates on.

    python benchmarks/sst2_sample.py                      # benchmarks/data/sst2-sample
    python benchmarks/sst2_sample.py --out DIR --source hf:nyu-mll/glue:sst2:train

Draws ``--train`` training rows (default 2,000) and ``--heldout`` held-out rows (default
500), disjoint, at random (``--seed``, default 20261123) from GLUE SST-2's training split
(through ``datasets``; ``--source`` may name a local CSV/TSV/JSONL with the columns
``sentence`` and ``label`` instead) and writes them as ``train.tsv`` and ``heldout.tsv``
with a header, the schema of ``--task sst2``. The figures in benchmarks/RESULTS.md used a
sample of this size and seed from that split; the rows drawn here may differ from theirs
(the draw is ``random.Random(seed).sample``), so compare figures within one sample.

An existing folder is never overwritten: both files are written beside it and renamed
into place.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "data" / "sst2-sample"
DEFAULT_SOURCE = "hf:nyu-mll/glue:sst2:train"


def tsv(rows: Sequence[dict[str, Any]]) -> str:
    """Rows as ``sentence<TAB>label`` lines under a header (a tab or newline inside a
    sentence becomes a space: the format has no quoting)."""
    lines = ["sentence\tlabel"]
    for row in rows:
        sentence = " ".join(str(row["sentence"]).replace("\t", " ").splitlines())
        lines.append(f"{sentence}\t{int(row['label'])}")
    return "\n".join(lines) + "\n"


def refuse_existing(out: Path) -> None:
    """A user's folder is never overwritten."""
    if out.exists():
        raise SystemExit(f"sst2_sample.py: {out} exists; remove it or give another --out")


def write_sample(
    rows: Sequence[dict[str, Any]], out: Path, train: int, heldout: int, seed: int
) -> None:
    """Draw ``train`` + ``heldout`` distinct rows of ``rows`` and write the folder ``out``
    (refused if it exists; written whole beside it, then renamed)."""
    refuse_existing(out)
    if train < 1 or heldout < 1:
        raise SystemExit(
            f"sst2_sample.py: --train and --heldout must be >= 1, got {train} and {heldout}"
        )
    if train + heldout > len(rows):
        raise SystemExit(
            f"sst2_sample.py: {train} + {heldout} rows asked for, the source has {len(rows)}; "
            "lower --train or --heldout"
        )
    missing = {"sentence", "label"} - set(rows[0])
    if missing:
        raise SystemExit(
            f"sst2_sample.py: the source's rows lack {', '.join(sorted(missing))}; "
            "give one with the columns sentence and label"
        )
    picked = random.Random(seed).sample(range(len(rows)), train + heldout)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a draw that stopped half-way
    tmp.mkdir(parents=True)
    (tmp / "train.tsv").write_text(tsv([rows[i] for i in picked[:train]]))
    (tmp / "heldout.tsv").write_text(tsv([rows[i] for i in picked[train:]]))
    tmp.rename(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--source", default=DEFAULT_SOURCE, help="hf:PATH[:CONFIG]:SPLIT or a file")
    p.add_argument("--train", type=int, default=2000)
    p.add_argument("--heldout", type=int, default=500)
    p.add_argument("--seed", type=int, default=20261123)
    args = p.parse_args(argv)
    refuse_existing(args.out)  # before the download
    sys.path.insert(0, str(ROOT))
    from distzo.data.loaders import load_rows

    try:
        rows = load_rows(args.source)
    except ValueError as err:
        raise SystemExit(f"sst2_sample.py: {err}") from None
    write_sample(rows, args.out, args.train, args.heldout, args.seed)
    print(f"wrote {args.out}: train.tsv ({args.train} rows), heldout.tsv ({args.heldout} rows)")


if __name__ == "__main__":
    main()
