"""The pass over a file's token lengths, split over a job's ranks: each rank tokenizes its
part of the rows and the parts' counts meet, giving what one pass over the whole file
gives (the cut notices, the longest sequence, the rows an example becomes) and the same
batches. A million SST-2 rows' pass took 221 s of each rank's build."""

import threading
from typing import Any

import pytest
import torch

from distzo import ZOConfig, ZOEngine
from distzo.data.encoding import PromptEncoder, step_indices
from distzo.data.row_share import WHOLE, RowShare
from distzo.data.task_data import LoadedRows, PromptData, TextData
from distzo.data.templates import Example
from distzo.dist import LaunchEnv, ParallelContext, ParallelDims
from distzo.dist.agreement import gathered
from distzo.job.build import rank_share
from distzo.job.evaluation import evaluate, evaluate_lm, planned_rows
from distzo.models.tiny import byte_tokenizer
from tests.helpers.models import tiny_opt
from tests.unit.test_evaluation_transfers import SumsOf
from tests.unit.test_prompt_build_cost import CountingTokenizer

SINGLE = ParallelContext.single()


def copa_rows(count: int) -> list[Example]:
    """Rows of many lengths: some longer than the limit, some answers too long for it."""
    return [
        Example(f"p{'x' * (i * 7 % 40)} because", (" a" * (i % 5 + 1), " bb" * (i % 9 + 1)), i % 2)
        for i in range(count)
    ]


def build(loaded: LoadedRows, encoder: PromptEncoder, objective: str, share=WHOLE):
    if loaded.task == "text":
        return TextData(loaded, encoder, 0, 2, share)
    return PromptData(loaded, encoder, 0, 2, 4, objective, share)


class ThreadGroup:
    """A host group of ranks that are threads: a barrier and shared slots stand in for
    gloo's all-gather."""

    distributed = True

    def __init__(self, parts: int) -> None:
        self.slots: list[object] = [None] * parts
        self.barrier = threading.Barrier(parts, timeout=60)

    def member(self, part: int):
        group = self

        class Member:
            distributed = True

            def all_gather_object(self, value):
                group.slots[part] = value
                group.barrier.wait()
                outcomes = list(group.slots)
                group.barrier.wait()  # every part read the slots before the next fills them
                return outcomes

        return Member()


