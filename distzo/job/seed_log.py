"""The seed log, ``seedlog.jsonl``: the run's header, then one record per step.

A ZO run is its starting weights plus, per step, ``(step, c per query, lr)``: the noise
is regenerated from the run seed, and the c_j are the update's coefficients of z_j
(``projected_grads``: SPSA's projected gradients, FZOO's normalised differences), so a
log replays whatever estimator made them. So the log is both what ``distzo.replay`` rebuilds a
model from and what a restarted run catches up with after its last checkpoint, with no
forward pass and no data. It is written so that a crash cannot leave a half-written
record that reads as a step: each record is one line appended and flushed, and synced to
disk every ``sync_every`` records, off the training's path; a reader drops a torn last
line (with a warning).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from distzo.adapters.peft_adapters import AdapterSpec
from distzo.config.cli import names_file
from distzo.config.engine_options import ZOConfig, optimizer_record
from distzo.config.field_types import is_of_type
from distzo.config.job import SEED_LOG_NAME
from distzo.job.jsonl_text import (
    as_read_text,
    as_rewritten,
    line_record,
    log_lines,
    record_step,
)
from distzo.models import hub
from distzo.runtime import json_text
from distzo.runtime.file_state import file_state

logger = logging.getLogger(__name__)

SEED_LOG = SEED_LOG_NAME  # its name in the run directory

# Header fields a continuing run must share with the log: they change the trajectory.
TRAJECTORY_FIELDS = (
    "run_seed",
    "noise",
    "lowrank",
    "noise_chunk",
    "weight_decay",
    "dtype",
    "transfer_dtype",
    "peft",
    "optimizer",
    "estimator",
)
# What a header without a field (one from before it existed) means. ``first_step``: the
# step the log's records begin at, past 0 when the run went on from a checkpoint copied into
# a directory without the log of the steps before it. A log from before noise kinds was
# drawn by the legacy generator (as its checkpoints, ``checkpoint_noise``), one from before
# optimizers by ZO-SGD (``optimizer_record`` fills in what an older record lacks).
HEADER_DEFAULTS: dict[str, Any] = {"estimator": "spsa", "first_step": 0, "noise": "legacy"}
# The type of each header field a reader takes apart (None: not recorded), so that a
# hostile or damaged header is one line rather than a traceback deep in a replay or resume.
HEADER_TYPES: dict[str, type] = {
    "first_step": int,
    "base": str,
    "base_revision": str,
    "data_commits": dict,
    "model_config": str,
    "model": dict,
    "optimizer": dict,
    "peft": dict,
    "lowrank": dict,
    "export_shard_size": str,
}
TYPE_NAMES = {int: "a whole number", str: "a string", dict: "a JSON object"}


class SeedLogWriter:
    """Appends records to the log, each flushed (a crash of the process loses none), and
    synced to disk every ``sync_every`` records (1: each) by a thread of its own: an fsync
    on a network filesystem takes milliseconds to seconds, and rank 0 waiting for it would
    make every rank wait at the next step's all-reduce. A failed sync is raised by the
    next ``write`` (or by ``close``, which syncs everything itself)."""

    def __init__(self, path: Path, sync_every: int = 1) -> None:
        self.path = path
        self.sync_every = max(1, sync_every)
        self._file = open(path, "a")
        self._unsynced = 0
        self._due = threading.Event()  # records wait for the syncer
        self._closing = False
        self._error: OSError | None = None
        self._syncer = threading.Thread(target=self._sync_when_due, name="seedlog-fsync")
        self._syncer.daemon = True  # never keeps a failing process alive
        self._syncer.start()

    def write(self, record: dict) -> None:
        with names_file(self.path):
            self._raise_failed_sync()
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        self._unsynced += 1
        if self._unsynced >= self.sync_every:
            self._unsynced = 0
            self._due.set()

    def _sync_when_due(self) -> None:
        while True:
            self._due.wait()
            self._due.clear()
            if self._closing:
                return
            try:
                os.fsync(self._file.fileno())
            except OSError as err:  # reported by the next write
                self._error = err

    def _raise_failed_sync(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def sync(self) -> None:
        """Everything written so far on disk, now (the caller waits); closed, it already is."""
        if self._file.closed:
            return
        with names_file(self.path):
            os.fsync(self._file.fileno())
        self._unsynced = 0

    def close(self) -> None:
        """Stop the syncer, sync, close; a failed sync is raised with the file closed all
        the same (the run's logs are closed once, so it would stay open)."""
        self._closing = True
        self._due.set()
        self._syncer.join()
        try:
            with names_file(self.path):
                self._raise_failed_sync()
            self.sync()
        finally:
            self._file.close()


def read_seed_log(path: Path) -> tuple[dict, list[dict]]:
    """The header and the step records, checked: one record per step, 0..n-1 in order.
    A last line without its newline is a record torn by a crash (each is written with its
    newline in one write): dropped, with a warning; a line that is not JSON is an error."""
    return _parsed(path, _log_bytes(path))


def _log_bytes(path: Path) -> bytes:
    """The log's bytes, read whole once; a file it cannot read is one line."""
    try:
        return path.read_bytes()
    except OSError as err:
        raise ValueError(f"--log {path}: {err.strerror}") from None


def _parsed(path: Path, raw: bytes) -> tuple[dict, list[dict]]:
    """``read_seed_log`` of the log at ``path`` whose bytes are ``raw``."""
    try:
        text = as_read_text(raw)
    except UnicodeDecodeError as err:
        raise ValueError(f"--log {path}: not text (byte {err.start} is not UTF-8)") from None
    lines = text.split("\n")
    complete, tail = lines[:-1], lines[-1]  # tail: what follows the last newline ("" when whole)
    records = []
    for number, line in enumerate(complete, 1):
        try:
            records.append(json_text.loads(line))
        except json.JSONDecodeError:
            raise ValueError(f"--log {path}, line {number}: not JSON") from None
    if tail:
        logger.warning(
            "%s: dropped a torn last line (line %d, no newline)", path, len(complete) + 1
        )
    if not records or not isinstance(records[0], dict) or records[0].get("kind") != "header":
        raise ValueError(
            f"--log {path}: the first line must be the run's header; is this a seedlog.jsonl?"
        )
    header, steps = records[0], records[1:]
    check_header_types(path, header)
    first = first_step(header)
    for expected, record in enumerate(steps, first):
        if not _is_step_record(record, expected):
            number, step = expected - first + 2, record_step(record)
            if step is not None and first <= step < expected:  # its record is at its line
                twice = logged_twice(step, step - first + 2, number, steps[step - first], record)
                raise ValueError(f"--log {path}: {twice}")
            raise ValueError(f"--log {path}, line {number}: expected the record of step {expected}")
    return header, steps


def logged_twice(step: int, first_line: int, line: int, first: Any, again: Any) -> str:
    """What a log that holds ``step`` again at ``line`` is called, by the replay and by the
    resume's scan alike, from its two records, ``first`` and ``again``. Equal (the same run
    seed, lr and c's, to the bit), they are one run's step written twice, by two jobs of it
    writing the log at once (a requeue started before the old job ended, in a directory
    its lock could not hold): the log is the run's once the repeats go. Different, they
    are two runs' steps, and no resume or replay can tell which is this run's."""
    where = f"logs step {step} twice (lines {first_line} and {line})"
    if first == again:
        return (
            f"{where}, the same record both times: two jobs of this run wrote it at once (a "
            "requeue that started before the old job ended, in a directory that cannot be "
            f"locked); delete line {line} and any later repeat of a step"
        )
    return f"{where}, two different records: two runs wrote it"


def _is_step_record(record: Any, step: int) -> bool:
    """Whether a line is the record of ``step``: its finite lr and g per query (one at
    least), whose products are finite too. A run never logs a step whose g is not finite
    (it drops the step), nor one whose lr x g overflows (its update would have made the
    weights infinite, and the next loss would have stopped the run before the step was
    kept), so such a line is a damaged one, whose replay would make every weight NaN."""
    if record_step(record) != step:  # ``true`` or ``1.0`` is no step 1
        return False
    grads = record.get("projected_grads", [record.get("projected_grad")])
    if not isinstance(grads, list) or not grads:
        return False
    lr = record.get("lr")
    values = (lr, *grads)
    if not all(is_of_type(value, float) and math.isfinite(value) for value in values):
        return False
    return all(math.isfinite(lr * g) for g in grads)


def check_header_types(path: Path, header: dict) -> None:
    """Refuse, in one line naming the field, a header whose field is not of the type
    distzo writes (``HEADER_TYPES``) or whose ``first_step`` is negative."""
    for name, kind in HEADER_TYPES.items():
        value = header.get(name)
        if value is not None and not is_of_type(value, kind):
            raise ValueError(
                f"--log {path}: its header's {name} is {value!r}, not {TYPE_NAMES[kind]}; "
                "is the log damaged, or written by another tool?"
            )
    first_step(header)


def first_step(header: dict) -> int:
    """The step a log's records begin at (``HEADER_DEFAULTS``); a damaged value (not a
    whole number >= 0) is one line."""
    step = header.get("first_step", HEADER_DEFAULTS["first_step"])
    if not is_of_type(step, int) or step < 0:
        raise ValueError(
            f"the seed log's header has first_step {step!r}, not a step number; is the log damaged?"
        )
    return step


def is_begun_log(path: Path) -> bool:
    """Whether ``path`` is a seed log a run began: a file with something in it. An empty
    one lost its header (a machine that went down before the header reached the disk) and
    holds no step: it is no log, as a missing one is, and the run starts a log of its own."""
    return path.is_file() and path.stat().st_size > 0


def logged_first_step(path: Path) -> int:
    """``first_step`` of the log at ``path``, from its header line alone (0 without one)."""
    header = logged_header(path)
    return first_step(header) if header is not None else 0


def logged_header(path: Path) -> dict | None:
    """The header of the log at ``path``, from its first line alone (None without one, or
    where the file is not text)."""
    with open(path, "rb") as stream:  # the first line, ended as ``log_lines`` ends one
        header = line_record(log_lines(stream.readline())[0])
    return header if header is not None and header.get("kind") == "header" else None


def logged_revision(header: dict | None, where: str, base: str | None = None) -> str | None:
    """The hub commit a log's run read its base at, for a reader of that base (a resumed
    run; a replay without ``--base``, or whose ``--base`` is the log's own name): the same
    weights after the cache's ``main`` moved on. None without a header, for a local or
    random-init model, a log from before the commit was recorded, or another ``base``
    (the log's commit is no commit of that repository). A damaged one: one line naming
    ``where`` the header came from."""
    if header is None or header.get("base_revision") is None:
        return None
    if base is not None and base != header.get("base"):
        return None
    return hub.check_commit(header["base_revision"], where)


def resumed_base_revision(run_dir: Path, resume: str | None) -> str | None:
    """The hub commit the run in ``run_dir`` read its base at, where this launch may resume
    it (``resume``: ``--resume``'s auto, None too, yes or no): what a resume reads, the
    model's config as its weights, not the cache's newer ``main``. None as
    ``logged_revision``."""
    log = run_dir / SEED_LOG
    header = logged_header(log) if resume != "no" and log.is_file() else None
    return logged_revision(header, f"{log}'s header")


TAIL_BLOCK = 1 << 16  # bytes read at a time from a log's end


def last_logged_step(path: Path) -> int | None:
    """The step of the log's last complete step record (None: it holds none), read from
    its end: a resume's every rank asks where the log ends, and parsing a log of a million
    steps to learn it took seconds per rank. A torn last line, the header or a line that
    is not a step record is skipped, as ``run_dir.logged_steps_of`` skips it."""
    with open(path, "rb") as stream:
        lines = _complete_lines_backwards(stream, stream.seek(0, os.SEEK_END))
        for line in lines:
            step = record_step(line_record(line))
            if step is not None:
                return step
    return None


def _complete_lines_backwards(stream: BinaryIO, size: int) -> Iterator[bytes]:
    """The complete lines of a binary file, last first, without their ends: "\\n", "\\r\\n"
    or "\\r", as ``read_seed_log`` reads them (an old Mac editor's log was whole there and
    had no line here). What follows the last line end, a torn line, is not one."""
    pieces = _pieces_backwards(stream, size)
    last = next(pieces, b"")  # the only one that may be torn
    if last.endswith((b"\n", b"\r")):
        yield last.rstrip(b"\r\n")
    yield from (piece.rstrip(b"\r\n") for piece in pieces)


def _pieces_backwards(stream: BinaryIO, size: int) -> Iterator[bytes]:
    """A binary file's lines with their ends (the last one may have none), last first,
    reading ``TAIL_BLOCK`` bytes at a time."""
    end, carry = size, b""
    while end > 0:
        start = max(0, end - TAIL_BLOCK)
        stream.seek(start)
        carry = stream.read(end - start) + carry
        end = start
        # the first may begin in an earlier block (or be the "\n" of a "\r\n" split)
        carry, *pieces = carry.splitlines(keepends=True)
        yield from reversed(pieces)
    if carry:
        yield carry  # the file's first line


# The log last found whole and in order by ``checked_log``: its path and state
# (``file_state``) then, the step after its last record, and whether its bytes are what a
# rewrite of its lines writes (``jsonl_text.as_rewritten``).
_in_order: tuple[tuple[str, int, int, int, int], int, bool] | None = None


def _state(path: Path) -> tuple[int, int, int, int] | None:
    """The file's ``file_state``, which every write or replacement changes (None: no
    file)."""
    try:
        return file_state(path.stat())
    except OSError:
        return None


@dataclass(frozen=True)
class CheckedLog:
    """What ``checked_log`` read of a seed log: its bytes, kept so that a damaged log's
    scan and refusal read them again from memory, not from disk (a long log on a shared
    mount was read whole three times to say what is wrong with it)."""

    raw: bytes
    end: int | None  # the step after its last record (None: not whole and in order)
    refusal: str | None  # ``read_seed_log``'s one line refusing it (None: it accepts it)


def checked_log(path: Path) -> CheckedLog:
    """The log read whole once, its ``end`` the step after its last record where
    ``read_seed_log`` accepts it whole and its header is no step record (so
    ``run_dir.logged_steps_of``, by the same ``record_step``, reads the same steps,
    without a gap); None otherwise, for the caller's own scan of ``raw`` to name what is
    wrong. Rank 0 of a resume checks the log so, once: the end is remembered for the
    file's state (``in_order_end``, ``in_order_as_kept``), and the catch-up and the logs'
    truncation then read only the records they need, where each read all of a long log
    (seconds a restart). The parse is not kept: it is a dict per step, and the model is
    built after this."""
    before = _state(path)
    raw = path.read_bytes()
    try:
        header, steps = _parsed(path, raw)
    except ValueError as err:
        return CheckedLog(raw, None, str(err))
    if record_step(header) is not None:  # a step record to the scan: the scan's refusal
        return CheckedLog(raw, None, None)
    end = steps[-1]["step"] + 1 if steps else first_step(header)
    if before is not None and _state(path) == before:
        global _in_order
        _in_order = ((str(path), *before), end, as_rewritten(raw))
    return CheckedLog(raw, end, None)


def _vouched(path: Path) -> tuple[int, bool] | None:
    """What ``checked_log`` found of the log as it is now (its end, and whether it is
    as rewritten), read from nothing (None: not checked so, or written since)."""
    state = _state(path)
    if _in_order is None or state is None or _in_order[0] != (str(path), *state):
        return None
    return _in_order[1], _in_order[2]


def in_order_end(path: Path) -> int | None:
    """``checked_log``'s answer for the log as it is now, read from nothing (None: not
    checked so, or written since)."""
    vouched = _vouched(path)
    return vouched[0] if vouched is not None else None


def in_order_as_kept(path: Path, keep_below: int) -> bool:
    """Whether cutting the log back to the steps below ``keep_below`` would leave it as it
    is, known without reading it: ``checked_log`` found it ending there at most, each
    line a record (or the header) ended by a newline, and it is unchanged since."""
    vouched = _vouched(path)
    return vouched is not None and vouched[0] <= keep_below and vouched[1]


def records_from(path: Path, start: int) -> list[dict] | None:
    """The records of steps ``start``.. of a log ``in_order_end`` vouches for, read from
    its end (a catch-up after a checkpoint needs the last few of a million); None where
    it does not vouch, or the tail is not those records in order (the caller reads the
    log whole, and refuses it in the words of ``read_seed_log``)."""
    end = in_order_end(path)
    if end is None:
        return None
    records: list[dict] = []
    with open(path, "rb") as stream:
        lines = _complete_lines_backwards(stream, stream.seek(0, os.SEEK_END))
        for step in range(end - 1, start - 1, -1):
            line = next(lines, None)
            record = line_record(line) if line is not None else None
            if record is None or not _is_step_record(record, step):
                return None
            records.append(record)
    return records[::-1]


def read_seed_log_once(path: Path) -> tuple[dict, list[dict]]:
    """``read_seed_log``, read once per state of the file: a resume asks the log whether
    it holds steps, which noise drew them and which to catch up with, and should read it
    (and warn of a torn line) once. The records are shared: read them, do not change them."""
    state = _state(path)
    if state is None:
        return read_seed_log(path)  # its one-line error
    return _read_seed_log_cached(str(path), *state)


@functools.lru_cache(maxsize=2)
def _read_seed_log_cached(path: str, *state: int) -> tuple[dict, list[dict]]:
    return read_seed_log(Path(path))


def forget_seed_log_reads() -> None:
    """Drop what ``read_seed_log_once`` keeps: once a resume has caught up, every record
    of the log would stay in memory for the rest of the run (a dict per step: 330 MB of
    host memory for half a million steps), the log grown past the state it was read in."""
    _read_seed_log_cached.cache_clear()


def logged_noise(header: dict) -> str:
    """The noise identity a header records (``HEADER_DEFAULTS``: a log from before noise
    kinds was drawn by the legacy generator)."""
    return header.get("noise", HEADER_DEFAULTS["noise"])


def step_grads(record: dict) -> tuple[float, ...]:
    """A record's g per query (logs from before n-SPSA hold one ``projected_grad``)."""
    grads = record["projected_grads"] if "projected_grads" in record else [record["projected_grad"]]
    return tuple(grads)


def check_same_run(path: Path, logged: dict, ours: dict) -> None:
    """Refuse, in one line, a log whose header differs from this run's where the trajectory
    depends on it (another run seed, noise, decay, dtype, adapter, optimizer or estimator)."""
    for name in TRAJECTORY_FIELDS:
        theirs, mine = (_header_field(header, name) for header in (logged, ours))
        if theirs != mine:
            raise ValueError(
                f"{path} is the log of another run ({name} {theirs!r}, this run has "
                f"{mine!r}); resume with the options it was written with, or use a fresh "
                "--output-dir"
            )


def _header_field(header: dict, name: str) -> Any:
    """A header's field as this version writes it: ``HEADER_DEFAULTS`` for one the log's
    version did not write, and an optimizer's or adapter's record completed with the
    fields added to it since, as a replay reads them (a log from before optimizers ran
    ZO-SGD; from before Adam, a recomputed momentum; from before prefix tuning, an adapter
    with no prefix), so that an earlier version's log compares equal to the run it is."""
    value = header.get(name, HEADER_DEFAULTS.get(name))
    if name == "optimizer":
        value = value or {}
        return {**optimizer_record(ZOConfig(optimizer=value.get("name", "sgd"))), **value}
    if name == "peft" and value:
        return {**AdapterSpec.from_record(value).record(), **value}
    return value
