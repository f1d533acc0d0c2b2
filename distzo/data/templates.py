"""MeZO's prompt-based tasks: each row becomes a prompt and its candidate continuations.

A classification or multiple-choice example is a prompt plus one continuation per
candidate (the verbalizer's words, or the choices); training uses the correct one and
puts the loss on its tokens only, evaluation scores every candidate by its mean token
log-likelihood. A generation example (SQuAD) is a prompt and gold answers; training
uses the first answer, evaluation decodes greedily and scores F1 / exact match.

The prompt wordings and verbalizers are MeZO's (Malladi et al., 2023), most of them
from PromptSource. Row schema of each task (the columns of its local file, the same
names as the Hugging Face datasets):

| task | columns | label |
|---|---|---|
| sst2 | sentence, label | 0 negative, 1 positive |
| rte | premise, hypothesis, label | 0 entailment, 1 not_entailment |
| cb | premise, hypothesis, label | 0 entailment, 1 contradiction, 2 neutral |
| boolq | passage, question, label | 0 false, 1 true (or true/false) |
| wic | word, sentence1, sentence2, label | 0 different, 1 same meaning |
| copa | premise, question, choice1, choice2, label | 0 choice1, 1 choice2; question: cause/effect |
| multirc | paragraph, question, answer, label | 0 wrong, 1 right answer |
| wsc | text, span1_text, span2_text, label | 0 no, 1 the pronoun span2 refers to span1 |
| record | passage, query, entities, answers | entities: the candidates; answers: the right ones |
| squad | title, context, question, answers | answers: a list of strings, or {"text": [...]} |
| drop | passage, question, answers_spans | answers_spans: {"spans": [...]}, or a list |

A label is its index or, for sst2, rte and cb, its name as above: SuperGLUE's own RTE
and CB files and GLUE's RTE TSV write the names.
"""

from __future__ import annotations

import functools
import json
import reprlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from distzo.data.loaders import read_whole
from distzo.runtime import json_text


# slots: every rank holds every row's Example, and a __dict__ was 40 of its 112 bytes
@dataclass(frozen=True, slots=True)
class Example:
    prompt: str
    continuations: tuple[str, ...]  # appended to the prompt: one per candidate, or the answer
    label: int  # index of the right continuation (the one trained on)
    answers: tuple[str, ...] = ()  # generation tasks: every gold answer (scoring)
    right: tuple[int, ...] = ()  # every right continuation where several are (ReCoRD)


@dataclass(frozen=True, slots=True)
class MaskedExample:
    """A row of a masked LM's prompt task (MeZO's RoBERTa tasks): its sentences as written,
    in the template's order. No prompt text: the template tokenizes each part on its own
    (``distzo.data.masked_prompts``), which a joint text would not reproduce."""

    sentences: tuple[str, ...]
    label: int
    # the row's number in its file (0: not read from one), for a refusal of its encoding
    # to name it after the sets are drawn: no part of the row's identity or digest
    row: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # "classification" (incl. multiple choice) or "generation"
    columns: tuple[str, ...]
    # the row (and, where ``numbered``, its number in its file) -> its example, None: left out
    build: Callable[..., Example | MaskedExample | None]
    num_labels: int = 0
    label_names: tuple[str, ...] = ()  # the class names a row's label may give, by index
    numbered: bool = False

    def reads_names(self, names: Sequence[str]) -> bool:
        """Whether every one of ``names`` (an ``hf:`` split's ``ClassLabel``'s) is a class
        name this task reads: its rows then give the name, whose index is the task's, where
        the split's own numbering may differ (CogComp/trec's 0 is ABBR, the task's 0 DESC)."""
        return bool(self.label_names) and all(
            isinstance(_named(name, self.label_names), int) for name in names
        )