def build_parts(
    loaded: LoadedRows, parts: int, objective: str, max_length: int = 24
) -> list[tuple[Any, int]]:
    """Each part's data, built in a thread of its own as a rank builds it (``rank_share``'s
    meeting: ``gathered`` over the host group), with the texts its tokenizer took."""
    group = ThreadGroup(parts)
    built: list = [None] * parts

    def run(part: int) -> None:
        tokenizer, comm = CountingTokenizer(byte_tokenizer()), group.member(part)
        share = RowShare(part, parts, lambda compute: gathered(comm, compute))
        try:
            data = build(loaded, PromptEncoder(tokenizer, max_length), objective, share)
            built[part] = (data, tokenizer.texts)
        except BaseException as err:
            built[part] = err

    threads = [threading.Thread(target=run, args=(part,)) for part in range(parts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    errors = [outcome for outcome in built if isinstance(outcome, BaseException)]
    if errors:
        assert len(errors) == parts and len({str(e) for e in errors}) == 1, errors
        raise errors[0]
    return built


@pytest.mark.parametrize("objective", ["classification", "lm"])
def test_ranks_sharing_the_pass_see_what_one_pass_sees_and_tokenize_a_part(objective):
    loaded = LoadedRows("copa", copa_rows(50), copa_rows(11))
    whole = CountingTokenizer(byte_tokenizer())
    parts = build_parts(loaded, 3, objective)
    alone = PromptData(loaded, PromptEncoder(whole, 24), 0, 2, 4, objective)
    assert alone.cut_notices and alone.longest == 24
    probe = CountingTokenizer(byte_tokenizer())
    PromptEncoder(probe, 24)  # its probe of the special tokens
    passed = [texts - probe.texts for texts in (whole.texts, *(t for _, t in parts))]
    for data, _ in parts:
        assert data.cut_notices == alone.cut_notices
        assert (data.longest, data.rows_per_example) == (alone.longest, alone.rows_per_example)
        for step in range(4):
            batch, expected = data.batch(8, step), alone.batch(8, step)
            assert batch.keys() == expected.keys()
            assert all(torch.equal(batch[k], expected[k]) for k in batch)
    # (50 + 11 rows) x 3 texts a row: each part tokenized its third of them, once
    assert passed[0] == 183 and sum(passed[1:]) == 183
    assert max(passed[1:]) <= 63


def test_text_rows_are_read_in_parts_and_tokenized_when_a_step_takes_them():
    """The text task kept every row's tokens (4 bytes a token, on every rank); now a step
    tokenizes its rows, and the rows without a next token (an empty one: 1 token, the
    leading </s>) stay out of the batches as they did."""
    texts = [("w" * (i * 5 % 37)) if i % 6 else "" for i in range(40)]
    loaded = LoadedRows("text", texts, texts[:7])
    whole = CountingTokenizer(byte_tokenizer())
    alone = TextData(loaded, PromptEncoder(whole, 24), 0, 2)
    built = whole.texts
    parts = build_parts(loaded, 3, "lm")
    assert alone.cut_notices and alone.longest == 24
    assert list(alone.train.rows) == [i for i in range(40) if i % 6 and i * 5 % 37]
    for data, _ in parts:
        assert data.cut_notices == alone.cut_notices and data.longest == alone.longest
        assert list(data.train.rows) == list(alone.train.rows)
    for step in range(6):
        batch = alone.batch(4, step)
        assert all(torch.equal(batch[k], parts[2][0].batch(4, step)[k]) for k in batch)
        assert (batch["attention_mask"].sum(1) > 1).all()  # no empty row
        rows = [alone.train.rows[i] for i in step_indices(len(alone.train.rows), 4, step, 0)]
        tokens = zip(batch["input_ids"], batch["attention_mask"].bool())
        # a long row keeps its leading </s> (id 1) and its last 23 bytes
        assert [ids[kept].tolist() for ids, kept in tokens] == [
            [1, *byte_ids(texts[row])[-23:]] for row in rows
        ]
    probe = CountingTokenizer(byte_tokenizer())
    PromptEncoder(probe, 24)
    # (40 + 7 rows): each part read its third of the 40 training rows' lengths and of the
    # 7 evaluation rows (every rank tokenized and kept the evaluation file whole)
    assert built - probe.texts == 47
    assert sorted(texts - probe.texts for _, texts in parts) == [13 + 2, 13 + 2, 14 + 3]
    every = list(range(7))
    for data, _ in parts:  # each holds its share's tokens, tokenizes any other row asked
        assert len(data.eval_set.held) == len(data.eval_set.span) in (2, 3)
        taken, expected = data.eval_set.take(every), alone.eval_set.take(every)
        assert all(torch.equal(taken[k], expected[k]) for k in expected)
    # each rank's evaluation takes the rows it holds: none tokenized again, the sums the
    # one process's
    engine = ZOEngine(
        tiny_opt(seed=3, vocab_size=len(byte_tokenizer())), ZOConfig(device="cpu", seed=0)
    )
    sums: list[list[float]] = []
    for part, (data, _) in enumerate(parts):
        tokenizer = data.eval_set.encoder.tokenizer
        before = tokenizer.texts
        evaluate_lm(engine, data.eval_set, SumsOf(part, 3, sums), 2)
        assert tokenizer.texts == before
    loss, _, count = (sum(column) for column in zip(*sums))
    assert loss / count == pytest.approx(
        evaluate_lm(engine, alone.eval_set, SINGLE, 2)["eval_loss"]
    )


def test_the_plan_and_a_rank_s_evaluation_encode_its_share_of_the_examples_alone():
    """The memory plan and every choice evaluation encoded every evaluated example, a
    tokenizer call a text, and kept them all, on every rank (24 s and 155 MB of each rank's
    build for 50k SST-2 rows); the build's shared pass now counts the widest example's rows,
    here one in the last part's share, and a rank's evaluation encodes its share alone."""
    wide = Example("p because", (" a", " bb", " ccc", " dddd", " e e"), 3)
    evals = [*copa_rows(10), wide]
    loaded = LoadedRows("copa", copa_rows(12), evals, copa_rows(4))
    alone = PromptData(loaded, PromptEncoder(byte_tokenizer(), 24), 0, 2, 4, "lm")
    fresh = PromptEncoder(byte_tokenizer(), 24)
    assert alone.eval_rows == max(fresh.choice_rows(e) for e in evals) == 5
    assert alone.dev_rows == max(fresh.choice_rows(e) for e in loaded.dev) == 2
    engine = ZOEngine(
        tiny_opt(seed=3, vocab_size=len(byte_tokenizer())), ZOConfig(device="cpu", seed=0)
    )
    sums: list[list[float]] = []
    for part, (data, _) in enumerate(build_parts(loaded, 3, "lm")):
        tokenizer, encoder = data.encoder.tokenizer, data.encoder
        before = tokenizer.texts
        assert [planned_rows(data, w) for w in (1, 3)] == [planned_rows(alone, w) for w in (1, 3)]
        assert tokenizer.texts == before and encoder._choices == {}
        evaluate(engine, data, SumsOf(part, 3, sums))
        mine = {evals[i] for i in RowShare(part, 3).span(len(evals))}
        assert set(encoder._choices) == mine | {evals[0]}  # and the spare call's example
    right, _, loss, tokens, count = (sum(column) for column in zip(*sums))
    metrics = evaluate(engine, alone, SINGLE)
    assert right / count == metrics["eval_accuracy"]
    assert loss / tokens == pytest.approx(metrics["eval_loss"], rel=1e-6)  # copa: lm's


def byte_ids(text: str) -> list[int]:
    """The byte tokenizer's ids of ``text``'s own tokens (no </s>)."""
    return byte_tokenizer()(text, add_special_tokens=False)["input_ids"]


def test_a_bad_row_in_one_part_is_every_parts_error_as_one_pass_says_it():
    rows = copa_rows(9)
    rows[7] = Example("p", (" a", ""), 0)  # a candidate with no tokens to score
    loaded = LoadedRows("copa", rows, copa_rows(3))
    with pytest.raises(ValueError) as alone:
        PromptData(loaded, PromptEncoder(byte_tokenizer(), 24), 0, 2, 4, "classification")
    with pytest.raises(ValueError) as shared:
        build_parts(loaded, 3, "classification")
    assert str(shared.value) == str(alone.value) == "candidate '' has no tokens to score"


@pytest.mark.parametrize("task", ["copa", "text"])
def test_the_longest_row_of_any_part_is_every_parts_longest(task):
    """The memory plan's longest sequence is the file's, wherever its longest row lies: a
    part that took its own (or the first part's) would plan for shorter batches than a step
    of the file takes."""
    if task == "text":
        loaded = LoadedRows("text", ["w" * 4] * 8 + ["w" * 60], ["w" * 4])
    else:
        short = [Example("p because", (" a", " b"), i % 2) for i in range(8)]
        loaded = LoadedRows("copa", [*short, Example("p" + "x" * 60, (" a", " b"), 0)], short)
    alone = build(loaded, PromptEncoder(byte_tokenizer(), 200), "classification")
    assert alone.longest > 60  # the last row's, below the limit
    parts = build_parts(loaded, 3, "classification", max_length=200)
    assert [data.longest for data, _ in parts] == [alone.longest] * 3


class Node:
    """The host group of ``world_size`` ranks seen from one rank: every other rank's
    outcome is ``("theirs", None)``."""

    distributed = True

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def all_gather_object(self, mine):
        return [mine if r == self.rank else (f"rank {r}", None) for r in range(self.world_size)]


def test_a_ranks_share_is_its_part_of_the_job_meeting_every_ranks_part():
    """Rank 4 of 6, the first local rank of the third node: its part is the job's fifth
    sixth of the rows (not its node's second: two nodes' ranks would read the same rows and
    none the rest), and its counts meet every rank's over the host group."""
    env = LaunchEnv(rank=4, world_size=6, local_rank=0, local_world_size=2, node_rank=2)
    share = rank_share(ParallelContext(env, ParallelDims(1, 6), comm=Node(4, 6)))
    assert share.span(30) == range(20, 25)
    assert share.meet(lambda: "mine") == ["rank 0", "rank 1", "rank 2", "rank 3", "mine", "rank 5"]


@pytest.mark.parametrize(("objective", "per_example"), [("lm", 1), ("classification", 2)])
def test_a_trained_example_takes_one_row_or_its_candidates_and_an_evaluated_one_its_candidates(
    objective, per_example
):
    """The memory plan's rows: a language-model step's example is one row (its right
    answer's), a classification step's one a candidate; evaluation picks a candidate."""
    loaded = LoadedRows("copa", copa_rows(6), copa_rows(3))
    data = PromptData(loaded, PromptEncoder(byte_tokenizer(), 24), 0, 2, 4, objective)
    assert (data.rows_per_example, data.eval_rows, data.dev_rows) == (per_example, 2, 0)
