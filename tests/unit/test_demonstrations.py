"""MeZO's in-context learning (--num-demos): the demonstrations each evaluation row is
shown, drawn as MeZO's sample_train_sets draws them (numpy's global generator, as its
code calls it), joined before the prompt as its encode_prompt joins them, and refused in
one line wherever MeZO's ICL does not apply. benchmarks/icl_check.py compares the same
against MeZO's own code."""

import logging

import numpy as np
import pytest

from distzo.config.checks import check_job
from distzo.config.job import resolve, to_toml
from distzo.data import demonstrations
from distzo.data.demonstrations import (
    demo_draws,
    demo_seeds,
    demonstrated,
    demonstration,
    with_demonstrations,
)
from distzo.data.encoding import PromptEncoder
from distzo.data.sampling import Sampling, mezo_draw
from distzo.data.task_data import load_task_rows
from distzo.data.templates import TASKS, Example, build_examples
from distzo.dist import LaunchEnv
from distzo.models.tiny import byte_tokenizer
from tests.helpers.rows import sst2_like, write_jsonl


def _mezo_sets(train_rows: int, eval_rows: int, num: int, seed: int | None) -> list[list[int]]:
    """tasks.py's sample_train_sets and sample_subset, with numpy's global generator as
    MeZO seeds it (temp_seed: np.random.seed)."""
    if seed is None:
        np.random.seed(0)
        seeds = np.random.randint(0, 10000, eval_rows).tolist()
    else:
        seeds = [seed]
    sets = []
    for set_seed in seeds:
        np.random.seed(set_seed)
        sets.append(np.random.permutation(train_rows).tolist()[:num])
    return sets if seed is None else sets * eval_rows


def test_per_row_sets_take_mezos_seeds_and_a_shared_set_its_train_set_seed():
    assert demo_seeds(4, 0) == [2732, 9845, 3264, 4859]  # np.random.seed(0); randint
    assert demo_draws(50, 7, 5, "per-row", 0) == _mezo_sets(50, 7, 5, None)
    assert demo_draws(50, 7, 5, "shared", 9) == _mezo_sets(50, 7, 5, 9)
    assert demo_draws(10, 2, 3, "shared", 7) == [[8, 5, 0], [8, 5, 0]]
    per_row = demo_draws(50, 7, 5, "per-row", 0)
    assert len({tuple(d) for d in per_row}) == 7  # a set of its own for every row
    assert demo_draws(50, 7, 5, "per-row", 1) != per_row  # --train-set-seed draws the seeds


def test_a_seed_that_repeats_permutes_the_training_rows_once(monkeypatch):
    """1,000 rows' seeds of 10,000 repeat: a permutation of a large --train-file per
    evaluation row was the draw's cost, where one per distinct seed gives the same sets."""
    seeds = demo_seeds(1000, 0)
    calls: list[int] = []

    def counted(rows: int, num: int, seed: int) -> list[int]:
        calls.append(seed)
        return mezo_draw(rows, num, seed)

    monkeypatch.setattr(demonstrations, "mezo_draw", counted)
    draws = demo_draws(30, 1000, 4, "per-row", 0)
    assert len(set(seeds)) < 1000 and sorted(calls) == sorted(set(seeds))
    assert draws == [mezo_draw(30, 4, s) for s in seeds]


def test_a_demonstration_is_the_right_candidates_text_joined_by_a_blank_line():
    sst2, squad = TASKS["sst2"].build, TASKS["squad"].build
    demos = [
        sst2({"sentence": " a fine film ", "label": 1}),
        sst2({"sentence": "dull", "label": 0}),
    ]
    row = sst2({"sentence": "long", "label": 1})
    shown = demonstrated(demos, row)
    assert shown.prompt == "a fine film It was great\n\ndull It was terrible\n\nlong It was"
    assert (shown.continuations, shown.label) == (row.continuations, row.label)
    answer = squad({"title": "T", "context": "C", "question": "Q? ", "answers": ["yes", "y"]})
    assert demonstration(answer) == "Title: T\nContext: C\nQuestion: Q?\nAnswer: yes"
    # the row's leading spaces go, as encode_prompt's strip(' ') of the eval prompt does
    spaced = Example("  so it was", (" ok",), 0)
    assert demonstrated(demos[:1], spaced).prompt == "a fine film It was great\n\nso it was"


