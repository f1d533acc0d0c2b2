"""One object per kind of task: its training batches by step and its evaluation material.

Which evaluation runs on that material is ``distzo.job.evaluation``'s choice: the data
package knows no engine.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from distzo.data.column_map import ColumnMap, check_columns, renamed
from distzo.data.demonstrations import check_demonstrable, with_demonstrations
from distzo.data.encoding import (
    ENCODE_CHUNK,
    ChoiceTrainData,
    PaddedRows,
    PromptEncoder,
    PromptOnlyTrainData,
    PromptTrainData,
    TextTrainData,
    TokenRows,
    choice_encoding,
    distinct,
    text_lengths,
)
from distzo.data.loaders import HubPin, iter_numbered_rows, read_whole
from distzo.data.masked_prompts import (
    MASKED_PROMPTS,
    MASKED_TASKS,
    MaskedPromptEncoder,
    masked_task,
)
from distzo.data.row_share import WHOLE, RowShare
from distzo.data.sampling import WHOLE_FILES, Sampling, sample_sets
from distzo.data.synthetic import CountingTask
from distzo.data.templates import (
    TASKS,
    Example,
    MaskedExample,
    Task,
    build_numbered,
    get_task,
    not_text,
)
from distzo.objectives import OBJECTIVES

GENERATED = ("counting",)
TEXT = ("text",)
# the prompt tasks: MeZO's OPT tasks (a causal LM's), then those of its RoBERTa tasks
# that only a masked LM has a prompt for (sst2 and rte have both)
TASK_NAMES = GENERATED + TEXT + tuple(TASKS) + tuple(t for t in MASKED_TASKS if t not in TASKS)
# MeZO's scripts (large_models/mezo.sh) train every task with --train_as_classification
# except COPA, ReCoRD, SQuAD and DROP, which they train LM-style.
LM_TRAINED = ("copa", "record", "squad", "drop")


def default_objective(task: str) -> str:
    """The objective MeZO's scripts use for ``task``."""
    if task in GENERATED + TEXT or task in LM_TRAINED:
        return "lm"
    return "classification"


def check_objective(task: str, objective: str) -> None:
    """A one-line error for an unknown objective or a pairing that makes no sense."""
    if objective not in OBJECTIVES:
        raise ValueError(
            f"unknown --objective {objective!r}; choose one of {', '.join(OBJECTIVES)}"
        )
    known = TASKS.get(task) or MASKED_TASKS.get(task)
    kind = known.kind if known else "text"
    allowed = {
        "text": ("lm",),
        "classification": ("lm", "classification", "accuracy"),
        "generation": ("lm", "f1"),
    }[kind]
    named = list(allowed)
    if task in MASKED_TASKS and "lm" in allowed:
        # a masked LM has no next token: lm is a causal LM's, and a task only a masked LM
        # has a prompt for has none
        if task in TASKS:
            named[named.index("lm")] = "lm (a causal LM's)"
        else:
            allowed = tuple(name for name in allowed if name != "lm")
            named.remove("lm")
    if objective not in allowed:
        raise ValueError(
            f"--objective {objective} does not apply to --task {task}; choose one of "
            f"{', '.join(named)}"
        )


@dataclass(frozen=True)
class Cuts:
    """What the token limit cuts in one file: rows whose sequences lose tokens from the
    left (MeZO's cut), and those of them whose answer (a candidate, SQuAD's answer), longer
    than the limit alone, loses its end too."""

    file: str  # --train-file or --eval-file
    rows: int
    cut: int = 0
    answers: int = 0
    alike: int = 0  # of ``answers``: rows whose candidates the cut makes the same tokens

    def notice(self, limit: str) -> str | None:
        """One warning line, or None where nothing is cut (``limit``: the tokens, named)."""
        if not self.cut:
            return None
        answers = (
            f"; {self.answers} of them lose the end of their answer too" if self.answers else ""
        )
        if self.alike:
            answers += (
                f", and in {self.alike} the candidates become the same tokens, which no model "
                "can tell apart"
            )
        return (
            f"{self.file}: {self.cut} of {self.rows} rows are longer than {limit}: they lose "
            f"tokens from the left{answers}; raise --max-length or shorten the rows"
        )


def dev_set_name(option: str) -> str:
    """The dev set, where the notices name a file: the rows of --train-file ``option``
    (--num-dev, or LM-BFF's --dev-per-class) drew."""
    return f"{option} rows of --train-file"


