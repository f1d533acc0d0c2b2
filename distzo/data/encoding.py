"""Token batches for prompt tasks and raw text, drawn as a pure function of the step.

A prompt and its continuation are tokenized together, as MeZO does, so the tokens a
model is scored on are the ones the joint text has (a BPE's leading-space token, a
SentencePiece word after a newline); the continuation's tokens are those that differ
from the prompt's own tokenization. A sequence longer than ``max_length`` loses prompt
tokens from the left, never its answer nor the tokenizer's leading special token (OPT's
``</s>``, Llama's ``<s>``); a special token the tokenizer appends is left off.
The batch of step t takes positions [t*B, (t+1)*B) of an endless run of per-epoch
permutations seeded by (seed, epoch): a resumed run needs only its step.

Each objective reads its own batch form (``distzo.objectives``): ``lm`` the right
continuation with labels on its tokens, ``classification`` / ``accuracy`` every
candidate of each example, ``f1`` the prompt with room for the answer.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch

from distzo.data.row_share import WHOLE, RowShare
from distzo.data.templates import Example
from distzo.objectives import ChoiceEncoding, collate_choices, collate_prompts
from distzo.zo.noise import noise_seed

ENCODE_CHUNK = 1024  # examples whose texts go through one tokenizer call

# A call's ids alone: the attention masks (and type ids) a call returns by default were a
# third of a fast tokenizer's time in a large file's lengths pass, and were never read.
# Quiet about the tokenizer's ``model_max_length``: its warning of "indexing errors" is
# false here, where ``max_length`` cuts (and the run counts the rows it cuts).
IDS_ONLY = {
    "add_special_tokens": True,
    "verbose": False,
    "return_attention_mask": False,
    "return_token_type_ids": False,
}

Joint = tuple[list[int], int]  # a joint text's ids, and its continuation's token count


class ChoiceEncoder(Protocol):
    """What training and evaluating on choices read of an encoder: a causal LM's
    ``PromptEncoder``, or a masked LM's ``MaskedPromptEncoder``."""

    pad_id: int

    def choices_many(self, examples: Sequence[Any]) -> list[ChoiceEncoding]: ...

    def encode_choices(self, example: Any) -> ChoiceEncoding: ...

    def choice_rows(self, example: Any) -> int: ...