# The names a dataset's own files write for a label, in index order (SuperGLUE's RTE and
# CB .jsonl, GLUE's RTE TSV): read as the index the Hugging Face datasets give them.
LABEL_NAMES = {
    "sst2": ("negative", "positive"),
    "rte": ("entailment", "not_entailment"),
    "cb": ("entailment", "contradiction", "neutral"),
}


def _named(value: Any, names: tuple[str, ...]) -> Any:
    """``value``'s index where it is one of ``names`` (any case, a space for the
    underscore), else ``value`` as it was."""
    if isinstance(value, str):
        key = value.strip().lower().replace(" ", "_")
        if key in names:
            return names.index(key)
    return value


# GLUE's and SuperGLUE's test splits on the hub hide their labels (-1) and answers ([])
HIDDEN_ANSWERS = "a test split hides them (GLUE's, SuperGLUE's): use its validation split"


def _not_a_label(value: Any, count: int, names: tuple[str, ...]) -> ValueError:
    named = f" or a name: {', '.join(names)}" if names else ""
    return ValueError(f"label {value!r} is not an integer; write one of 0..{count - 1}{named}")


def row_label(row: dict[str, Any], count: int, names: tuple[str, ...] = ()) -> int:
    value = _named(row["label"], names)
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        value = int(value.strip().lower() == "true")
    if isinstance(value, str) and "." in value:  # "1.0": pandas writes a float column so
        try:
            value = float(value)  # and datasets' csv loader reads it back as 1.0
        except ValueError:
            pass
    if isinstance(value, float) and not value.is_integer():  # int() would truncate 1.5 to 1
        raise _not_a_label(value, count, names)
    try:
        label = int(value)
    except (TypeError, ValueError):
        raise _not_a_label(value, count, names) from None
    if label == -1:  # datasets' ClassLabel for "no label", what hub test splits hold
        raise ValueError(f"label -1 marks a row with no label; {HIDDEN_ANSWERS}")
    if not 0 <= label < count:
        raise ValueError(f"label {label} is outside 0..{count - 1}")
    return label


def _verbalized(
    prompt: str,
    words: tuple[str, ...],
    row: dict[str, Any],
    separator: str = "",
    names: tuple[str, ...] = (),
) -> Example:
    label = row_label(row, len(words), names)
    return Example(prompt, _candidates(words, separator), label)


@functools.cache  # a few verbalizers: a row's own choices (COPA's) do not come here
def _candidates(words: tuple[str, ...], separator: str) -> tuple[str, ...]:
    """A verbalizer's continuations, one tuple every row of the task shares: built anew for
    each row, they were 170 of an SST-2 row's 450 bytes, held by every rank."""
    return tuple(separator + w for w in words)


def _sst2(row):
    return _verbalized(
        f"{row['sentence'].strip()} It was", ("terrible", "great"), row, " ", LABEL_NAMES["sst2"]
    )


def _rte(row):
    prompt = f'{row["premise"]}\nDoes this mean that "{row["hypothesis"]}" is true? Yes or No?\n'
    return _verbalized(prompt, ("Yes", "No"), row, names=LABEL_NAMES["rte"])


def _cb(row):
    prompt = (
        f'Suppose {row["premise"]} Can we infer that "{row["hypothesis"]}"? Yes, No, or Maybe?\n'
    )
    return _verbalized(prompt, ("Yes", "No", "Maybe"), row, names=LABEL_NAMES["cb"])


def _boolq(row):
    # MeZO's BoolQDataset.get_template() defaults to version 2, BoolQTemplateV3: the answer
    # on a line of its own ("...?\nYes"), not the version 0 "...? Yes"
    question = row["question"].strip()
    question = question if question.endswith("?") else question + "?"
    return _verbalized(
        f"{row['passage']} {question[0].upper() + question[1:]}\n", ("No", "Yes"), row
    )


def _wic(row):
    # A sentence's surrounding whitespace is not part of it: sentence2's trailing space and
    # the newline after it were one token alone and two in the joint text, so each candidate
    # was scored on the prompt's whitespace as well as its own word.
    prompt = (
        f'Does the word "{row["word"]}" have the same meaning in these two sentences? Yes, No?\n'
        f"{row['sentence1'].strip()}\n{row['sentence2'].strip()}\n"
    )
    return _verbalized(prompt, ("No", "Yes"), row)