def token_limit(tokens: int) -> str:
    return f"{tokens} tokens (--max-length, or the model's positions)"


class TaskData(Protocol):
    def batch(self, batch_size: int, step: int) -> dict[str, torch.Tensor]: ...

    @property
    def cut_notices(self) -> tuple[str, ...]:
        """One warning line per file whose rows the token limit cuts (rank 0 logs them)."""
        ...

    @property
    def longest(self) -> int:
        """The longest token sequence a step or an evaluation will run (the memory plan's)."""
        ...

    @property
    def rows_per_example(self) -> int:
        """Sequences a training example becomes (candidates scored on rows of their own);
        0 where a scoring run's build (``--max-steps 0``) left the training rows out: the
        memory plan then plans the evaluation alone."""
        ...


@dataclass
class LoadedRows:
    """Training and evaluation material checked before any model is built."""

    task: str
    train: list[Any]  # Examples for prompt tasks, texts for the text task
    eval: list[Any]
    dev: list[Any] = dataclasses.field(default_factory=list)  # --num-dev: evaluated in training
    dev_option: str = "--num-dev"  # the option that drew ``dev`` (or --dev-per-class)
    notices: tuple[str, ...] = ()  # what reading the files left out, a line each
    # the commit each hf: source was read at, by its flag (the seed log's data_commits)
    commits: dict[str, str] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def digests(self) -> dict[str, str]:
        """Each file's rows as read, by its flag: a rank (another node's copy of the file)
        or a resumed session (a file rewritten since) that read other rows trains on other
        batches under the same options, so these are compared. Sampled sets are digested as
        drawn; the dev rows, where there are any, under ``--num-dev``."""
        digests = {"--train-file": rows_digest(self.train), "--eval-file": rows_digest(self.eval)}
        return digests | ({"--num-dev": rows_digest(self.dev)} if self.dev else {})


DIGEST_CHUNK = 10_000  # rows encoded at a time


def rows_digest(rows: list[Any]) -> str:
    """The first 16 hex digits of the SHA-256 of ``rows`` (texts or Examples) in order:
    what the step's indices pick from. The JSON text of the list is hashed a chunk of rows
    at a time, the bytes ``json.dumps(rows)`` writes (runs logged before hash the same),
    without holding a copy of the file's text as one string."""
    digest = hashlib.sha256(b"[")
    for start in range(0, len(rows), DIGEST_CHUNK):
        chunk = [_plain(row) for row in rows[start : start + DIGEST_CHUNK]]
        digest.update((", " if start else "").encode() + json.dumps(chunk)[1:-1].encode())
    digest.update(b"]")
    return digest.hexdigest()[:16]


def _plain(row: Any) -> Any:
    """An Example as the tuple of its fields (its JSON list), ``right`` left out where it
    is empty (the rows of every task that has one right candidate hash as they did before
    the field); ``dataclasses.astuple`` deep copies each field, seconds a million rows."""
    if isinstance(row, Example):
        fields = tuple(getattr(row, field.name) for field in dataclasses.fields(row))
        return fields if row.right else fields[:-1]
    if isinstance(row, MaskedExample):
        return (row.sentences, row.label)
    return row


