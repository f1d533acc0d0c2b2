"""Rows from local files (jsonl, json, csv, tsv, parquet, txt) or a Hugging Face dataset.

``hf:PATH[@REVISION][:CONFIG]:SPLIT`` names a hub dataset (needs network access), e.g.
``hf:nyu-mll/glue:sst2:train`` (``distzo.data.hub_spec``); anything else is a local file
chosen by its extension.
A ``.txt`` file gives one ``{"text": line}`` row per non-empty line (the plain
causal-LM task). Lines end at ``\n`` (or ``\r\n``) only: a JSON string may hold U+2028
and a text line a form feed. A ``.tsv`` file is read as GLUE writes it: no quoting, so a
``"`` is text (a field cannot hold a tab or a newline). A UTF-8 byte-order mark is
skipped. A ``.json`` file is a list of objects or JSON Lines (``datasets``' ``to_json``
writes those by default). A ``.parquet`` file ``datasets`` wrote keeps a split's
features: its ``ClassLabel`` columns read as an ``hf:`` split's are. Errors are one line
naming the file and the row, by the number ``load_numbered_rows`` gives it.
"""

from __future__ import annotations

import contextlib
import csv
import io
import itertools
import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from distzo.data.hub_errors import not_loaded
from distzo.data.hub_spec import COMMIT, hub_spec
from distzo.runtime import json_text
from distzo.runtime.gc_paused import gc_paused

FORMATS = (".jsonl", ".json", ".csv", ".tsv", ".parquet", ".txt")


Row = dict[str, Any]
T = TypeVar("T")


@dataclass(frozen=True)
class HubPin:
    """How a rank of a launch reads an ``hf:`` dataset: at ``revision``, the commit rank 0
    was told, or read from its cache where the hub did not answer it (None: neither, so
    the node's cache's), and from its node's cache alone where ``cached`` (the node's first
    rank downloaded it), the copy of that commit (``hub_cache.pinned_folder``): each rank
    asking the hub for itself made 13 to 15 requests a file (distzo's 3, datasets' 10 to
    12)."""

    revision: str | None
    cached: bool = False
    # this process was just told ``revision`` by the hub (rank 0, ``dataset_commit``): its
    # download asks no more whether the hub answers (rank 0 asked twice: 16 requests, now 14)
    answered: bool = False


def load_rows(source: str) -> list[Row]:
    return [row for _, row in load_numbered_rows(source)]


def load_numbered_rows(source: str) -> list[tuple[int, Row]]:
    """Each row with the number an error names it by: a JSONL or text file's line, a CSV's
    line less the header's (blank lines count), a JSON list's or parquet table's index."""
    return list(iter_numbered_rows(source))


# whether a reader takes a ClassLabel's names (its class names, in the split's order)
ReadsNames = Callable[[Sequence[str]], bool]


def iter_numbered_rows(
    source: str, pin: HubPin | None = None, reads_names: ReadsNames | None = None
) -> Iterator[tuple[int, Row]]:
    """``load_numbered_rows``'s rows one at a time, a JSONL or text file's read a line at
    a time (a reader that keeps what it needs of a row holds no file's worth of dicts).
    An error comes where its row does; a bad JSONL row's after the rest is decoded, where a
    non-UTF-8 byte further on is named instead, as when the file was decoded whole.
    ``pin``: how an ``hf:`` dataset is read (None: as one process asks the hub);
    ``reads_names``: an ``hf:`` split's ``ClassLabel`` columns whose names it accepts give
    the class's name, not the split's number for it (the reader's numbering may differ)."""
    yield from _numbered_rows(source, pin, reads_names)


def read_whole(
    numbered: Iterator[tuple[int, Row]], build: Callable[[Iterator[tuple[int, Row]]], T]
) -> T:
    """``build(numbered)``; a bad row's ``ValueError`` waits for the rest of the rows to be
    read, where the file's own error (bad JSON, a non-UTF-8 byte) further on comes first, as
    it did when the file was read whole before any row was built. The cycle collector
    waits (``gc_paused``): its passes over the rows built so far were 60% of the time."""
    with gc_paused():
        try:
            return build(numbered)
        except ValueError:
            for _ in numbered:
                pass
            raise


