"""Task files the tests write: rows as JSON lines, and a small SST-2-like set; where the
real SST-2 sample lies."""

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# The real rows the learning tests train on: where `python benchmarks/sst2_sample.py` writes
# GLUE SST-2's sample (2,000 training and 500 held-out rows); the tests that need it skip
# without it.
SST2_SAMPLE = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "sst2-sample"
SST2_SAMPLE_MISSING = "needs benchmarks/data/sst2-sample (python benchmarks/sst2_sample.py)"


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> str:
    """``rows`` as a JSON-lines file at ``path``; the path as a --train-file takes it."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def sst2_like(count: int) -> list[dict[str, Any]]:
    """``count`` SST-2-like rows ("review i was fine" or "... poor"; two in three
    positive): a sentence task's rows without a download."""
    return [
        {"sentence": f"review {i} was {'fine' if i % 3 else 'poor'}", "label": int(i % 3 > 0)}
        for i in range(count)
    ]