def load_task_rows(
    task: str,
    train_file: str | None,
    eval_file: str | None,
    sampling: Sampling = WHOLE_FILES,
    pins: dict[str, HubPin] | None = None,
    masked: bool = False,
    columns: ColumnMap = (),
) -> LoadedRows | None:
    """Read and check the files of a file-based task (one-line errors naming file and row),
    and draw the sets ``sampling`` asks for (``distzo.data.sampling``); ``pins``: how each
    ``hf:`` source is read on this rank (by default, as one process asks the hub);
    ``masked``: the rows of a masked LM's prompt (``MaskedExample``s); ``columns``: the
    task's columns read from the sources' (``--columns``)."""
    if task in GENERATED:
        if train_file or eval_file or columns:
            raise ValueError(
                f"--task {task} generates its data; --train-file/--eval-file/--columns do not "
                "apply to it"
            )
        if sampling.samples:
            raise ValueError(
                f"--task {task} generates its data; --num-train/--num-dev/--num-eval sample "
                "the rows of a --train-file and --eval-file"
            )
        return None
    if task not in TASK_NAMES:
        raise ValueError(f"unknown --task {task!r}; choose one of {', '.join(TASK_NAMES)}")
    schema = None if task in TEXT else prompt_task(task, masked)  # before any file is read
    if sampling.num_demos is not None:
        check_demonstrable(task, masked)
    check_columns(columns, task, schema.columns if schema else ("text",))  # text's one column
    num_labels = schema.num_labels if schema else 0
    if sampling.train_per_class is not None and not num_labels:
        raise ValueError(
            f"--train-per-class draws rows of each label, and --task {task}'s rows have no "
            "labels of a fixed set; draw them with --num-train and --num-dev"
        )
    if not train_file or not eval_file:
        given = {"--train-file": train_file, "--eval-file": eval_file}
        missing = [flag for flag, path in given.items() if not path]
        raise ValueError(f"--task {task} reads its data: give {' and '.join(missing)}")
    for flag, source in (("--train-file", train_file), ("--eval-file", eval_file)):
        if not source.startswith("hf:") and not Path(source).exists():
            # named by its flag, both before either is read: the loader's line named the
            # path alone, and with both flags in one command the user had to guess
            raise ValueError(
                f"{flag} {source}: no such file; correct the path, or give a hub dataset's "
                "split as hf:PATH[:CONFIG]:SPLIT"
            )
    loaded: list[list[Any]] = []
    read = [0, 0]  # each file's rows, of which a task's build may leave some out
    reads_names = schema.reads_names if schema else None
    for file, source in enumerate((train_file, eval_file)):
        numbered = iter_numbered_rows(source, (pins or {}).get(source), reads_names)
        if columns:
            numbered = renamed(numbered, columns, source)
        if schema is None:
            loaded.append(_texts(numbered, source))
        else:
            loaded.append(build_numbered(schema, _counted(numbered, read, file), source))
        if not loaded[-1]:
            raise ValueError(f"{source}: no rows")
    train, dev, evals = sample_sets(
        loaded[0], loaded[1], sampling, train_file, eval_file, num_labels, task
    )
    if sampling.num_demos is not None:
        evals = with_demonstrations(
            train, evals, sampling.num_demos, sampling.demo_sets, sampling.seed, train_file
        )
    drew = "--dev-per-class" if sampling.train_per_class is not None else "--num-dev"
    notices = _left_out(task, read, [len(rows) for rows in loaded]) if schema else ()
    return LoadedRows(task, train, evals, dev, drew, notices)


def _counted(
    rows: Iterator[tuple[int, dict[str, Any]]], read: list[int], file: int
) -> Iterator[tuple[int, dict[str, Any]]]:
    """``rows`` as they come, counted into ``read[file]``."""
    for row in rows:
        read[file] += 1
        yield row


def _left_out(task: str, read: list[int], built: list[int]) -> tuple[str, ...]:
    """One line for the rows the task's build left out (SNLI's without a gold label), or
    none: they are no rows of any set, which a count of the file's lines would not show."""
    counts = [
        f"{r - b} of {flag}'s {r}"
        for flag, r, b in zip(("--train-file", "--eval-file"), read, built, strict=True)
        if r > b
    ]
    if not counts:
        return ()
    return (
        f"--task {task} leaves out the rows without a gold label (label -1 or -), as "
        f"LM-BFF's files hold none: {' and '.join(counts)}",
    )


def prompt_task(task: str, masked: bool) -> Task:
    """The rows' schema: a masked LM's prompt task (MeZO's RoBERTa prompts), or a causal
    LM's; a task only the other kind of model has a prompt for is refused in one line."""
    if masked:
        return masked_task(task)
    if task in MASKED_TASKS and task not in TASKS:
        raise ValueError(
            f"--task {task} has a masked-LM prompt only (MeZO's RoBERTa tasks): give --model "
            "a masked LM (roberta, xlm-roberta), or pick a causal LM's task"
        )
    return get_task(task)


def _texts(numbered: Iterator[tuple[int, dict[str, Any]]], source: str) -> list[str]:
    """The text task's rows as they come; a bad row's error comes once the rest is read
    (``read_whole``), as ``build_numbered``'s does."""
    return read_whole(numbered, lambda rows: _text_column(rows, source))


def _text_column(rows: Iterator[tuple[int, dict[str, Any]]], source: str) -> list[str]:
    texts = []
    for number, row in rows:
        if row.get("text") is None:
            raise ValueError(
                f"{source}, row {number}: missing column 'text' (task text needs text)"
            )
        if not isinstance(row["text"], str):
            raise not_text(source, number, "text", row["text"])
        texts.append(row["text"])
    return texts