def _numbered_rows(
    source: str, pin: HubPin | None, reads_names: ReadsNames | None
) -> Iterable[tuple[int, Row]]:
    if source.startswith("hf:"):
        return enumerate(_hub_rows(source, pin, reads_names), 1)
    path = Path(source)
    if path.is_dir():
        raise ValueError(
            f"{source} is a folder; give a data file ({', '.join(FORMATS)}) (a datasets "
            "save_to_disk folder: write its split out with Dataset.to_json(...))"
        )
    if not path.exists():
        raise ValueError(f"data file {source} does not exist")
    if not path.is_file():  # read once per rank and per check: a pipe would be empty after
        raise ValueError(
            f"data file {source} is not a regular file (a device or a pipe); write the rows "
            "to a file and give its path"
        )
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(
            f"{source}: unsupported format {suffix or '(none)'}; use one of {', '.join(FORMATS)}"
        )
    if suffix == ".parquet":
        return enumerate(_parquet_rows(path, source, reads_names), 1)
    if suffix == ".jsonl":
        return _jsonl_rows(_file_lines(path, source), source)
    if suffix == ".txt":
        return ((n, {"text": line}) for n, line in _file_lines(path, source) if line.strip())
    text = _utf8(path, source, header=suffix in (".csv", ".tsv"))
    if suffix == ".json":
        return _json_rows(text, source)
    return _csv_rows(text, source, "\t" if suffix == ".tsv" else ",")


PARQUET_BATCH = 10_000  # rows turned into dicts at a time


def require_pyarrow(source: str) -> None:
    """pyarrow importable, or one line naming ``source`` and the fix. pyarrow 26 needs
    numpy 2 and does not declare it, so pip gives an environment pinned to numpy 1.x (our
    floor is 1.24) a pyarrow that fails at import: a traceback from a parquet file or a
    hub dataset, where ``datasets`` reads both through it."""
    try:
        import pyarrow  # noqa: F401
    except ImportError as err:
        raise ValueError(
            f"{source}: pyarrow cannot be imported ({str(err).splitlines()[0]}); install one "
            "that works with this numpy (pyarrow 26 and later need numpy 2: pip install "
            "'pyarrow<26', or 'numpy>=2')"
        ) from None


def _parquet_rows(path: Path, source: str, reads_names: ReadsNames | None) -> Iterator[Row]:
    """The table's rows, a batch of them at a time: the whole table as a list of dicts,
    beside the table and then the Examples, was 0.35 GB more at the peak than a TSV of the
    same million rows, on every rank. A ``ClassLabel`` column of a file ``datasets`` wrote
    (its features in the schema) gives its names as an ``hf:`` split's does."""
    require_pyarrow(source)
    import pyarrow.parquet as pq  # a dependency of datasets

    try:
        table = pq.ParquetFile(path)
        named = _schema_class_names(table.schema_arrow, reads_names) if reads_names else {}
        for batch in table.iter_batches(batch_size=PARQUET_BATCH):
            for row in batch.to_pylist():
                yield _with_names(row, named)
    except Exception as err:  # pyarrow raises several kinds for a damaged file
        raise ValueError(
            f"{source}: not a readable parquet file ({str(err).splitlines()[0]})"
        ) from None


def _jsonl_rows(lines: Iterator[tuple[int, str]], source: str) -> Iterator[tuple[int, Row]]:
    """Each line's object; a bad line is a one-line error, unless a non-UTF-8 byte comes
    further on: that one is named, as when the file was decoded whole before parsing."""
    for number, line in lines:
        if not line.strip():
            continue
        try:
            row = json_text.loads(line)
        except json.JSONDecodeError as err:
            problem = f"{source}, row {number}: not valid JSON ({err.msg})"
            if err.msg == "Extra data" and "\r" in line:  # rows parted by CR alone
                problem += (
                    "; its lines end in a carriage return alone (classic Mac OS endings): "
                    "end them in \\n (e.g. tr '\\r' '\\n' < FILE > NEW.jsonl)"
                )
        else:
            if isinstance(row, dict):
                yield number, row
                continue
            problem = f"{source}, row {number}: expected a JSON object"
        for _ in lines:  # decodes the rest: raises at a non-UTF-8 byte
            pass
        raise ValueError(problem)