def _copa(row):
    conjunctions = {"cause": " because ", "effect": " so "}
    if row["question"] not in conjunctions:
        raise ValueError(f"question {row['question']!r} must be cause or effect")
    for column in ("choice1", "choice2"):  # a blank candidate has no tokens of its own to score
        if not row[column].strip():
            raise ValueError(f"{column} is empty; write the choice's text")
    premise = row["premise"].rstrip()
    premise = premise[:-1] if premise.endswith(".") else premise

    def lower_first(choice: str) -> str:  # "I" stays capital, as in MeZO
        words = choice.split(" ")
        if words[0] != "I":
            words[0] = words[0].lower()
        return " ".join(words)

    # A choice's surrounding whitespace is not part of it: a leading space doubled the one
    # after the conjunction and kept the capital, a trailing one was a scored token.
    choices = (lower_first(row["choice1"].strip()), lower_first(row["choice2"].strip()))
    if choices[0] == choices[1]:  # scored alike: the "prediction" is a tie's
        raise ValueError(
            f"choice1 and choice2 are the same text ({reprlib.repr(row['choice1'].strip())}); "
            "a row needs two choices a model can tell apart"
        )
    # its own Example: ``_verbalized`` keeps a verbalizer's tuple for good, and COPA's
    # choices differ each row
    return Example(premise + conjunctions[row["question"]], choices, row_label(row, 2))


def _multirc(row):
    prompt = (
        f"{row['paragraph']}\nQuestion: {row['question']}\n"
        f'I found this answer "{row["answer"]}". Is that correct? Yes or No?\n'
    )
    return _verbalized(prompt, ("No", "Yes"), row)


def _wsc(row):
    # SuperGLUE's span1_index and span2_index locate the spans; MeZO's template reads
    # their text only, and so does this one
    prompt = (
        f"{row['text']}\nIn the previous sentence, does the pronoun "
        f'"{row["span2_text"].lower()}" refer to {row["span1_text"]}? Yes or No?\n'
    )
    return _verbalized(prompt, ("No", "Yes"), row)


def _decoded(column: str, value: Any) -> Any:
    """A CSV cell holding a JSON list (or object) as its list; a bracketed cell that is not
    JSON (pandas writes Python's repr) is refused, not taken as one string."""
    if not (isinstance(value, str) and value.strip()[:1] in ("[", "{")):
        return value
    try:
        return json_text.loads(value)
    except json.JSONDecodeError:
        raise ValueError(
            f"{column} {reprlib.repr(value)} is a list written as text but not as JSON; "
            'write it as JSON (["...", "..."]) or use a .jsonl or .parquet file'
        ) from None


def _strings(row: dict[str, Any], column: str, key: str | None) -> list[str]:
    """``row[column]`` as a non-empty list of non-blank strings: a list, one plain string,
    or an object holding the list under ``key`` (SQuAD's ``text``, DROP's ``spans``)."""
    values = _decoded(column, row[column])
    if key is not None and isinstance(values, dict):
        values = values.get(key, [])
    if isinstance(values, str):
        values = [values]
    if not values or not all(isinstance(v, str) for v in values):
        shape = f' (or {{"{key}": [...]}})' if key else ""
        raise ValueError(f"{column} must be a non-empty list of strings{shape}")
    if not all(v.strip() for v in values):  # trained on nothing, matched by any empty answer
        raise ValueError(f"{column} {reprlib.repr(values)} hold an empty one; remove it")
    return values


def _generation(prompt: str, answers: list[str]) -> Example:
    # trained on the first answer's own words: its surrounding whitespace would be label
    # tokens; scored against every answer
    return Example(prompt, (f" {answers[0].strip()}\n",), 0, tuple(answers))


