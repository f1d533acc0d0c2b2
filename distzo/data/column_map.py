"""``--columns``: a source's columns read under the task's names (``sentence=text`` reads
SetFit/sst5's ``text`` as the task's ``sentence``), so a hub dataset or a file that names a
column otherwise trains as it is, with no rewritten copy of its rows to keep beside it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

# (the task's column, the source's column) pairs, in the order given
ColumnMap = tuple[tuple[str, str], ...]
EXAMPLE = "--columns sentence=text,label=coarse_label"


def parse_columns(spec: str | None) -> ColumnMap:
    """``TASK_COLUMN=SOURCE_COLUMN`` pairs, comma-separated; a malformed pair or a task
    column given twice is a one-line error (checked with the other options, before any
    file or weights are read)."""
    if spec is None:
        return ()
    pairs: dict[str, str] = {}
    for part in spec.split(","):
        ours, equals, theirs = (text.strip() for text in part.partition("="))
        if not equals or not ours or not theirs:
            raise ValueError(
                f"--columns {spec}: {part.strip()!r} is not TASK_COLUMN=SOURCE_COLUMN; write "
                f"e.g. {EXAMPLE}"
            )
        if ours in pairs:
            raise ValueError(
                f"--columns {spec}: the task's column {ours!r} is mapped twice; map it once"
            )
        pairs[ours] = theirs
    return tuple(pairs.items())


def check_columns(columns: ColumnMap, task: str, task_columns: Iterable[str]) -> None:
    """A pair naming a column the task does not read refused in one line naming those it
    does (before any file is read)."""
    known = tuple(task_columns)
    for ours, theirs in columns:
        if ours not in known:
            raise ValueError(
                f"--columns {ours}={theirs}: --task {task} has no column {ours!r}; its columns "
                f"are {', '.join(known)} (write TASK_COLUMN=SOURCE_COLUMN)"
            )


def renamed(
    numbered: Iterable[tuple[int, dict[str, Any]]], columns: ColumnMap, source: str
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Each row with the task's columns read from the source's (the source's kept too); a
    row without a mapped column is a one-line error naming the columns it has, and one whose
    mapped column is null one naming the mapping (the task's check of the column it reads
    would offer the very ``--columns`` given). As the task's own check (``read_whole``),
    it reads the rest of the source before it refuses a row, so the file's own error
    further on (bad JSON, a non-UTF-8 byte) comes first."""
    rows = iter(numbered)
    for number, row in rows:
        problem = _mapping_problem(row, columns)
        if problem:
            for _ in rows:
                pass
            raise ValueError(f"{source}, row {number}: {problem}")
        yield number, row | {ours: row[theirs] for ours, theirs in columns}


def _mapping_problem(row: dict[str, Any], columns: ColumnMap) -> str | None:
    for ours, theirs in columns:
        if theirs not in row:
            names = ", ".join(row)
            return f"no column {theirs!r} (--columns {ours}={theirs}); its columns are {names}"
        if row[theirs] is None:
            return (
                f"column {theirs!r} is empty (null), and --columns {ours}={theirs} reads it as "
                f"{ours!r}; give the row a value or leave the row out"
            )
    return None