def _json_rows(text: str, source: str) -> list[tuple[int, Row]]:
    """A list of objects, or JSON Lines in a ``.json`` file as ``datasets``' ``to_json``
    writes them by default (and its ``json`` loader reads)."""
    try:
        rows = json_text.loads(text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data" and text.lstrip().startswith("{"):
            return list(_jsonl_rows(enumerate(_lines(text), 1), source))
        raise ValueError(f"{source}: not valid JSON ({err.msg}, line {err.lineno})") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{source}: expected a JSON list of objects")
    return list(enumerate(rows, 1))


def _lines(text: str) -> list[str]:
    """A file's lines, split at ``\n`` alone (``str.splitlines`` also splits at U+2028,
    U+0085, form feeds and other characters a line may hold)."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def _file_lines(path: Path, source: str) -> Iterator[tuple[int, str]]:
    """The file's lines as ``_lines`` splits its text, numbered from 1, read and decoded
    one at a time: the whole file's bytes, its text and its list of lines, held at once,
    peaked at twelve times a JSONL file's size. Errors are ``_utf8``'s."""
    try:
        with path.open("rb") as stream:
            for number, data in enumerate(stream, 1):
                data = data[:-1] if data.endswith(b"\n") else data
                data = data[:-1] if data.endswith(b"\r") else data
                try:
                    yield number, data.decode("utf-8-sig" if number == 1 else "utf-8")
                except UnicodeDecodeError as err:
                    raise ValueError(
                        f"{source}, row {number}: not UTF-8 (byte 0x{data[err.start]:02x}); "
                        "save the file as UTF-8"
                    ) from None
    except OSError as err:  # unreadable (permissions, an I/O error): one line, not a traceback
        raise ValueError(f"{source}: cannot read the file ({err.strerror or err})") from None


def _utf8(path: Path, source: str, header: bool) -> str:
    """The file as text, or a one-line error at its first non-UTF-8 byte naming the row (a
    CSV's line less its header's), or a JSON file's line (a list's rows span lines), rather
    than the codec's byte offset."""
    try:
        data = path.read_bytes()
    except OSError as err:  # unreadable (permissions, an I/O error): one line, not a traceback
        raise ValueError(f"{source}: cannot read the file ({err.strerror or err})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        where = (
            "the header"
            if header and line == 1
            else f"row {line - 1}"
            if header
            else f"line {line}"
        )
        raise ValueError(
            f"{source}, {where}: not UTF-8 (byte 0x{data[err.start]:02x}); save the file as UTF-8"
        ) from None


def _csv_rows(text: str, source: str, delimiter: str) -> Iterator[tuple[int, Row]]:
    """CSV/TSV rows numbered by the line they start on, less the header's (as a non-UTF-8
    byte is), one at a time (a list of a million rows' dicts, beside their Examples, was a
    third of a gigabyte more at the peak, on every rank); a malformed row (a field over
    ``csv.field_size_limit``, the wrong number of fields) is one line naming it."""
    stream, skipped = _after_blank_lines(_universal_lines(text))
    reader = (
        csv.DictReader(stream, delimiter=delimiter, quoting=csv.QUOTE_NONE)  # GLUE's TSVs
        if delimiter == "\t"
        else csv.DictReader(stream, delimiter=delimiter)
    )
    ended = skipped + 1  # the line the last row read (or the header) ends on
    try:
        header = list(reader.fieldnames or ())
        twice = [name for name in header if header.count(name) > 1]
        if twice:  # the reader keeps the last column of a name: the first one's text lost
            raise ValueError(
                f"{source}: the header names column {twice[0]!r} twice; give each column its "
                "own name"
            )
        for row in reader:
            # line_num is the row's last line; a quoted field may span lines of its own
            number = skipped + reader.line_num - 1 - sum(_breaks(v) for v in row.values())
            ended = skipped + reader.line_num
            if None in row or None in row.values():
                raise ValueError(
                    f"{source}, row {number}: wrong number of fields for the header "
                    f"{reader.fieldnames}"
                )
            yield number, row
    except csv.Error as err:
        # the reader's line_num stops short of a row it fails on: that row is the next
        # non-blank line after the last row read
        number = _next_row_line(text, ended) - 1
        if "field limit" in str(err):
            raise ValueError(
                f"{source}, row {number}: a field is larger than the CSV field limit "
                f"({csv.field_size_limit()} characters); shorten it or use a .jsonl file"
            ) from None
        raise ValueError(f"{source}, row {number}: not valid CSV ({err})") from None


def _after_blank_lines(lines: Iterator[str]) -> tuple[Iterator[str], int]:
    """``lines`` from the first that is not blank, and how many were: the csv reader takes
    its first line for the header, a blank one too (every row then refused as having the
    wrong number of fields for the header []); pandas, datasets' reader, skips them."""
    skipped = 0
    for line in lines:
        if line.strip("\r\n"):
            return itertools.chain([line], lines), skipped
        skipped += 1
    return iter(()), skipped


_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+")


def _universal_lines(text: str) -> Iterator[str]:
    """``text``'s lines as ``io.StringIO(text, newline="")`` gives them (each ends at
    ``\r\n``, ``\r`` or ``\n``, kept), one at a time: a StringIO holds 4 bytes a
    character, four times an ASCII file's size beside its text, on every rank."""
    return (match.group() for match in _LINE.finditer(text))


def _next_row_line(text: str, ended: int) -> int:
    """The line, counted as the csv reader counts them, of the first non-blank line after
    line ``ended``."""
    for number, line in enumerate(io.StringIO(text, newline=""), 1):
        if number > ended and line.strip("\r\n"):
            return number
    return ended + 1


def _breaks(value: Any) -> int:
    """Line breaks in a field as the csv reader counts lines (``\r\n``, ``\r``, ``\n``)."""
    if isinstance(value, list):  # a row's extra fields
        return sum(_breaks(v) for v in value)
    if not isinstance(value, str) or ("\n" not in value and "\r" not in value):
        return 0  # nearly every field: no regular expression run on it
    return len(re.findall(r"\r\n|\r|\n", value))


def parse_hub_spec(source: str) -> tuple[str, str | None, str]:
    """``hf:`` source ``source``'s path, config and split (its revision: ``hub_spec``)."""
    spec = hub_spec(source)
    return spec.path, spec.config, spec.split


def hub_dataset_revision(source: str) -> str:
    """The commit ``hf:`` dataset ``source`` is now on the hub (at the revision the spec
    names, else its ``main``), or "" where the hub does not answer (or stalls): the cache is
    read. A dataset or revision the hub does not have is the load's one-line error. A
    local folder (a clone of a dataset's repository), which ``datasets`` reads before any
    hub name, has no commit: every rank reads the folder (the hub refused its path as a
    name, and the launch with it)."""
    from distzo.models.hub_reads import dataset_commit

    spec = hub_spec(source)
    if Path(spec.path).is_dir():
        return ""
    try:
        return dataset_commit(spec.path, spec.revision)
    except Exception as err:  # an unknown name or revision, no access: the load's message
        raise _not_loaded(source, err) from None


def cached_dataset_revision(source: str) -> str:
    """The commit of the copy of ``hf:`` dataset ``source`` that this node's datasets cache
    holds and ``datasets`` offline reads, or "" where it holds none (the load's error). Of
    a spec naming a commit, that commit where the cache holds its copy; a tag or branch
    only the hub resolves (``datasets`` keeps no record of which commit it named)."""
    from distzo.data.hub_cache import cached_commit, holds_copy

    spec = hub_spec(source)
    if spec.revision is None:
        return cached_commit(spec.path, spec.config)
    named = COMMIT.fullmatch(spec.revision) is not None
    return spec.revision if named and holds_copy(spec.path, spec.config, spec.revision) else ""


def fill_hub_cache(
    source: str, revision: str | None, answered: bool = False, from_cache: bool = False
) -> None:
    """``hf:`` dataset ``source`` at ``revision`` prepared in this node's datasets cache
    (None: neither the hub nor its cache gave rank 0 one, so the cache as it is), for the
    node's ranks to read offline: one download and one set of datasets' questions a node.
    ``answered``: this process was told ``revision`` by the hub (``HubPin.answered``);
    ``from_cache``: rank 0 read ``revision`` from its cache, the hub silent to it, so none
    is asked. A cache that already holds the copy of ``revision`` (a resume's recorded
    commit, an earlier run's) is read as it is, with no request: ``datasets`` asked the hub
    a dozen questions to find the copy it had. A hub silent to this node leaves the cache
    as it is: one without that commit's copy is refused here, once, not on each of the
    node's ranks with another cause."""
    from distzo.data.hub_cache import CACHE_MISSING, FILL_MISSING, holds_copy, pinned_folder

    path, config, split = parse_hub_spec(source)
    held = revision is not None and holds_copy(path, config, revision)
    if not (from_cache or held):
        _hub_dataset(source, HubPin(revision, answered=answered))
    if revision is not None:
        missing = CACHE_MISSING if from_cache else FILL_MISSING
        pinned_folder(path, config, split, revision, source, missing)


def _hub_rows(source: str, pin: HubPin | None, reads_names: ReadsNames | None) -> Iterator[Row]:
    """The split's rows one at a time: the dataset is memory-mapped, and a list of its
    dicts (the whole split, beside the Examples) was the peak of every rank's load. A
    ``ClassLabel`` column whose names ``reads_names`` accepts gives its names."""
    dataset = _hub_dataset(source, pin)
    named = class_names(getattr(dataset, "features", None), reads_names) if reads_names else {}
    try:
        for row in dataset:
            yield _with_names(row, named)
    except Exception as err:
        raise _not_loaded(source, err) from None


def _with_names(row: Row, named: dict[str, list[str]]) -> Row:
    """``row`` with each ``ClassLabel`` column of ``named`` given as its class's name."""
    for column, names in named.items():
        # -1 (no label) and a null stay the row's to refuse, as a file's would be
        if isinstance(row.get(column), int) and 0 <= row[column] < len(names):
            row[column] = names[row[column]]
    return row


def _schema_class_names(schema: Any, reads_names: ReadsNames) -> dict[str, list[str]]:
    """``class_names`` of the features ``datasets`` keeps in a parquet file's schema (none:
    a file another tool wrote). Read from its JSON, not by ``datasets``, which refuses the
    whole schema where another version wrote a feature type it does not know: the file's
    rows read as they did before."""
    try:
        features = json.loads((schema.metadata or {})[b"huggingface"])["info"]["features"]
        labels = {
            column: [str(name) for name in feature["names"]]
            for column, feature in features.items()
            if feature.get("_type") == "ClassLabel"
        }
    except (KeyError, TypeError, AttributeError, ValueError):
        return {}
    return {column: names for column, names in labels.items() if reads_names(names)}


def class_names(features: Any, reads_names: ReadsNames) -> dict[str, list[str]]:
    """The names of each ``ClassLabel`` column of ``features`` (a split's, by column) that
    ``reads_names`` accepts, by column."""
    import datasets

    features = features or {}
    return {
        column: feature.names
        for column, feature in features.items()
        if isinstance(feature, datasets.ClassLabel) and reads_names(feature.names)
    }


def _hub_dataset(source: str, pin: HubPin | None) -> Any:
    path, config, split = parse_hub_spec(source)
    require_pyarrow(source)
    import datasets

    from distzo.data.hub_cache import pinned_folder, read_prepared
    from distzo.data.read_only_cache import unlocked_where_read_only

    revision = pin.revision if pin else hub_spec(source).revision
    cached = pin is not None and (pin.cached or revision is None)
    # datasets offline reads the cache's newest copy, of whichever commit: the pinned one's
    pinned = pinned_folder(path, config, split, revision, source) if cached and revision else None
    try:
        if pinned is not None:
            with unlocked_where_read_only():
                return read_prepared(path, pinned, split)
        # a hub that never answers: the datasets cache, read where it is read-only too
        with _hub_reads(path, revision, pin, cached), unlocked_where_read_only():
            return datasets.load_dataset(path, config, split=split, revision=revision)
    except Exception as err:  # offline, unknown name, unknown split: all one message
        raise _not_loaded(source, err) from None


def _hub_reads(
    path: str, revision: str | None, pin: HubPin | None, cached: bool
) -> contextlib.AbstractContextManager[None]:
    """How a load reaches the hub: not at all (``cached``); bounded, where this process was
    just told the commit (``HubPin.answered``); or once asked whether the hub answers about
    ``path`` at the ``revision`` the load reads (``offline_unless_answered``; a resume's
    recorded commit, not ``main``): a hub that does not, read as offline."""
    from distzo.models.hub_reads import bounded_reads, offline_unless_answered

    if cached:
        return _read_cache_quietly()
    if pin and pin.answered:
        return bounded_reads()
    return offline_unless_answered(path, revision)


# datasets' warnings on reading its cache offline: "couldn't be found on the Hugging Face
# Hub", twice a file on each of a node's ranks, where the node's first rank just filled it
CACHE_READ_LOGGERS = ("datasets.load", "datasets.packaged_modules.cache.cache")


@contextlib.contextmanager
def _read_cache_quietly() -> Iterator[None]:
    """Offline (``hub_offline``), datasets' warnings about it left unsaid."""
    from distzo.models.hub_reads import hub_offline

    loggers = [logging.getLogger(name) for name in CACHE_READ_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with hub_offline():
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _not_loaded(source: str, err: BaseException) -> ValueError:
    return not_loaded(source, parse_hub_spec(source), err)
