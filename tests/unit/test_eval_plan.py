"""The memory plan counts the rows evaluation forwards (issue 29, item 4): on dp4 x pert2
the plan assumed ``eval_batch_size // world`` rows while each rank ran
``eval_batch_size`` rows per forward. ``--eval-batch-size`` is now the rows of one call
over all the ranks, and the plan reads the same figure."""

import pytest
import torch

from distzo import ZOConfig, ZOEngine
from distzo.config.job import JobConfig
from distzo.data.encoding import PromptEncoder
from distzo.data.task_data import LoadedRows, PromptData, TextData
from distzo.data.templates import TASKS, build_examples
from distzo.dist import Collectives, LaunchEnv, ParallelContext, ParallelDims
from distzo.job import build
from distzo.job.evaluation import evaluate
from distzo.models.tiny import byte_tokenizer
from tests.helpers.models import tiny_opt

TOKENIZER = byte_tokenizer()


def rte(n):
    rows = [{"premise": f"P{i}.", "hypothesis": "H.", "label": i % 2} for i in range(n)]
    return build_examples(TASKS["rte"], rows, "x")


def squad(n):
    rows = [
        {"title": "T", "context": f"Code {i}.", "question": "Which?", "answers": [str(i)]}
        for i in range(n)
    ]
    return build_examples(TASKS["squad"], rows, "x")


def task_data(kind, eval_batch_size):
    encoder = PromptEncoder(TOKENIZER, max_length=256)
    if kind == "text":
        texts = [f"Some text number {i}." for i in range(200)]
        return TextData(LoadedRows("text", texts, texts), encoder, 0, eval_batch_size)
    examples = {"rte": rte, "squad": squad}[kind](200)
    return PromptData(LoadedRows(kind, examples, examples), encoder, 0, eval_batch_size, 2)


def rank_of_eight(rank):
    """Rank ``rank`` of a dp4 x pert2 job, its sums left unreduced (no process group)."""
    parallel = ParallelContext(
        LaunchEnv(rank=rank, world_size=8, local_world_size=8),
        ParallelDims(4, 2),
        comm=Collectives(torch.device("cpu")),
    )
    parallel.sum_to_host = lambda values: parallel.comm.read(parallel.comm.stack(values))
    return parallel


@pytest.mark.parametrize("kind", ["rte", "squad", "text"])
@pytest.mark.parametrize("eval_batch_size", [16, 64])
def test_evaluation_forwards_the_rows_the_plan_counts(monkeypatch, kind, eval_batch_size):
    data = task_data(kind, eval_batch_size)
    job = JobConfig()
    job.data.batch_size, job.data.eval_batch_size = 4, eval_batch_size  # 1 training row
    model = tiny_opt(seed=1, vocab_size=len(TOKENIZER), max_position_embeddings=256)
    config = ZOConfig(device="cpu", seed=0, mode="offload", num_slots=2)
    planned = []
    monkeypatch.setattr(build, "plan_memory", lambda *args, **kw: planned.append(args[4]) or "plan")
    for rank in (0, 7):
        parallel = rank_of_eight(rank)
        build.memory_plan(job, model, data, config, parallel, torch.device("cpu"))
        engine = ZOEngine(tiny_opt(seed=1, vocab_size=len(TOKENIZER)), config)
        forwarded = []
        embed = engine.family.embed

        def counted(input_ids, ctx, embed=embed, forwarded=forwarded):
            forwarded.append(input_ids.shape[0])
            return embed(input_ids, ctx)

        monkeypatch.setattr(engine.family, "embed", counted)
        evaluate(engine, data, parallel)
        assert max(forwarded) == planned[-1] > 1, (forwarded, planned)
    # 200 examples over 8 ranks: each call forwards at most the rank's share of the
    # call's rows (choices: whole candidate sets of 2 rows)
    assert planned[-1] == -(-eval_batch_size // 8)


def test_only_the_node_of_rank_0_plans_the_export():
    """Rank 0 alone gathers the export's shards: a node of ranks 8-15 counted them too, and
    could refuse a job its memory holds."""
    data = task_data("rte", 16)
    job = JobConfig()
    job.data.batch_size, job.data.eval_batch_size = 16, 16
    model = tiny_opt(seed=1, vocab_size=len(TOKENIZER), max_position_embeddings=256)
    config = ZOConfig(device="cpu", seed=0, mode="offload", num_slots=2)
    exports = {}
    for rank in (0, 3, 8, 11):  # two nodes of 8 ranks, dp 8 x pert 2
        env = LaunchEnv(rank=rank, world_size=16, local_rank=rank % 8, local_world_size=8)
        parallel = ParallelContext(env, ParallelDims(8, 2), comm=Collectives(torch.device("cpu")))
        plan = build.memory_plan(job, model, data, config, parallel, torch.device("cpu"))
        exports[rank] = plan.export_bytes
    assert exports[0] == exports[3] > 0 and exports[8] == exports[11] == 0


@pytest.mark.parametrize("eval_batch_size, rows", [(8, 1), (24, 2)])
def test_a_call_plans_whole_candidate_sets_where_a_ranks_share_of_rows_holds_one(
    eval_batch_size, rows
):
    """Over 8 ranks, 24 rows a call leave each rank 3 rows: one whole set of 2 candidates
    (2 rows). 8 leave each rank 1 row: an example's candidates then go one a forward
    (``split_choices``), and the plan counts that row."""
    from distzo.job.evaluation import planned_rows

    assert planned_rows(task_data("rte", eval_batch_size), 8) == rows


def test_the_plan_counts_an_evaluation_forward_whole_under_grad_accum(monkeypatch):
    """--grad-accum splits a step's rows, never an evaluation's: the plan counted a block's
    intermediates for a step's micro-batch (4 rows here), while evaluation ran 16 at once."""
    encoder = PromptEncoder(TOKENIZER, max_length=256)
    texts = [f"Text {i}: " + "a long one " * 20 for i in range(32)]  # a block's work dominates
    data = TextData(LoadedRows("text", texts, texts), encoder, 0, 16)
    job = JobConfig()
    job.data.batch_size, job.data.eval_batch_size = 4, 16
    model = tiny_opt(seed=1, vocab_size=len(TOKENIZER), max_position_embeddings=256)
    parallel = ParallelContext(
        LaunchEnv(rank=0, world_size=1, local_world_size=1),
        ParallelDims(1, 1),
        comm=Collectives(torch.device("cpu")),
    )
    activations = {}
    for grad_accum in (1, 4):
        config = ZOConfig(device="cpu", seed=0, mode="offload", num_slots=2, grad_accum=grad_accum)
        plan = build.memory_plan(job, model, data, config, parallel, torch.device("cpu"))
        activations[grad_accum] = plan.activations
    engine = ZOEngine(model, config)
    forwarded = []
    embed = engine.family.embed
    monkeypatch.setattr(
        engine.family, "embed", lambda ids, ctx: forwarded.append(ids.shape[0]) or embed(ids, ctx)
    )
    evaluate(engine, data, parallel)
    assert max(forwarded) == 16  # one piece under --grad-accum 4
    assert activations[4] == activations[1]