def _squad(row):
    prompt = (
        f"Title: {row['title']}\nContext: {row['context']}\n"
        f"Question: {row['question'].strip()}\nAnswer:"
    )
    return _generation(prompt, _strings(row, "answers", "text"))


def _drop(row):
    prompt = f"Passage: {row['passage']}\nQuestion: {row['question'].strip()}\nAnswer:"
    return _generation(prompt, _strings(row, "answers_spans", "spans"))


def _record(row):
    """MeZO's GPT-3 style ReCoRD prompt: the passage's highlights as a list, each candidate
    the query with an entity in its placeholder. Trained on the first answer; any answer
    is a right pick (MeZO's accuracy)."""
    if "@placeholder" not in row["query"]:  # every candidate would be the same text
        raise ValueError(
            f"query {reprlib.repr(row['query'])} holds no @placeholder; write the entity's "
            "place in it as @placeholder"
        )
    # an entity named twice is one candidate: its copies score alike
    entities = list(dict.fromkeys(_strings(row, "entities", None)))
    if isinstance(row["answers"], list) and not row["answers"]:
        raise ValueError(f"answers is empty: the row has no right entity; {HIDDEN_ANSWERS}")
    answers = _strings(row, "answers", None)
    stray = [a for a in answers if a not in entities]
    if stray:
        raise ValueError(
            f"answer {reprlib.repr(stray[0])} is not one of the entities; a right answer "
            "must be a candidate"
        )
    passage = row["passage"].replace("@highlight\n", "- ")
    continuations = tuple(" " + row["query"].replace("@placeholder", e) for e in entities)
    right = tuple(sorted({entities.index(a) for a in answers}))
    right = right if len(right) > 1 else ()
    return Example(f"{passage}\n-", continuations, entities.index(answers[0]), right=right)


PREMISE = ("premise", "hypothesis", "label")  # RTE's and CB's columns
TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("sst2", "classification", ("sentence", "label"), _sst2, 2, LABEL_NAMES["sst2"]),
        Task("rte", "classification", PREMISE, _rte, 2, LABEL_NAMES["rte"]),
        Task("cb", "classification", PREMISE, _cb, 3, LABEL_NAMES["cb"]),
        Task("boolq", "classification", ("passage", "question", "label"), _boolq, 2),
        Task("wic", "classification", ("word", "sentence1", "sentence2", "label"), _wic, 2),
        Task(
            "copa",
            "classification",
            ("premise", "question", "choice1", "choice2", "label"),
            _copa,
            2,
        ),
        Task(
            "multirc", "classification", ("paragraph", "question", "answer", "label"), _multirc, 2
        ),
        Task("wsc", "classification", ("text", "span1_text", "span2_text", "label"), _wsc, 2),
        Task("record", "classification", ("passage", "query", "entities", "answers"), _record),
        Task("squad", "generation", ("title", "context", "question", "answers"), _squad),
        Task("drop", "generation", ("passage", "question", "answers_spans"), _drop),
    )
}


GENERATION = tuple(name for name, task in TASKS.items() if task.kind == "generation")


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(
            f"unknown --task {name!r}; choose one of counting, text, {', '.join(TASKS)}"
        ) from None


# the columns a template reads as something else (a label, a list)
NOT_TEXT = ("label", "answers", "entities", "answers_spans")
# Other datasets' names for a task's columns: (task, theirs) -> (ours, whose names they are)
OTHER_NAMES = {
    ("rte", "sentence1"): ("premise", "GLUE's rte (nyu-mll/glue)"),
    ("rte", "sentence2"): ("hypothesis", "GLUE's rte (nyu-mll/glue)"),
    ("boolq", "answer"): ("label", "google/boolq"),
    ("sst5", "text"): ("sentence", "SetFit/sst5"),
    ("trec", "text"): ("sentence", "CogComp/trec"),
    ("trec", "coarse_label"): ("label", "CogComp/trec"),
    **{(task, "text"): ("sentence", "a hub copy") for task in ("mr", "cr", "mpqa", "subj")},
}
# what the renamed column must hold, where the other dataset's values mean something else
RENAMING_NOTES = {
    ("trec", "coarse_label"): (
        " (an hf: split gives its class names; a file must write them (ABBR, DESC...), not "
        "its numbers: its 0 is ABBR, LM-BFF's 0 Description)"
    ),
    # SentEval's numbers, LM-BFF's: a copy that counts objective first swaps them silently
    ("subj", "text"): " and keep LM-BFF's labels: 0 subjective, 1 objective",
}


