"""An example of more candidate rows than --eval-batch-size gives a rank is scored in
pieces of at most that many rows, the scores joined before the pick: ReCoRD's 30-50
candidates at 2048 tokens went through one forward whatever --eval-batch-size said (OPT-13B
fp16: 20.7 GB planned), so the refusal's advice to lower it did nothing."""

import pytest
import torch

from distzo import ZOConfig, ZOEngine
from distzo.config.job import JobConfig
from distzo.data.encoding import PromptEncoder
from distzo.data.task_data import LoadedRows, PromptData
from distzo.data.templates import TASKS, build_examples
from distzo.dist import Collectives, LaunchEnv, ParallelContext, ParallelDims
from distzo.job import build, eval_calls, evaluation
from distzo.job.evaluation import evaluate_choices, planned_rows
from distzo.models.tiny import byte_tokenizer
from distzo.objectives.choice import ChoiceEncoding, collate_choices, prepare_choices
from distzo.objectives.choice_pieces import join_scores, right_candidates, split_choices
from tests.helpers.models import base_model

TOKENIZER = byte_tokenizer()
SAME = ["Tom", "Ann", "Rom", "Pam", "Bob", "Kim", "Lea", "Max", "Ned"]  # rows of one length
MIXED = ["Tom", "Annabel", "Rome", "Paris-by-night", "Bo", "Kimberly", "L", "Maximilian", "N"]


def record(names, count=6):
    """ReCoRD examples of 5 to 9 candidates, one row each."""
    rows = [
        {
            "passage": f"Tom met Ann in Rome, day {i}.\n@highlight\nA trip",
            "query": "@placeholder went home.",
            "entities": names[: 5 + i % 5],
            "answers": [names[i % 3]],
        }
        for i in range(count)
    ]
    return build_examples(TASKS["record"], rows, "x")


def encoder():
    return PromptEncoder(TOKENIZER, max_length=256)


class RankOf:
    """Rank ``rank`` of ``world`` as the evaluation sees it, its sums not reduced."""

    def __init__(self, rank, world):
        self.env = LaunchEnv(rank=rank, world_size=world)

    def sum_to_host(self, values):
        return [float(v) for v in values]


def engine_of(family):
    model = base_model(family, seed=1, vocab_size=len(TOKENIZER), max_position_embeddings=256)
    return ZOEngine(model, ZOConfig(device="cpu", seed=0, mode="offload", num_slots=2))


def scored(monkeypatch, engine, examples, batch_size, parallel=None):
    """(the metrics, each example's scores as the pick reads them, the rows of each forward)."""
    seen, forwarded = [], []
    hits, embed = evaluation.hits, engine.family.embed
    monkeypatch.setattr(evaluation, "hits", lambda s, r: seen.extend(s.clone()) or hits(s, r))
    monkeypatch.setattr(
        engine.family, "embed", lambda ids, ctx: forwarded.append(ids.shape[0]) or embed(ids, ctx)
    )
    parallel = parallel or ParallelContext.single()
    metrics = evaluate_choices(engine, examples, encoder(), parallel, batch_size=batch_size)
    monkeypatch.setattr(evaluation, "hits", hits)
    monkeypatch.setattr(engine.family, "embed", embed)
    return metrics, [s[s > float("-inf")] for s in seen], forwarded


def test_a_split_example_keeps_each_candidates_rows_and_tokens():
    whole = encoder().encode_choices(record(MIXED)[4])  # 9 candidates
    pieces = split_choices(whole, 4)
    assert [len(p.encoding.rows) for p in pieces] == [4, 4, 1]
    assert [(p.first, p.last) for p in pieces] == [(0, False), (4, False), (8, True)]
    rebuilt = [
        (r + p.first, t, token, c + p.first) for p in pieces for r, t, token, c in p.encoding.scored
    ]
    assert rebuilt == list(whole.scored)
    assert sum((p.encoding.rows for p in pieces), ()) == whole.rows
    scores = [torch.tensor([[0.0, 1, 2, 3]]), torch.tensor([[4.0, 5, 6, 7]]), torch.tensor([[8.0]])]
    assert torch.equal(join_scores(scores, pieces, 9), torch.arange(9.0).unsqueeze(0))
    # SST-2's fast path: every candidate one token after the prompt, all read off one row
    one_row = ChoiceEncoding(((5, 6, 7),), ((0, 2, 8, 0), (0, 2, 9, 1)), label=1)
    assert [p.encoding for p in split_choices(one_row, 1)] == [one_row]


