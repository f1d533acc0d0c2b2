"""Evaluation moves each block once per forward call and never back: a pass with no
pending update changes no block, so nothing is offloaded (issue: evaluation streamed
every block twice)."""

import collections
import copy
import io
import math

import pytest
import torch
from tqdm import tqdm

from distzo import ZOConfig, ZOEngine
from distzo.data.encoding import PromptEncoder, PromptTrainData
from distzo.data.templates import TASKS, build_examples
from distzo.dist import LaunchEnv, ParallelContext
from distzo.job.evaluation import evaluate_choices, evaluate_generation, evaluate_lm
from distzo.models.tiny import byte_tokenizer
from tests.helpers.models import tiny_opt

TOKENIZER = byte_tokenizer()


class Counting:
    """Counts the store's uploads and offloads per block."""

    def __init__(self, engine):
        self.uploads, self.offloads = collections.Counter(), collections.Counter()
        upload, offload = engine.store.upload, engine.store.offload

        def counted_upload(i):
            self.uploads[i] += 1
            upload(i)

        def counted_offload(i):
            self.offloads[i] += 1
            offload(i)

        engine.store.upload, engine.store.offload = counted_upload, counted_offload


def engine_and_encoder():
    model = tiny_opt(
        seed=1, vocab_size=len(TOKENIZER), max_position_embeddings=256, num_hidden_layers=3
    )
    engine = ZOEngine(model, ZOConfig(device="cpu", seed=0, mode="offload", num_slots=2))
    return engine, PromptEncoder(TOKENIZER, max_length=256)


def squad(n):
    rows = [
        {"title": "T", "context": f"Code {i}.", "question": "Which?", "answers": [str(i)]}
        for i in range(n)
    ]
    return build_examples(TASKS["squad"], rows, "x")


@pytest.mark.parametrize("examples, rows, new_tokens", [(5, 2, 3), (4, 4, 2), (1, 3, 4)])
def test_generation_uploads_each_block_once_per_decoding_step_and_offloads_none(
    examples, rows, new_tokens
):
    engine, encoder = engine_and_encoder()
    counts = Counting(engine)
    evaluate_generation(
        engine, squad(examples), encoder, ParallelContext.single(), rows, new_tokens
    )
    bound = math.ceil(examples / rows) * new_tokens
    assert set(counts.uploads.values()) == {bound} and len(counts.uploads) == 3
    assert not counts.offloads


def test_choice_and_lm_evaluation_upload_once_per_call_and_offload_only_a_pending_update():
    engine, encoder = engine_and_encoder()
    examples = build_examples(
        TASKS["rte"],
        [{"premise": f"P{i}.", "hypothesis": "H.", "label": i % 2} for i in range(6)],
        "x",
    )
    counts = Counting(engine)
    # 2 rows each: 2 per call
    evaluate_choices(engine, examples, encoder, ParallelContext.single(), batch_size=4)
    assert set(counts.uploads.values()) == {3} and not counts.offloads

    engine.step(PromptTrainData(examples, encoder, seed=0).batch(4, 0))  # leaves a pending update
    counts.uploads.clear(), counts.offloads.clear()
    lm_batch = PromptTrainData(examples, encoder, seed=0).batch(6, 1)
    evaluate_lm(engine, lm_batch, ParallelContext.single(), batch_size=2)  # 3 calls
    assert set(counts.uploads.values()) == {3}
    assert set(counts.offloads.values()) == {
        1
    }  # the first call applies the update and writes it back, once


class RankOf:
    """Rank ``rank`` of ``world`` as the evaluation sees it, its sums not reduced (a
    stand-in: no process group)."""

    def __init__(self, rank, world):
        self.env = LaunchEnv(rank=rank, world_size=world)

    def sum_to_host(self, values):
        return [float(v) for v in values]


@pytest.mark.parametrize("batch_size", [None, 2])
def test_every_rank_makes_as_many_lm_forward_calls_as_its_peers(batch_size):
    """Each forward under the sliced transfer is a collective: with 3 rows over 2 ranks
    and no batch size, the rank of one row made a second call (2 against 1) and hung."""
    engine, encoder = engine_and_encoder()
    examples = build_examples(
        TASKS["sst2"], [{"sentence": f"s {i}", "label": 1} for i in range(3)], "x"
    )
    batch = PromptTrainData(examples, encoder, seed=0).batch(3, 0)
    counts, calls = Counting(engine), []
    for rank in (0, 1):  # shares of 2 rows and 1
        counts.uploads.clear()
        evaluate_lm(engine, batch, RankOf(rank, 2), batch_size=batch_size)
        calls.append(counts.uploads[0])
    assert calls == ([1, 1] if batch_size is None else [2, 2])  # 2 rows: 1 per rank per call


@pytest.mark.parametrize("count", [1, 2, 5, 7, 12])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_ranks_shares_cover_the_evaluation_set_once(count, world):
    """The metric covers the whole set once: the ranks' shares, in rank order, are every
    example exactly once, and no share is more than one example larger than another."""
    from distzo.job.eval_calls import share as _share

    shares = [list(_share(count, RankOf(rank, world))) for rank in range(world)]
    assert [i for share in shares for i in share] == list(range(count))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