def _renaming(task: str, columns: tuple[str, ...], row: dict[str, Any], column: str) -> str:
    """A hint where ``row`` lacks ``column`` of the task's ``columns``: the ``--columns``
    that reads every column the row has under another dataset's names, or else the
    ``--columns`` that would read one of the row's other columns."""
    for (name, theirs), (ours, whose) in OTHER_NAMES.items():
        if name == task and ours == column and theirs in row:
            pairs = [
                (o, t)
                for (n, t), (o, w) in OTHER_NAMES.items()
                if n == task and w == whose and t in row
            ]
            notes = "".join(RENAMING_NOTES.get((task, t), "") for _, t in pairs)
            mapping = ",".join(f"{o}={t}" for o, t in pairs)
            return (
                f"; the file has {theirs!r}, as {whose} names it: read it as {column!r} with "
                f"--columns {mapping}{notes}"
            )
    others = [name for name in row if name not in columns]
    if others:  # SetFit/sst2's text, a file of the user's own names
        return (
            f"; the row also has {', '.join(map(repr, others))}: --columns {column}=COLUMN "
            f"reads one of them as {column!r}"
        )
    return f"; give every row its {column!r}"  # no column to read it from: the data lacks it


def not_text(source: str, number: int, column: str, value: Any) -> ValueError:
    """The error for a cell that should hold text and holds ``value`` (a number, a list)."""
    return ValueError(
        f"{source}, row {number}: column {column!r} holds {reprlib.repr(value)} "
        f"({type(value).__name__}), not text; write it as a string"
    )


def build_examples(
    task: Task, rows: list[dict[str, Any]], source: str, numbers: Sequence[int] | None = None
) -> list[Any]:
    """Every row as an Example; a bad row is a one-line error naming the file and the row
    (``numbers``: each row's number in its file, where blank lines make it differ)."""
    return build_numbered(task, zip(numbers or range(1, len(rows) + 1), rows), source)


def build_numbered(
    task: Task, numbered: Iterable[tuple[int, dict[str, Any]]], source: str
) -> list[Any]:
    """``build_examples`` of (number, row) pairs as they come (a file's, read a row at a
    time: no list of a million dicts beside their Examples); a bad row's error comes once
    the rest is read (``read_whole``)."""
    return read_whole(iter(numbered), lambda rows: _build(task, rows, source))


def _build(task: Task, numbered: Iterator[tuple[int, dict[str, Any]]], source: str) -> list[Any]:
    examples = []
    for number, row in numbered:
        missing = [c for c in task.columns if c not in row or row[c] is None]
        if missing:
            raise ValueError(
                f"{source}, row {number}: missing column {missing[0]!r} (task {task.name} needs "
                f"{', '.join(task.columns)}){_renaming(task.name, task.columns, row, missing[0])}"
            )
        wrong = [c for c in task.columns if c not in NOT_TEXT and not isinstance(row[c], str)]
        if wrong:  # a number or a list would be formatted into the prompt as its repr
            raise not_text(source, number, wrong[0], row[wrong[0]])
        try:
            example = task.build(row, number) if task.numbered else task.build(row)
        except (ValueError, AttributeError, TypeError) as err:
            raise ValueError(f"{source}, row {number}: {err}") from None
        if example is not None:
            examples.append(example)
    return examples