def test_a_joined_example_picks_as_the_whole_example_picks():
    # ReCoRD names an entity twice: a pick of either is a hit, as prepare_choices marks it
    rows, scored = tuple((5, 6, 7 + c) for c in range(5)), tuple((c, 2, 7 + c, c) for c in range(5))
    twice = ChoiceEncoding(rows, scored, label=1, right=(1, 3))
    whole = prepare_choices(collate_choices([twice], pad_id=0), torch.device("cpu")).right
    assert torch.equal(right_candidates(twice, 5), whole)
    assert right_candidates(twice, 5).tolist() == [[False, True, False, True, False]]
    # a candidate no piece scored is never the pick, as candidate_scores marks it
    gap = ChoiceEncoding(twice.rows[:4], tuple(s for s in twice.scored[:4] if s[3] != 1), 0)
    pieces = split_choices(gap, 2)
    joined = join_scores([torch.tensor([[-2.0]]), torch.tensor([[-3.0, -1.0]])], pieces, 4)
    assert joined.tolist() == [[-2.0, float("-inf"), -3.0, -1.0]]
    with pytest.raises(ValueError, match="^a piece holds at least one row, not 0$"):
        split_choices(twice, 0)


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_pieces_score_as_the_whole_example_and_no_forward_exceeds_the_batch(monkeypatch, family):
    """Right-padded rows never see their pads: scores of one padding length are the same
    bits; where a piece pads less than the whole example, float32 rounding apart."""
    engine = engine_of(family)
    for names in (SAME, MIXED):
        examples = record(names)
        whole, whole_scores, whole_rows = scored(monkeypatch, engine, examples, 64)
        assert whole_rows == [6 * 9]  # every example in one call
        for batch_size in (4, 1):
            metrics, scores, rows = scored(monkeypatch, engine, examples, batch_size)
            assert metrics == whole
            assert max(rows) == batch_size
            for piece, one in zip(scores, whole_scores, strict=True):
                if names is SAME:
                    assert torch.equal(piece, one)
                else:
                    torch.testing.assert_close(piece, one, rtol=0, atol=1e-5)


def test_every_rank_makes_as_many_forwards_and_covers_its_share(monkeypatch):
    """Each forward under the sliced transfer is a collective: a rank of fewer pieces
    (here 5+6 candidates against 7) repeats a spare call, of no more rows than a piece."""
    engine = engine_of("opt")
    examples = record(SAME, count=3)  # 5, 6 and 7 candidates
    whole = scored(monkeypatch, engine, examples, 64)[0]
    right, calls = 0.0, []
    for rank in (0, 1):  # shares of 1 example (5 candidates) and 2 (6 and 7)
        parallel = RankOf(rank, 2)
        metrics, _, rows = scored(monkeypatch, engine, examples, 6, parallel)
        assert max(rows) == 3  # 6 rows a call over 2 ranks: 3 a rank
        calls.append(len(rows))
        right += metrics["eval_accuracy"] * len(eval_calls.share(3, parallel))
    assert calls == [6, 6]  # the largest share (2 examples) in pieces of 3 rows: 2 x 3
    assert right / 3 == pytest.approx(whole["eval_accuracy"])


def test_the_memory_plan_counts_a_piece_not_the_whole_candidate_set(monkeypatch):
    examples = record(SAME)
    data = PromptData(LoadedRows("record", examples, examples), encoder(), 0, 4, 2)
    assert planned_rows(data, 1) == 4
    assert planned_rows(data, 2) == 2
    data.eval_batch_size = 64
    assert planned_rows(data, 1) == 63  # 7 whole examples of 9 rows
    # --num-dev's examples go through the same forwards: the widest of either set plans
    narrow = record(SAME, count=1)  # 5 candidates
    data = PromptData(LoadedRows("record", narrow, narrow, dev=examples), encoder(), 0, 64, 2)
    assert planned_rows(data, 1) == 63  # not 60, 12 of 5 rows
    job = JobConfig()
    job.data.batch_size, job.data.eval_batch_size = 1, 4
    data.eval_batch_size = 4
    model = base_model("opt", seed=1, vocab_size=len(TOKENIZER), max_position_embeddings=256)
    config = ZOConfig(device="cpu", seed=0, mode="offload", num_slots=2)
    planned = []
    monkeypatch.setattr(build, "plan_memory", lambda *a, **kw: planned.append(kw["eval_rows"]))
    parallel = ParallelContext(
        LaunchEnv(rank=0, world_size=1), ParallelDims(1, 1), comm=Collectives(torch.device("cpu"))
    )
    build.memory_plan(job, model, data, config, parallel, torch.device("cpu"))
    assert planned == [4]


def test_a_dev_evaluation_forwards_no_more_rows_than_the_batch_of_its_own_widest(monkeypatch):
    """The dev rows' evaluation plans its forwards by the widest dev example (dev_rows), not
    the eval set's: eval examples of 5 rows take two a call of 10, dev ones of 9 one."""
    engine = engine_of("opt")
    narrow, wide = record(SAME, count=1), record(SAME)  # 5 candidates; 5 to 9
    data = PromptData(LoadedRows("record", narrow, narrow, dev=wide), encoder(), 0, 10, 2)
    forwarded, embed = [], engine.family.embed
    monkeypatch.setattr(
        engine.family, "embed", lambda ids, ctx: forwarded.append(ids.shape[0]) or embed(ids, ctx)
    )
    metrics = evaluation.evaluate(engine, data, ParallelContext.single(), split="dev")
    assert set(metrics) == {"dev_loss", "dev_accuracy"}  # record trains on lm: its loss too
    assert max(forwarded) == 9 and len(forwarded) == len(wide)  # an example a call
