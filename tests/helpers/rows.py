"""Task files the tests write: rows as JSON lines, and a small SST-2-like set."""

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


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
