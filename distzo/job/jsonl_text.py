"""The run's JSON-lines logs (the seed log, metrics.jsonl, eval.jsonl): how their bytes
are cut into lines and decoded, and which lines are step records. Every reader (a resume's
checks, its catch-up and cut, a replay, the summary) asks here, so that none takes a line
for a step that another skips: a resume that caught up with ``{"step": true}`` as step 1
then cut it from the log as no step, leaving a gap its next resume refused.

Writers emit ASCII JSON, so a log is read as UTF-8 whatever the locale: a line that is
not UTF-8 text (a damaged or hostile file's) is no record."""

from __future__ import annotations

import json
from typing import Any

from distzo.runtime import json_text

LOG_ENCODING = "utf-8"  # what a log is read as (its writers' ASCII JSON is UTF-8)


def log_lines(raw: bytes) -> list[bytes]:
    """``raw`` cut into lines as ``read_text`` would cut them (universal newlines: "\\r\\n"
    and "\\r" end a line too), without their ends; the last is what follows the last line
    end ("" when the file is whole, else a line a crash tore). Cut as bytes, so that a line
    that is not text spoils only itself."""
    return raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")


def as_read_text(raw: bytes) -> str:
    """``raw`` as ``read_text`` reads it, in ``LOG_ENCODING``: decoded (a
    ``UnicodeDecodeError`` where it is not text), with universal newlines."""
    return raw.decode(LOG_ENCODING).replace("\r\n", "\n").replace("\r", "\n")


def as_rewritten(raw: bytes) -> bool:
    """Whether ``raw`` is what writing its lines back, each ended by a newline, writes: no
    torn last line and no carriage return (which the read turns into a newline)."""
    return (not raw or raw.endswith(b"\n")) and b"\r" not in raw


def line_record(line: bytes | str) -> dict[str, Any] | None:
    """The record a log's line holds: a JSON object in UTF-8 text; None for any other line
    (not text, not JSON, a torn one, another JSON value)."""
    try:
        text = line.decode(LOG_ENCODING) if isinstance(line, bytes) else line
        record = json_text.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


def record_step(record: Any) -> int | None:
    """The step of a step record: its ``step``, a whole number >= 0 (as distzo writes it);
    None for anything else (a header; ``true``, ``1.0`` or ``-1``, which no run writes)."""
    step = record.get("step") if isinstance(record, dict) else None
    if type(step) is not int or step < 0:
        return None
    return step