class CountingData:
    def __init__(
        self, vocab_size: int, seq_len: int, eval_size: int, seed: int, eval_batch_size: int
    ) -> None:
        self.task = CountingTask(vocab_size, seq_len=seq_len, seed=seed)
        self.eval_size = eval_size
        self.longest = seq_len
        self.eval_batch_size = eval_batch_size
        self.rows_per_example = 1
        self.cut_notices: tuple[str, ...] = ()

    @functools.cached_property
    def eval_set(self) -> dict[str, torch.Tensor]:
        """Drawn on the first evaluation: the memory plan, which sizes it, comes first."""
        return self.task.eval_set(self.eval_size)

    def batch(self, batch_size: int, step: int) -> dict[str, torch.Tensor]:
        return self.task.batch(batch_size, step)


class TextData:
    def __init__(
        self,
        rows: LoadedRows,
        encoder: PromptEncoder,
        seed: int,
        eval_batch_size: int,
        share: RowShare = WHOLE,
        trains: bool = True,
    ) -> None:
        """``share``: the part of the training and evaluation rows this process reads the
        lengths of; ``trains``: False for a scoring run (``--max-steps 0``), whose training
        rows are never tokenized (minutes on every rank for a million rows) nor counted
        in a cut notice, as no step takes them."""
        self.train = TextTrainData(rows.train, encoder, seed, share) if trains else None
        self.eval_set, eval_cut = _padded(rows.eval, encoder, share, "--eval-file")
        dev = _padded(rows.dev, encoder, share, "--num-dev") if rows.dev else None
        self.dev_set: PaddedRows | None = dev[0] if dev else None
        self.eval_batch_size = eval_batch_size
        evaluated = [self.eval_set] + ([self.dev_set] if self.dev_set else [])
        trained = self.train.width if self.train else 0
        self.longest = max(trained, *(padded.width for padded in evaluated))
        self.rows_per_example = 1 if trains else 0
        limit = token_limit(encoder.max_length)
        self.cut_notices = _notices(
            [
                Cuts("--train-file", len(rows.train), self.train.cut).notice(limit)
                if self.train
                else None,
                Cuts("--eval-file", len(rows.eval), eval_cut).notice(limit),
            ]
            + (
                [Cuts(dev_set_name(rows.dev_option), len(rows.dev), dev[1]).notice(limit)]
                if dev
                else []
            )
        )

    def batch(self, batch_size: int, step: int) -> dict[str, torch.Tensor]:
        if self.train is None:
            raise RuntimeError("a scoring run (--max-steps 0) has no training batches")
        return self.train.batch(batch_size, step)


def _padded(
    texts: list[str], encoder: PromptEncoder, share: RowShare, flag: str
) -> tuple[PaddedRows, int]:
    """An evaluated set of texts, this rank holding the tokens of its share, and the rows
    the token limit cuts in it (every share's count)."""
    span, held = share.span(len(texts)), TokenRows()  # the rows this rank evaluates
    parts = share.meet(lambda: text_lengths(encoder, texts, span, held.append))
    width = max(width for _, width, _ in parts)
    padded = PaddedRows(texts, encoder, width, held, span)
    if padded.width < 2:  # a next token to predict: the metrics' denominator
        raise ValueError(
            f"{flag}: no row has a next token to predict (a row needs two tokens or "
            "more after tokenization); give longer rows"
        )
    return padded, sum(cut for cut, _, _ in parts)


def _notices(lines: Iterable[str | None]) -> tuple[str, ...]:
    return tuple(line for line in lines if line)