class PromptEncoder:
    def __init__(self, tokenizer, max_length: int, stop_ids: Iterable[int] = ()) -> None:
        """``stop_ids``: end-of-sequence tokens besides the tokenizer's own (a generation
        config's list: Llama 3 Instruct's ``<|eot_id|>``), where a greedy answer ends."""
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.stop_ids = frozenset(
            [*stop_ids, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])]
        )
        self.pad_id = _pad_id(tokenizer)
        self.lead, self.trail = _special_tokens(tokenizer)
        if max_length <= self.lead:
            raise ValueError(
                f"max length {max_length} leaves no room after the tokenizer's "
                f"{self.lead} leading special token(s); raise --max-length"
            )
        self._choices: dict[Example, ChoiceEncoding] = {}

    def _ids(self, text: str) -> list[int]:
        """``text``'s tokens with the tokenizer's leading special ones, less its trailing
        ones (Llama's ``</s>`` with ``add_eos_token``): a prompt ends where its continuation
        or its decoding starts, and a candidate is scored on its own tokens."""
        ids = self._all_ids(text)
        return ids[: len(ids) - self.trail] if self.trail else ids

    def _ids_many(self, texts: list[str]) -> list[list[int]]:
        """``_ids`` of each text through one tokenizer call: a fast tokenizer runs the
        batch in Rust, and the call's own cost (most of a short text's) is paid once. The
        ids are the tokenizer's own lists, copied only where a trailing token comes off."""
        batch = self._all_ids_many(texts)
        return [ids[: len(ids) - self.trail] for ids in batch] if self.trail else batch

    def _all_ids_many(self, texts: list[str]) -> list[list[int]]:
        """``_all_ids`` of each text through one tokenizer call."""
        if not texts:
            return []
        batch = self.tokenizer(texts, **IDS_ONLY)["input_ids"]
        return [ids if isinstance(ids, list) else list(ids) for ids in batch]

    def _all_ids(self, text: str) -> list[int]:
        """``text``'s tokens with every special token the tokenizer adds (``IDS_ONLY``)."""
        return list(self.tokenizer(text, **IDS_ONLY)["input_ids"])

    def _keep(self, ids: list[int], budget: int) -> list[int]:
        """At most ``budget`` tokens: the leading special ones and the last of the rest."""
        if len(ids) <= budget:
            return ids
        return ids[: self.lead] + ids[len(ids) - (budget - self.lead) :]

    @property
    def answer_room(self) -> int:
        """The most continuation tokens a sequence keeps: a scored token needs one before it."""
        return self.max_length - max(self.lead, 1)

    def encode(self, prompt: str, continuation: str) -> tuple[list[int], int]:
        """(token ids, number of continuation tokens at the end)."""
        return self._fit(*self._joint(prompt, continuation))

    def encode_text(self, text: str) -> tuple[list[int], bool]:
        """A raw text row's tokens, and whether the cut lost some: with the end token a
        tokenizer appends (``add_eos_token``), which a causal LM learns to predict after a
        document, as a plain causal-LM recipe (transformers' ``run_clm``) trains it."""
        return next(self.encode_texts([text]))

    def encode_texts(self, texts: Sequence[str]) -> Iterator[tuple[list[int], bool]]:
        """``encode_text`` of each text, ``ENCODE_CHUNK`` texts a tokenizer call."""
        for start in range(0, len(texts), ENCODE_CHUNK):
            for ids in self._all_ids_many(list(texts[start : start + ENCODE_CHUNK])):
                yield self._keep(ids, self.max_length), len(ids) > self.max_length

    def _joint(self, prompt: str, continuation: str, head: list[int] | None = None) -> Joint:
        """The joint text's ids and its continuation's token count: the tokens that differ
        from the prompt's own (``head``, tokenized here unless given)."""
        ids = self._ids(prompt + continuation)
        if not continuation:
            return ids, 0
        return _answer(self._ids(prompt) if head is None else head, ids)

    def joints(self, examples: Sequence[Example]) -> Iterator[tuple[list[int], list[Joint]]]:
        """Each example's prompt ids and ``_joint`` of each of its candidates, the texts
        of ``ENCODE_CHUNK`` examples tokenized by one call: a million rows' build made
        seven calls a row, each paying the call's own cost."""
        for start in range(0, len(examples), ENCODE_CHUNK):
            chunk = examples[start : start + ENCODE_CHUNK]
            texts = [t for e in chunk for t in (e.prompt, *(e.prompt + c for c in e.continuations))]
            encoded = iter(self._ids_many(texts))
            for e in chunk:
                head = next(encoded)
                pairs = [(c, next(encoded)) for c in e.continuations]
                yield head, [_answer(head, ids) if c else (ids, 0) for c, ids in pairs]

    def _fit(self, ids: list[int], answer: int) -> tuple[list[int], int]:
        """``ids`` with their last ``answer`` tokens the continuation, cut to ``max_length``."""
        room = self.answer_room
        if answer > room:  # an answer longer than the window keeps its start
            ids, answer = ids[: len(ids) - (answer - room)], room
        return self._keep(ids, self.max_length), answer

    def _candidates(self, example: Example) -> list[tuple[list[int], int]]:
        """``encode`` of prompt + each candidate, the prompt tokenized once for them all."""
        head = self._ids(example.prompt)
        return [self._fit(*self._joint(example.prompt, c, head)) for c in example.continuations]

    def fitted(self, joints: list[Joint]) -> list[tuple[list[int], int]]:
        """An example's candidates (from ``joints``) cut as ``encode`` cuts them."""
        return [self._fit(ids, answer) for ids, answer in joints]

    def shares_prompt(self, example: Example) -> bool:
        """Every candidate is one token after the same prompt tokens: one row (the prompt)
        scores them all."""
        return len(self.encode_choices(example).rows) == 1

    def choice_rows(self, example: Example) -> int:
        return len(self.encode_choices(example).rows)

    def encode_choices(self, example: Example) -> ChoiceEncoding:
        """The example's rows and scored tokens: the prompt alone when every candidate is
        one token after the same prompt tokens (scored at the prompt's last position), else
        prompt + candidate per row, each scored on its candidate's tokens, exactly as
        ``encode`` lays them out. Kept for the next call (an evaluation set's)."""
        if example not in self._choices:
            self._choices[example] = choice_encoding(example, self._candidates(example))
        return self._choices[example]

    def choices_many(self, examples: Sequence[Example]) -> list[ChoiceEncoding]:
        """``encode_choices`` of each example, through one tokenizer call a chunk and kept
        nowhere: a training batch's, which an epoch of a million rows would pile up."""
        return [
            choice_encoding(e, self.fitted(joints))
            for e, (_, joints) in zip(examples, self.joints(examples))
        ]

    def encode_many(self, examples: Sequence[Example]) -> list[tuple[list[int], int]]:
        """``encode`` of each example's prompt and right continuation, batched as
        ``joints`` batches them."""
        right = [Example(e.prompt, (e.continuations[e.label],), 0) for e in examples]
        return [self._fit(*joints[0]) for _, joints in self.joints(right)]

    def check_room(self, room: int) -> None:
        """A prompt to decode from keeps its leading special tokens and one token of its
        own, so ``room`` new tokens fit only below ``max_length`` less those: past it the
        slots would run off the model's positions, mid-run."""
        most = self.max_length - self.lead - 1
        if room > most:
            raise ValueError(
                f"--max-new-tokens {room} leaves no room for a prompt in {self.max_length} "
                f"token positions (--max-length, or the model's); give --max-new-tokens "
                f"{most} or less, or raise --max-length"
            )

    def encode_prompt(self, prompt: str, room: int) -> list[int]:
        """A prompt to decode from, cut from the left to leave ``room`` new tokens."""
        return self.encode_prompts([prompt], room)[0]

    def encode_prompts(self, prompts: list[str], room: int) -> list[list[int]]:
        """``encode_prompt`` of each prompt, through one tokenizer call."""
        self.check_room(room)
        return [self._keep(ids, self.max_length - room) for ids in self._ids_many(prompts)]

    def answer(self, ids: Sequence[int]) -> str:
        """Generated tokens as text, up to the first end-of-sequence token (where MeZO's
        decoding, and ``generate``, stop; the metric then cuts at the first newline)."""
        ids = list(ids)
        end = next((i for i, token in enumerate(ids) if token in self.stop_ids), len(ids))
        return self.tokenizer.decode(ids[:end], skip_special_tokens=True)

    def collate(
        self, sequences: Sequence[tuple[list[int], int]], width: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Right-padded ids, mask, and labels on the continuation tokens only; ``width``
        columns (the longest sequence's when None)."""
        width = width or max(len(ids) for ids, _ in sequences)
        input_ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        labels = torch.full((len(sequences), width), -100, dtype=torch.long)
        for row, (ids, answer) in enumerate(sequences):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            mask[row, : len(ids)] = 1
            if answer:
                labels[row, len(ids) - answer : len(ids)] = input_ids[
                    row, len(ids) - answer : len(ids)
                ]
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _answer(head: list[int], ids: list[int]) -> Joint:
    """``ids`` and the count of its last tokens that differ from ``head``'s: the
    continuation's tokens in the joint text."""
    if ids[: len(head)] == head:  # the usual case, compared at C speed
        return ids, len(ids) - len(head)
    shared = next(
        (i for i, (a, b) in enumerate(zip(head, ids)) if a != b), min(len(head), len(ids))
    )
    return ids, len(ids) - shared


def distinct(encoded: list[tuple[list[int], int]]) -> bool:
    """Whether fitted candidates (``PromptEncoder.fitted``) stay different sequences: two
    whose ends the cut to ``max_length`` drops can become the same tokens, scored alike."""
    return len({(tuple(ids), answer) for ids, answer in encoded}) == len(encoded)


def choice_encoding(example: Example, encoded: list[tuple[list[int], int]]) -> ChoiceEncoding:
    """The example's rows and scored tokens from its fitted candidates
    (``PromptEncoder.encode_choices``)."""
    for continuation, (_, answer) in zip(example.continuations, encoded):
        if answer == 0:
            raise ValueError(f"candidate {continuation!r} has no tokens to score")
    prompt = encoded[0][0][:-1]
    if prompt and all(answer == 1 and ids[:-1] == prompt for ids, answer in encoded):
        scored = [
            (0, len(prompt) - 1, ids[-1], c_index) for c_index, (ids, _) in enumerate(encoded)
        ]
        return ChoiceEncoding((tuple(prompt),), tuple(scored), example.label, example.right)
    rows, scored = [], []
    for c_index, (ids, answer) in enumerate(encoded):
        scored += [(c_index, t - 1, ids[t], c_index) for t in range(len(ids) - answer, len(ids))]
        rows.append(tuple(ids))
    return ChoiceEncoding(tuple(rows), tuple(scored), example.label, example.right)


class TokenRows:
    """Rows of tokens in one array, 4 bytes a token: a Python list of ints costs 8 bytes a
    token at best, 36 for an id over 256 (gigabytes a million rows, on each rank)."""

    def __init__(self, sequences: Iterable[list[int]] = ()) -> None:
        self.tokens, self.ends = array("i"), array("q")  # ids under 2**31
        for ids in sequences:
            self.append(ids)

    def append(self, ids: list[int]) -> None:
        """One more row."""
        self.tokens.extend(ids)
        self.ends.append(len(self.tokens))

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, index: int) -> list[int]:
        start = self.ends[index - 1] if index else 0
        return self.tokens[start : self.ends[index]].tolist()


class PaddedRows:
    """A text task's evaluation rows, every token a label, collated a call's rows at a
    time to ``width``, the longest row's tokens of all. A rank holds the tokens of its
    share (``held``: the rows ``span``, which its evaluation takes) and tokenizes any other
    row a call takes: every rank tokenized and kept the whole file at its build (49 s and
    343 MB for 100k rows of 1 KB), and the tensors of every row padded at once were 24
    bytes a position of the longest row (6 GB a million rows, on each rank)."""

    def __init__(
        self,
        texts: Sequence[str],
        encoder: PromptEncoder,
        width: int,
        held: TokenRows,
        span: range,
    ) -> None:
        self.texts, self.encoder, self.width = texts, encoder, width
        self.held, self.span = held, span

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index: int) -> list[int]:
        if index in self.span:
            return self.held[index - self.span.start]
        return self.encoder.encode_text(self.texts[index])[0]

    def take(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """The rows ``indices`` collated, each row a label on every token."""
        rows = [self[i] for i in indices]
        return self.encoder.collate([(ids, len(ids)) for ids in rows], self.width)


def _pad_id(tokenizer) -> int:
    """The id padding fills with: the pad token, else the end-of-sequence one, else 0 (a
    tokenizer with neither stopped the first batch with a TypeError). Any id will do:
    padding is masked out and never scored."""
    for token in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token is not None:
            return int(token)
    return 0


def _special_tokens(tokenizer) -> tuple[int, int]:
    """How many special tokens the tokenizer puts before a text's own (OPT's ``</s>``,
    Llama's ``<s>``: kept when a long sequence is cut from the left, as MeZO does) and
    after them (Llama's ``</s>`` with ``add_eos_token``: left off)."""
    plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    special = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    extra = len(special) - len(plain)
    lead = next((k for k in range(extra + 1) if special[k : k + len(plain)] == plain), None)
    return (0, 0) if lead is None or extra <= 0 else (lead, extra - lead)


def step_indices(num_items: int, batch_size: int, step: int, seed: int) -> list[int]:
    """The item indices of ``step``'s global batch (epoch permutations, end to end)."""
    if num_items < 1:
        raise ValueError("the training set is empty")
    out = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(position, num_items)
        out.append(int(epoch_order(num_items, seed, epoch)[offset]))
    return out


@functools.lru_cache(maxsize=2)  # a batch spans two epochs at most, where it ends one
def epoch_order(num_items: int, seed: int, epoch: int) -> torch.Tensor:
    """Epoch ``epoch``'s permutation of the items, drawn once per epoch rather than once
    per position of a batch: a draw costs a time and a memory linear in ``num_items``
    (seconds per step on ten million rows)."""
    generator = torch.Generator().manual_seed(noise_seed(seed, epoch, 1, 0))
    return torch.randperm(num_items, generator=generator)


class PromptTrainData:
    """Training batches of a prompt task: each example with its right continuation,
    tokenized when a step takes it (kept, an epoch of a million rows held gigabytes)."""

    def __init__(self, examples: list[Example], encoder: PromptEncoder, seed: int) -> None:
        self.examples, self.encoder, self.seed = examples, encoder, seed

    def batch(self, batch_size: int, step: int) -> dict[str, torch.Tensor]:
        indices = step_indices(len(self.examples), batch_size, step, self.seed)
        return self.encoder.collate(self.encoder.encode_many([self.examples[i] for i in indices]))


class ChoiceTrainData:
    """Training batches that score every candidate (``classification``, ``accuracy``),
    tokenized when a step takes them, as ``PromptTrainData``'s."""

    def __init__(self, examples: Sequence[Any], encoder: ChoiceEncoder, seed: int) -> None:
        self.examples, self.encoder, self.seed = examples, encoder, seed

    def batch(self, batch_size: int, step: int) -> dict[str, torch.Tensor]:
        indices = step_indices(len(self.examples), batch_size, step, self.seed)
        encodings = self.encoder.choices_many([self.examples[i] for i in indices])
        return collate_choices(encodings, self.encoder.pad_id)


class PromptOnlyTrainData:
    """Training batches to decode from (``f1``): each row a prompt with room for the answer,
    and its example's index (where the objective finds the gold answers); tokenized when a
    step takes it, as ``PromptTrainData``'s."""

    def __init__(
        self, examples: list[Example], encoder: PromptEncoder, seed: int, max_new_tokens: int
    ) -> None:
        self.examples, self.encoder, self.seed, self.max_new_tokens = (
            examples,
            encoder,
            seed,
            max_new_tokens,
        )

    def batch(self, batch_size: int, step: int) -> dict[str, torch.Tensor]:
        indices = step_indices(len(self.examples), batch_size, step, self.seed)
        prompts = [self.examples[i].prompt for i in indices]
        return collate_prompts(
            self.encoder.encode_prompts(prompts, self.max_new_tokens),
            indices,
            self.max_new_tokens,
            self.encoder.pad_id,
        )


class TextTrainData:
    """Plain causal LM on raw text rows: every token of a row (up to max_length) is a label.
    A row is tokenized when a step takes it: the file's tokens, kept, were 4 bytes a token
    on every rank (a gigabyte a million wikitext-sized rows), and the build that tokenized
    them all, minutes, ran on every rank. The build reads the rows' lengths once, each rank
    its ``share`` of them."""

    def __init__(
        self, texts: list[str], encoder: PromptEncoder, seed: int, share: RowShare = WHOLE
    ) -> None:
        """A row of fewer than two tokens (an empty one: wikitext has many) has no next
        token to predict and is left out: a batch of only such rows stopped the run."""
        span = share.span(len(texts))
        parts = share.meet(lambda: text_lengths(encoder, texts, span))
        self.cut = sum(cut for cut, _, _ in parts)  # rows longer than max_length
        self.width = max(width for _, width, _ in parts)  # the longest kept row's tokens
        left_out = {row for _, _, rows in parts for row in rows}
        self.rows: Sequence[int] = (
            array("q", (row for row in range(len(texts)) if row not in left_out))
            if left_out
            else range(len(texts))
        )
        if not len(self.rows):
            raise ValueError(
                "--train-file: no row has a next token to predict (a row needs two tokens or "
                "more after tokenization); give longer rows"
            )
        self.texts, self.encoder, self.seed = texts, encoder, seed

    def batch(self, batch_size: int, step: int) -> dict[str, torch.Tensor]:
        indices = step_indices(len(self.rows), batch_size, step, self.seed)
        encoded = self.encoder.encode_texts([self.texts[self.rows[i]] for i in indices])
        return self.encoder.collate([(ids, len(ids)) for ids, _ in encoded])


def text_lengths(
    encoder: PromptEncoder,
    texts: list[str],
    span: range,
    keep: Callable[[list[int]], object] | None = None,
) -> tuple[int, int, list[int]]:
    """Of the rows ``span`` of ``texts``: how many the limit cuts, the most tokens a kept
    row has, and the rows left out (fewer than two tokens); ``keep``: handed each row's
    tokens, in order."""
    cut, width, left_out = 0, 0, []
    encoded = encoder.encode_texts(texts[span.start : span.stop])
    for row, (ids, lost) in zip(span, encoded):
        if keep is not None:
            keep(ids)
        cut += lost
        if len(ids) > 1:
            width = max(width, len(ids))
        else:
            left_out.append(row)
    return cut, width, left_out