def test_load_task_rows_shows_each_evaluation_row_its_draw(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", sst2_like(30))
    evals = write_jsonl(tmp_path / "e.jsonl", sst2_like(12))
    plain = load_task_rows("sst2", train, evals, Sampling(num_eval=5, seed=3))
    loaded = load_task_rows("sst2", train, evals, Sampling(num_eval=5, seed=3, num_demos=4))
    assert plain is not None and loaded is not None
    assert loaded.train == plain.train  # the training rows as they were
    draws = demo_draws(30, 5, 4, "per-row", 3)
    for example, bare, drawn in zip(loaded.eval, plain.eval, draws, strict=True):
        shown = "\n\n".join(demonstration(plain.train[i]) for i in drawn)
        assert example.prompt == shown + "\n\n" + bare.prompt
    assert loaded.digests["--eval-file"] != plain.digests["--eval-file"]  # a resume tells


def test_demonstrations_are_refused_where_mezos_icl_does_not_apply(tmp_path):
    data = write_jsonl(tmp_path / "t.jsonl", sst2_like(6))
    with pytest.raises(ValueError, match="^--num-demos 7 asks more rows than the 6 of "):
        load_task_rows("sst2", data, data, Sampling(num_demos=7))
    with pytest.raises(ValueError, match="^--num-demos puts demonstrations before a causal"):
        load_task_rows("sst2", data, data, Sampling(num_demos=2), masked=True)
    with pytest.raises(ValueError, match="--task text has none: drop --num-demos"):
        resolve(["--task", "text", "--num-demos", "2", "--max-steps", "0"]).validate()
    with pytest.raises(ValueError, match="trains nothing: drop --num-train and --num-dev$"):
        resolve(
            ["--task", "sst2", "--num-demos", "2", "--num-train", "8", "--num-dev", "2"]
        ).validate()
    with pytest.raises(ValueError) as zero:
        resolve(["--task", "sst2", "--num-demos", "0"]).validate()
    # leaving it out scores zero-shot: not "every row", as the draws' counts said
    assert str(zero.value) == (
        "--num-demos must be >= 1 (leave it out: no demonstrations, zero-shot), got 0"
    )
    with pytest.raises(ValueError, match="but --max-steps is 2000; give --max-steps 0"):
        check_job(resolve(["--task", "sst2", "--num-demos", "2"]), LaunchEnv())


def test_the_options_are_recorded_and_demo_sets_alone_is_named_as_ignored(caplog):
    job = resolve(
        ["--task", "sst2", "--num-demos", "32", "--demo-sets", "shared", "--max-steps", "0"]
    )
    check_job(job, LaunchEnv())
    assert job.data.sampling == Sampling(num_demos=32, demo_sets="shared")
    assert 'num_demos = 32\ndemo_sets = "shared"\n' in to_toml(job)
    assert "num_demos" not in to_toml(resolve([]))  # unset: no line, as earlier runs wrote
    with caplog.at_level(logging.WARNING, logger="distzo.train"):
        resolve(["--demo-sets", "shared"])
    assert "ignored: --demo-sets (it applies only with --num-demos)" in caplog.text


def test_with_demonstrations_keeps_a_records_right_answers():
    record = TASKS["record"].build
    row = {
        "passage": "A met B.\n@highlight\nB won",
        "query": "@placeholder won",
        "entities": ["A", "B"],
        "answers": ["B"],
    }
    (shown,) = with_demonstrations([record(row)], [record(row)], 1, "shared", 0, "t")
    assert shown.prompt == "A met B.\n- B won\n- B won\n\nA met B.\n- B won\n-"
    assert shown.continuations == (" A won", " B won") and shown.label == 1


def test_a_cut_demonstrated_row_keeps_the_leading_token_as_mezos_encode_prompt():
    """MeZO's cut with a tokenizer that adds a leading token (``add_bos_token``: OPT's,
    Llama's) keeps that token and the last max_length - 1 of the rest: the demonstrations
    lose their start, the row and its candidate stay. The byte tokenizer adds ``</s>``."""
    tokenizer = byte_tokenizer()
    rows = sst2_like(6)
    examples = build_examples(TASKS["sst2"], rows, "t")
    (shown,) = with_demonstrations(examples[:4], examples[4:5], 4, "shared", 0, "t")
    encoder = PromptEncoder(tokenizer, max_length=40)
    bos = tokenizer.bos_token_id
    for candidate in shown.continuations:
        ids, answer = encoder.encode(shown.prompt, candidate)
        whole = tokenizer(shown.prompt + candidate)["input_ids"]  # MeZO's encode of the text
        # its option_len: the row's verbalized ids less its prompt's, demonstrations aside
        option = len(tokenizer(examples[4].prompt + candidate)["input_ids"]) - len(
            tokenizer(examples[4].prompt)["input_ids"]
        )
        assert len(whole) > 40 and whole[0] == bos
        assert (ids, answer) == (whole[:1] + whole[1:][-39:], option)
        assert tokenizer.decode(ids[1:]).endswith(examples[4].prompt + candidate)