class PromptData:
    """A prompt task trained with ``objective`` (``lm``, ``classification``, ``accuracy``,
    ``f1``)."""

    def __init__(
        self,
        rows: LoadedRows,
        encoder: PromptEncoder,
        seed: int,
        eval_batch_size: int,
        max_new_tokens: int = 16,
        objective: str | None = None,
        share: RowShare = WHOLE,
        trains: bool = True,
    ) -> None:
        """``share``: the part of each file's rows this process reads the lengths of (the
        job's ranks split the pass; the batches are every rank's whole); ``trains``: False
        for a scoring run (``--max-steps 0``), whose training rows (``--num-demos``' source,
        as text) are never tokenized nor counted in a cut notice, as no step takes them."""
        self.kind = TASKS[rows.task].kind
        self.objective = objective or default_objective(rows.task)
        check_objective(rows.task, self.objective)
        if self.kind == "generation":  # before any prompt is encoded or model run
            encoder.check_room(max_new_tokens)
        self.train_examples: list[Example] = rows.train
        self.eval_examples: list[Example] = rows.eval
        self.dev_examples: list[Example] = rows.dev  # --num-dev: evaluated during training
        self.encoder, self.eval_batch_size, self.max_new_tokens = (
            encoder,
            eval_batch_size,
            max_new_tokens,
        )
        self.train: ChoiceTrainData | PromptOnlyTrainData | PromptTrainData
        if self.objective in ("classification", "accuracy"):
            self.train = ChoiceTrainData(rows.train, encoder, seed)
        elif self.objective == "f1":
            self.train = PromptOnlyTrainData(rows.train, encoder, seed, max_new_tokens)
        else:
            self.train = PromptTrainData(rows.train, encoder, seed)
        train, train_longest, rows_per_example = (
            self._cuts("--train-file", rows.train, True, share) if trains else (None, 0, 0)
        )
        evals, eval_longest, eval_rows = self._cuts("--eval-file", rows.eval, False, share)
        devs, dev_longest, dev_rows = (
            self._cuts(dev_set_name(rows.dev_option), rows.dev, False, share)
            if rows.dev
            else (None, 0, 0)
        )
        # the most rows an evaluated example takes (a choice evaluation's, which the memory
        # plan and the calls read): counted here, each rank its share, where every rank
        # encoding every example one call at a time, and keeping them all, was 24 s and
        # 155 MB of each rank's build for 50k SST-2 rows
        self.eval_rows, self.dev_rows = eval_rows, dev_rows
        extra = max_new_tokens if self.kind == "generation" else 0
        longest = max(train_longest, eval_longest, dev_longest)
        self.longest = min(longest + extra, encoder.max_length)
        evaluated = self._limit(trained=False)
        self.cut_notices = _notices(
            [train.notice(self._limit(trained=True)) if train else None, evals.notice(evaluated)]
            + ([devs.notice(evaluated)] if devs else [])
        )
        self.rows_per_example = rows_per_example

    def _decodes(self, trained: bool) -> bool:
        """Whether the file's prompts are decoded from (room kept for the answer)."""
        return self.kind == "generation" and (self.objective == "f1" or not trained)

    def _limit(self, trained: bool) -> str:
        limit = self.encoder.max_length
        if not self._decodes(trained):
            return token_limit(limit)
        room = self.max_new_tokens
        return (
            f"{limit - room} tokens (--max-length, or the model's positions, less "
            f"--max-new-tokens {room})"
        )

    def _cuts(
        self, file: str, examples: list[Example], trained: bool, share: RowShare
    ) -> tuple[Cuts, int, int]:
        """The rows of ``file`` the token limit cuts, in the sequences training (or
        evaluation) runs, the file's longest joint sequence before any cut, and the most
        rows an example becomes (trained, or evaluated by its candidates): each part of
        ``share`` reads its rows' lengths and the parts' tallies add up (the longest and the
        most rows: the parts' largest)."""
        span = share.span(len(examples))
        parts = share.meet(lambda: self._tally(examples[span.start : span.stop], trained))
        cut, answers, alike = (sum(part[k] for part in parts) for k in range(3))
        longest, rows = (max(part[k] for part in parts) for k in (3, 4))
        return Cuts(file, len(examples), cut, answers, alike), longest, rows

    def _tally(self, examples: list[Example], trained: bool) -> tuple[int, int, int, int, int]:
        """``_cuts``' counts over ``examples`` (rows cut, answers cut, candidates made
        alike), its longest sequence and most rows: one pass, each text tokenized once
        (batched), the encodings dropped (a million rows' were gigabytes, on every rank)."""
        encoder, longest, cut, answers, alike = self.encoder, 0, 0, 0, 0
        only_right = trained and self.objective == "lm"
        # a trained example's candidates on rows of their own where the objective scores
        # them all; every evaluated one's where the evaluation picks a candidate
        choices = (
            self.objective in ("classification", "accuracy")
            if trained
            else self.kind != "generation"
        )
        rows = 1
        for e, (head, joints) in zip(examples, encoder.joints(examples)):
            sizes = [(len(ids), answer) for ids, answer in joints]
            longest = max(longest, *(tokens for tokens, _ in sizes))
            if choices:
                rows = max(rows, len(choice_encoding(e, encoder.fitted(joints)).rows))
            if self._decodes(trained):
                room = encoder.max_length - self.max_new_tokens
                cut += len(head) > room
                continue
            used = [sizes[e.label]] if only_right else sizes
            cut += any(tokens > encoder.max_length for tokens, _ in used)
            lost = any(answer > encoder.answer_room for _, answer in used)
            answers += lost
            alike += lost and not only_right and not distinct(encoder.fitted(joints))
        return cut, answers, alike, longest, rows

    def batch(self, batch_size: int, step: int) -> dict[str, torch.Tensor]:
        return self.train.batch(batch_size, step)


