"""MeZO's RoBERTa prompts (its ``medium_models``, LM-BFF's format): a masked LM's task rows.

A row's sentences go into a template such as ``*cls**sent_0*_It_was*mask*.*sep+*``, whose
parts are tokenized one by one (no special tokens of the tokenizer's own): ``*cls*``,
``*mask*``, ``*sep+*`` are the tokenizer's tokens; ``sent_i`` is sentence i, ``+sent_i``
with a space before it, ``sentl_i`` its first letter lower-cased, ``sent-_i`` its last
character dropped; any other part is literal text, ``_`` a space (one character: that
token itself). Sentence 0 keeps at most ``first_limit`` tokens, any other
``other_limit``, and the whole row at most ``max_length`` (its end is cut, as MeZO's).
The answer is read at the ``<mask>``: each label word, a space before it, is one token
of the vocabulary, and the row scores every one at the mask's own position. Encoded
this way, a row's ids equal those of MeZO's ``tokenize_multipart_input``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from distzo.data.encoding import IDS_ONLY
from distzo.data.templates import LABEL_NAMES, MaskedExample, Task, row_label
from distzo.objectives import ChoiceEncoding

SENTIMENT = "*cls**sent_0*_It_was*mask*.*sep+*"  # sst2, sst5, mr, cr, mpqa
THIS_IS = "*cls**sent_0*_This_is*mask*.*sep+*"  # cola, subj
PAIR = "*cls**sent_0**mask*,*+sentl_1**sep+*"  # qqp, mrpc
INFERENCE = "*cls**sent-_0*?*mask*,*+sentl_1**sep+*"  # rte, qnli, mnli, snli
QUESTION = "*cls**mask*:*+sent_0**sep+*"  # trec

MASKED_LENGTH = 128  # MeZO's --max_seq_length, unless a task's line in run_fewshot.sh sets 256


@dataclass(frozen=True)
class MaskedPrompt:
    """One task's line of MeZO's ``run_fewshot.sh``: its template, its label words (by the
    label's index), its truncation, and the row's columns that fill ``sent_0``, ``sent_1``."""

    template: str
    words: tuple[str, ...]
    columns: tuple[str, ...]
    first_limit: int | None = None
    other_limit: int | None = None
    max_length: int = MASKED_LENGTH
    label_names: tuple[str, ...] = ()
    drops_unlabelled: bool = False  # rows of label -1 (no gold label) left out, not refused
    # GLUE's metric of the task beside accuracy (``distzo.objectives.confusion``), by which
    # MeZO's trainer chooses the best dev step (``default_dev_objective``: f1, then mcc)
    metric: str = "accuracy"


NLI_NAMES = ("entailment", "neutral", "contradiction")  # GLUE's MNLI and SNLI's index order
SST5_NAMES = ("very_negative", "negative", "neutral", "positive", "very_positive")  # SetFit's
# TREC's coarse classes in LM-BFF's numbering (Description, Entity, Expression...): the
# names CogComp/trec's ClassLabel gives them, whose own numbers order them ABBR, ENTY,
# DESC, so that its 0 and 2 are LM-BFF's 2 and 0; a row names its class to be read right.
TREC_NAMES = ("desc", "enty", "abbr", "hum", "loc", "num")
MASKED_PROMPTS: dict[str, MaskedPrompt] = {
    "sst2": MaskedPrompt(
        SENTIMENT, ("terrible", "great"), ("sentence",), label_names=LABEL_NAMES["sst2"]
    ),
    "sst5": MaskedPrompt(
        SENTIMENT,
        ("terrible", "bad", "okay", "good", "great"),
        ("sentence",),
        110,
        20,
        label_names=SST5_NAMES,
    ),
    "mr": MaskedPrompt(SENTIMENT, ("terrible", "great"), ("sentence",), 110, 50),
    "cr": MaskedPrompt(SENTIMENT, ("terrible", "great"), ("sentence",), 110, 50),
    "mpqa": MaskedPrompt(SENTIMENT, ("terrible", "great"), ("sentence",), 110),
    "subj": MaskedPrompt(THIS_IS, ("subjective", "objective"), ("sentence",), 110, 50),
    "cola": MaskedPrompt(THIS_IS, ("incorrect", "correct"), ("sentence",), metric="mcc"),
    "trec": MaskedPrompt(
        QUESTION,
        ("Description", "Entity", "Expression", "Human", "Location", "Number"),
        ("sentence",),
        110,
        label_names=TREC_NAMES,
    ),
    "qqp": MaskedPrompt(PAIR, ("No", "Yes"), ("question1", "question2"), metric="f1"),
    "mrpc": MaskedPrompt(PAIR, ("No", "Yes"), ("sentence1", "sentence2"), metric="f1"),
    "qnli": MaskedPrompt(
        INFERENCE,
        ("Yes", "No"),
        ("question", "sentence"),
        label_names=("entailment", "not_entailment"),
    ),
    "rte": MaskedPrompt(
        INFERENCE,
        ("Yes", "No"),
        ("premise", "hypothesis"),
        240,
        max_length=256,
        label_names=LABEL_NAMES["rte"],
    ),
    "mnli": MaskedPrompt(
        INFERENCE,
        ("Yes", "Maybe", "No"),
        ("premise", "hypothesis"),
        240,
        max_length=256,
        label_names=NLI_NAMES,
    ),
    "snli": MaskedPrompt(
        INFERENCE,
        ("Yes", "Maybe", "No"),
        ("premise", "hypothesis"),
        max_length=256,
        label_names=NLI_NAMES,
        drops_unlabelled=True,  # LM-BFF's SNLI files hold no row without a gold label
    ),
}


def _masked_example(prompt: MaskedPrompt, row: dict[str, Any], number: int) -> MaskedExample | None:
    if prompt.drops_unlabelled and str(row["label"]).strip() in ("-1", "-"):
        return None  # no gold label (datasets' -1, SNLI's own files' "-"): no row of the set
    label = row_label(row, len(prompt.words), prompt.label_names)
    return MaskedExample(tuple(row[column] for column in prompt.columns), label, number)


MASKED_TASKS: dict[str, Task] = {
    name: Task(
        name,
        "classification",
        (*prompt.columns, "label"),
        functools.partial(_masked_example, prompt),
        len(prompt.words),
        prompt.label_names,
        numbered=True,
    )
    for name, prompt in MASKED_PROMPTS.items()
}

_SPECIAL = {"cls": "cls_token_id", "mask": "mask_token_id", "sep": "sep_token_id"}
_SPECIAL |= {"sep+": "sep_token_id", "bos": "bos_token_id", "eos": "eos_token_id"}
# a sentence part: [+]sent[l|u][-]_i (a space before, first letter lower/upper, last dropped)
_SENTENCE = re.compile(r"(\+?)sent([lu]?)(-?)_(\d+)")


@dataclass(frozen=True)
class _Sentence:
    index: int
    space: bool
    case: str  # "", "l" (first letter lower-cased) or "u" (upper-cased)
    drop_last: bool

    def text(self, sentences: Sequence[str]) -> str:
        text = sentences[self.index]
        if self.case:
            first = text[:1].lower() if self.case == "l" else text[:1].upper()
            text = first + text[1:]
        text = text[:-1] if self.drop_last else text
        return " " + text if self.space else text


class MaskedPromptEncoder:
    """A masked LM's rows of one task (``MASKED_PROMPTS``), as choice encodings: one row per
    example, every label word scored at its ``<mask>``. Refuses, in one line at
    construction (before any weights load), a tokenizer with no mask token or one in
    which a label word is not one token."""

    def __init__(self, tokenizer: Any, task: str, max_length: int) -> None:
        self.tokenizer, self.task, self.prompt = tokenizer, task, MASKED_PROMPTS[task]
        self.max_length = max_length
        self.mask_id = self._special("mask")
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self.word_ids = tuple(self._word_id(word) for word in self.prompt.words)
        # the template's parts: a token's ids (special or literal), or a sentence to encode
        self.parts: list[list[int] | _Sentence] = [
            self._part(part) for part in self.prompt.template.split("*") if part
        ]
        self._choices: dict[MaskedExample, ChoiceEncoding] = {}

    def _special(self, name: str) -> int:
        token_id = getattr(self.tokenizer, _SPECIAL[name])
        if token_id is None:
            raise ValueError(
                f"--task {self.task}: the model's tokenizer has no {name} token, which MeZO's "
                f"masked-LM prompt ({self.prompt.template}) needs; give the masked LM's own "
                "tokenizer (RoBERTa's has <s>, </s> and <mask>)"
            )
        return int(token_id)

    def _word_id(self, word: str) -> int:
        tokens = self.tokenizer.tokenize(" " + word)
        if len(tokens) != 1:
            raise ValueError(
                f"--task {self.task}: label word {word!r} (with its leading space) is "
                f"{len(tokens)} tokens in the model's tokenizer, {tokens}; MeZO's prompts score "
                "one token at the <mask>: give a tokenizer with the word in its vocabulary "
                "(RoBERTa's)"
            )
        return int(self.tokenizer.convert_tokens_to_ids(tokens[0]))

    def _part(self, part: str) -> list[int] | _Sentence:
        if part in _SPECIAL:
            return [self._special(part)]
        sentence = _SENTENCE.fullmatch(part)
        if sentence:
            space, case, drop, index = sentence.groups()
            return _Sentence(int(index), bool(space), case, bool(drop))
        text = part.replace("_", " ")
        if len(text) == 1:  # the character's own token, as MeZO takes it
            return [int(self.tokenizer.convert_tokens_to_ids(text))]
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _limit(self, index: int) -> int | None:
        return self.prompt.first_limit if index == 0 else self.prompt.other_limit

    def encode_ids(self, examples: Sequence[MaskedExample]) -> Iterator[tuple[list[int], int]]:
        """Each example's ids (cut to ``max_length``) and their count before the cut; the
        sentences of all of them through one tokenizer call."""
        sentences = [p for p in self.parts if isinstance(p, _Sentence)]
        texts = [s.text(e.sentences) for e in examples for s in sentences]
        # the ids alone, without the tokenizer's false "indexing errors" warning for a
        # sentence over its maximum: the limits cut every row (``IDS_ONLY``)
        encoded = iter(
            self.tokenizer(texts, **{**IDS_ONLY, "add_special_tokens": False})["input_ids"]
            if texts
            else ()
        )
        for _ in examples:
            ids: list[int] = []
            for part in self.parts:
                if isinstance(part, _Sentence):
                    ids += list(next(encoded))[: self._limit(part.index)]
                else:
                    ids += part
            yield ids[: self.max_length], len(ids)

    def mask_problem(self, ids: list[int], full: int) -> str | None:
        """What keeps a row's prompt (``ids``, cut from ``full`` tokens) from being scored
        at its ``<mask>``, or None: the limit cut it off (MeZO's assertion), or the row's
        text holds the mask token's text, which the tokenizer reads as the mask, so the
        first, the row's, would be scored."""
        if self.mask_id not in ids:
            return (
                f"the prompt is {full} tokens and its <mask> falls past the "
                f"{self.max_length}-token limit; raise --max-length or shorten the row"
            )
        if ids.count(self.mask_id) > 1:
            mask = self.tokenizer.mask_token
            return (
                f"the row's text holds {mask!r}, which the tokenizer reads as the mask token, "
                f"so the prompt has {ids.count(self.mask_id)} and the label words would be "
                f"scored at the row's; remove {mask!r} from the row"
            )
        return None

    def _encoding(self, example: MaskedExample, ids: list[int], full: int) -> ChoiceEncoding:
        problem = self.mask_problem(ids, full)
        if problem:
            raise ValueError(problem)
        at = ids.index(self.mask_id)
        scored = tuple((0, at, word, c) for c, word in enumerate(self.word_ids))
        return ChoiceEncoding((tuple(ids),), scored, example.label)

    def choices_many(self, examples: Sequence[MaskedExample]) -> list[ChoiceEncoding]:
        """Each example's one row and its label words scored at the mask."""
        encoded = zip(examples, self.encode_ids(examples))
        return [self._encoding(e, ids, full) for e, (ids, full) in encoded]

    def encode_choices(self, example: MaskedExample) -> ChoiceEncoding:
        """``choices_many`` of one example, kept for the next call (an evaluation set's)."""
        if example not in self._choices:
            self._choices[example] = self.choices_many([example])[0]
        return self._choices[example]

    def choice_rows(self, example: MaskedExample) -> int:
        return 1


def masked_task(name: str) -> Task:
    """``name``'s masked-LM task, or a one-line error naming those there are."""
    try:
        return MASKED_TASKS[name]
    except KeyError:
        raise ValueError(
            f"--task {name} has no masked-LM prompt (MeZO's RoBERTa tasks are "
            f"{', '.join(MASKED_TASKS)}); pick one of them, or train --task {name} on a "
            "causal LM"
        ) from None