class SumsOf(RankOf):
    """``RankOf`` that keeps the sums it was asked to reduce, for the test to add up."""

    def __init__(self, rank, world, sums):
        super().__init__(rank, world)
        self.sums = sums

    def sum_to_host(self, values):
        self.sums.append([float(v) for v in values])
        return super().sum_to_host(values)


def test_the_ranks_sums_add_up_to_the_one_process_metric():
    """Each rank's sums count its own examples: added over the ranks (the all-reduce),
    they are the one-process metric's, over the set once."""
    engine, encoder = engine_and_encoder()
    rte = build_examples(
        TASKS["rte"],
        [{"premise": f"P{i}.", "hypothesis": "H.", "label": i % 2} for i in range(7)],
        "x",
    )
    runs = [
        (lambda p: evaluate_choices(engine, rte, encoder, p, batch_size=4), "eval_accuracy", 7),
        (lambda p: evaluate_generation(engine, squad(5), encoder, p, 2, 2), "eval_f1", 5),
    ]
    for evaluate, metric, count in runs:
        whole = evaluate(ParallelContext.single())[metric]
        for world in (2, 3):
            sums: list[list[float]] = []
            for rank in range(world):
                evaluate(SumsOf(rank, world, sums))
            added = [sum(column) for column in zip(*sums)]
            assert added[-1] == count  # every example counted once
            assert added[0] / added[-1] == pytest.approx(whole)


def test_lm_evaluation_is_the_mean_next_token_loss_over_the_label_tokens():
    """``eval_loss`` is the mean next-token loss per label token and ``eval_accuracy`` the
    share of label tokens predicted, as computed from the model's own logits."""
    model = tiny_opt(seed=1, vocab_size=len(TOKENIZER), max_position_embeddings=256)
    reference = copy.deepcopy(model).eval()  # no dropout, as the engine runs it
    engine = ZOEngine(model, ZOConfig(device="cpu", seed=0))
    examples = build_examples(
        TASKS["sst2"], [{"sentence": "s " + "x" * i, "label": i % 2} for i in range(5)], "x"
    )
    batch = PromptTrainData(examples, PromptEncoder(TOKENIZER, max_length=256), seed=0).batch(5, 0)
    with torch.no_grad():
        logits = reference(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels, logits = batch["labels"][:, 1:], logits[:, :-1].double()
    scored = labels != -100
    nll = -logits.log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    for batch_size in (None, 2):
        metrics = evaluate_lm(engine, batch, ParallelContext.single(), batch_size=batch_size)
        assert metrics["eval_loss"] == pytest.approx(nll[scored].mean().item(), rel=1e-5)
        hits = (logits.argmax(-1) == labels)[scored].double().mean().item()
        assert metrics["eval_accuracy"] == pytest.approx(hits)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_an_evaluation_shows_its_calls_on_rank_0s_terminal_and_leaves_its_figures_alone(
    monkeypatch,
):
    # an evaluation of a minute (SmolLM2, 500 rows) printed nothing until it ended
    engine, encoder = engine_and_encoder()
    examples = build_examples(
        TASKS["rte"],
        [{"premise": f"P{i}.", "hypothesis": "H.", "label": i % 2} for i in range(6)],
        "x",
    )
    quiet = evaluate_choices(engine, examples, encoder, ParallelContext.single(), batch_size=4)
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert evaluate_choices(engine, examples, encoder, RankOf(1, 2), batch_size=4)
    assert terminal.getvalue() == ""  # another rank than 0
    shown = evaluate_choices(engine, examples, encoder, ParallelContext.single(), batch_size=4)
    assert shown == quiet
    drawn = terminal.getvalue()
    assert "eval:   0%" in drawn and "0/3 [" in drawn and " batches/s]" in drawn  # 3 calls
    assert drawn.endswith("\r") and not tqdm._instances  # cleared when it ends


def test_an_evaluations_bar_counts_each_call_and_a_log_file_holds_none(monkeypatch):
    # a bar that never moved (its count left at 0 of 3) read as a hung evaluation; a bar
    # in a log file is tqdm's carriage returns kept one after the other
    from distzo.job import progress

    bars = []

    class Counted(tqdm):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            bars.append(self)

    monkeypatch.setattr(progress, "tqdm", Counted)
    engine, encoder = engine_and_encoder()
    examples = build_examples(
        TASKS["rte"],
        [{"premise": f"P{i}.", "hypothesis": "H.", "label": i % 2} for i in range(6)],
        "x",
    )
    log_file = io.StringIO()
    monkeypatch.setattr("sys.stderr", log_file)
    evaluate_choices(engine, examples, encoder, ParallelContext.single(), batch_size=4)
    assert log_file.getvalue() == "" and bars == []
    monkeypatch.setattr("sys.stderr", Terminal())
    evaluate_choices(engine, examples, encoder, ParallelContext.single(), batch_size=4)
    assert [(bar.n, bar.total) for bar in bars] == [(3, 3)]