class MaskedPromptData:
    """A masked LM's prompt task (MeZO's RoBERTa prompts, ``distzo.data.masked_prompts``):
    one row per example, every label word scored at its ``<mask>``, trained and evaluated
    as a causal LM's choices are (``ChoiceTrainData``, the job's choice evaluation)."""

    kind = "classification"
    eval_rows = dev_rows = 1  # the prompt scores every candidate
    max_new_tokens = 0

    def __init__(
        self,
        rows: LoadedRows,
        encoder: MaskedPromptEncoder,
        seed: int,
        eval_batch_size: int,
        objective: str | None = None,
        share: RowShare = WHOLE,
        trains: bool = True,
    ) -> None:
        """``trains``: False for a scoring run (``--max-steps 0``): its training rows are
        never tokenized nor counted in a cut notice."""
        self.objective = objective or "classification"
        if self.objective not in ("classification", "accuracy"):
            raise ValueError(
                f"--objective {self.objective} does not apply to a masked LM's --task "
                f"{rows.task}; choose classification (MeZO's loss) or accuracy"
            )
        self.train_examples: list[MaskedExample] = rows.train
        self.eval_examples: list[MaskedExample] = rows.eval
        self.dev_examples: list[MaskedExample] = rows.dev
        # scored beside accuracy, and what the best dev step is chosen by (cola's mcc...)
        self.metric = MASKED_PROMPTS[rows.task].metric
        self.encoder, self.eval_batch_size = encoder, eval_batch_size
        self.train = ChoiceTrainData(rows.train, encoder, seed)
        self.rows_per_example = 1 if trains else 0
        files = [("--train-file", rows.train)] if trains else []
        files += [("--eval-file", rows.eval)]
        files += [(dev_set_name(rows.dev_option), rows.dev)] if rows.dev else []
        notices: list[str | None] = []
        self.longest = 0
        for flag, examples in files:
            span = share.span(len(examples))
            parts = share.meet(lambda: self._lengths(examples, span, flag))
            self.longest = max(self.longest, *(longest for longest, _ in parts))
            cut = sum(cut for _, cut in parts)
            notices.append(
                f"{flag}: {cut} of {len(examples)} rows are longer than "
                f"{token_limit(encoder.max_length)}: they lose tokens from the end, their "
                "<mask> kept (MeZO's cut); raise --max-length or shorten the rows"
                if cut
                else None
            )
        self.cut_notices = _notices(notices)

    def _lengths(self, examples: list[MaskedExample], span: range, flag: str) -> tuple[int, int]:
        """The longest row of ``span``'s examples, and how many the limit cuts; a row whose
        ``<mask>`` the limit cuts off is refused (MeZO's assertion), naming its row."""
        longest = cut = 0
        for start in range(span.start, span.stop, ENCODE_CHUNK):
            chunk = examples[start : min(start + ENCODE_CHUNK, span.stop)]
            for index, (ids, full) in enumerate(self.encoder.encode_ids(chunk), start):
                problem = self.encoder.mask_problem(ids, full)
                if problem:
                    # the row as its file numbers it (the drawn sets' order is no file's)
                    row = examples[index].row
                    named = f"row {row}" if row else f"example {index + 1}"
                    raise ValueError(f"{flag}, {named}: {problem}")
                longest, cut = max(longest, len(ids)), cut + (full > len(ids))
        return longest, cut

    def batch(self, batch_size: int, step: int) -> dict[str, torch.Tensor]:
        return self.train.batch(batch_size, step)
