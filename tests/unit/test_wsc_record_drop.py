"""MeZO's WSC, ReCoRD and DROP (large_models/tasks.py, templates.py, mezo.sh): their rows,
candidates and right answers, the objectives each takes, how each is evaluated, and a
short run of each through the command line. The templates' rendered text is checked with
the other tasks' in test_tasks.py."""

import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from distzo import ZOConfig, ZOEngine
from distzo.config.job import resolve
from distzo.data.encoding import PromptEncoder
from distzo.data.task_data import (
    LoadedRows,
    check_objective,
    default_objective,
    load_task_rows,
    rows_digest,
)
from distzo.data.templates import TASKS, build_examples
from distzo.dist import ParallelContext
from distzo.job.evaluation import evaluate_choices
from distzo.models.tiny import byte_tokenizer
from distzo.objectives import Accuracy, collate_choices
from distzo.objectives.choice import prepare_choices
from tests.helpers.models import tiny_opt
from tests.helpers.rows import write_jsonl
from tests.unit.test_shared_row_pass import build_parts


def record_row(i: int, answers: list[str] | None = None) -> dict:
    entities = ["Tom", "Ann", "Rome", "Paris"][: 2 + i % 3]  # 2 to 4 candidates a row
    return {
        "passage": f"Tom met Ann in Rome, day {i}.\n@highlight\nA trip",
        "query": "@placeholder went home.",
        "entities": entities,
        "answers": answers or [entities[i % len(entities)]],
    }


def test_record_trains_on_the_first_answer_and_counts_every_answer_right():
    row = dict(record_row(2), entities=["Tom", "Ann", "Rome", "Ann"], answers=["Rome", "Tom"])
    (example,) = build_examples(TASKS["record"], [row], "r.jsonl")
    # a repeated entity is one candidate
    assert example.continuations == (" Tom went home.", " Ann went home.", " Rome went home.")
    assert (example.label, example.right) == (2, (0, 2))


def test_drop_keeps_every_gold_span_and_reads_a_csv_cell_of_json(tmp_path):
    path = tmp_path / "drop.csv"
    spans = json.dumps({"spans": ["4", "four"], "types": ["number", "number"]})
    path.write_text(
        'passage,question,answers_spans\n"It has 4 legs.",How many legs?,'
        + '"'
        + spans.replace('"', '""')
        + '"\n'
    )
    loaded = load_task_rows("drop", str(path), str(path))
    assert loaded is not None
    (example,) = loaded.train
    assert example.answers == ("4", "four") and example.continuations == (" 4\n",)


def test_record_reads_its_lists_from_parquet_and_a_csv_cells_json(tmp_path):
    rows = [record_row(i) for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "r.parquet")
    csv = tmp_path / "r.csv"
    csv.write_text(
        "passage,query,entities,answers\n"
        + "".join(
            ",".join(
                '"' + (v if isinstance(v, str) else json.dumps(v)).replace('"', '""') + '"'
                for v in row.values()
            )
            + "\n"
            for row in rows
        )
    )
    expected = build_examples(TASKS["record"], rows, "x")
    for path in (tmp_path / "r.parquet", csv):
        loaded = load_task_rows("record", str(path), str(path))
        assert loaded is not None and loaded.train == expected


@pytest.mark.parametrize(
    "name, row, message",
    [
        (
            "wsc",
            {"text": "t", "span2_text": "it", "label": 0},
            "row 1: missing column 'span1_text' \\(task wsc needs text, span1_text, span2_text, "
            "label\\)",
        ),
        (
            "record",
            {"passage": "p", "query": "q @placeholder", "entities": ["A"]},
            "row 1: missing column 'answers' \\(task record needs passage, query, entities, "
            "answers\\)",
        ),
        (
            "drop",
            {"passage": "p", "question": "q", "answers": ["a"]},
            "row 1: missing column 'answers_spans' \\(task drop needs passage, question, "
            "answers_spans\\)",
        ),
        (
            "record",
            dict(record_row(0), answers=["Bob"]),
            "row 1: answer 'Bob' is not one of the entities; a right answer must be a candidate",
        ),
        (
            "record",
            dict(record_row(0), query="Tom went home."),
            "row 1: query 'Tom went home.' holds no @placeholder; write the entity's place",
        ),
        ("record", dict(record_row(0), entities=[]), "row 1: entities must be a non-empty list"),
        (
            "drop",
            {"passage": "p", "question": "q", "answers_spans": {"spans": [], "types": []}},
            "row 1: answers_spans must be a non-empty list of strings "
            '\\(or {"spans": \\[...\\]}\\)',
        ),
        (
            "wsc",
            {"text": "t", "span1_text": 3, "span2_text": "it", "label": 0},
            "row 1: column 'span1_text' holds 3 \\(int\\), not text",
        ),
        (
            "wsc",
            {"text": "t", "span1_text": "a", "span2_text": "it", "label": 2},
            "row 1: label 2 is outside 0..1",
        ),
    ],
)
def test_malformed_rows_are_one_line_errors_naming_the_column(name, row, message):
    with pytest.raises(ValueError, match="data.jsonl, " + message) as info:
        build_examples(TASKS[name], [row], "data.jsonl")
    assert "\n" not in str(info.value)


def test_each_task_takes_mezos_objective_and_refuses_those_that_do_not_apply():
    assert [default_objective(t) for t in ("wsc", "record", "drop")] == [
        "classification",
        "lm",
        "lm",
    ]
    for task in ("wsc", "record"):
        for objective in ("lm", "classification", "accuracy"):
            check_objective(task, objective)
    check_objective("drop", "f1")
    with pytest.raises(ValueError) as info:
        check_objective("record", "f1")
    assert str(info.value) == (
        "--objective f1 does not apply to --task record; choose one of lm, classification, accuracy"
    )
    with pytest.raises(ValueError, match="^--objective classification does not apply to --task "):
        check_objective("drop", "classification")


def test_drop_decodes_max_new_tokens_and_a_one_answer_tasks_rows_hash_as_before(caplog):
    # --max-new-tokens was ignored (with a warning) on DROP, decoded at squad's 16 tokens
    with caplog.at_level("WARNING", logger="distzo.train"):
        assert resolve(["--task", "drop", "--max-new-tokens", "4"]).data.max_new_tokens == 4
    assert caplog.records == []
    # a run logged before the ``right`` field resumes: its rows' JSON has four fields
    examples = build_examples(TASKS["sst2"], [{"sentence": "a fine film", "label": 1}], "x")
    logged = [[e.prompt, list(e.continuations), e.label, list(e.answers)] for e in examples]
    assert rows_digest(examples) == hashlib.sha256(json.dumps(logged).encode()).hexdigest()[:16]


def test_a_pick_among_any_right_candidates_is_a_hit_for_the_accuracy_objective():
    """MeZO's ReCoRD accuracy: the best-scored entity is right if it is any of the answers."""
    rows = [
        dict(record_row(1), answers=["Tom", "Rome"]),  # three candidates, two right
        record_row(0, ["Ann"]),  # two candidates, one right
    ]
    examples = build_examples(TASKS["record"], rows, "x")
    encoder = PromptEncoder(byte_tokenizer(), max_length=256)
    prepared = prepare_choices(
        collate_choices([encoder.encode_choices(e) for e in examples], encoder.pad_id),
        torch.device("cpu"),
    )
    ninf = float("-inf")
    scores = torch.tensor([[-3.0, -2.0, -1.0], [-1.0, -2.0, ninf]])  # picks Rome, then Tom
    assert Accuracy().from_scores(scores, prepared).item() == -1.0
    scores = torch.tensor([[-1.0, -2.0, -3.0], [-2.0, -1.0, ninf]])  # picks Tom, then Ann
    assert Accuracy().from_scores(scores, prepared).item() == -2.0


def test_record_evaluation_counts_a_pick_of_any_answer_over_ranks_of_rows():
    tokenizer = byte_tokenizer()
    engine = ZOEngine(
        tiny_opt(seed=3, vocab_size=len(tokenizer), max_position_embeddings=256),
        ZOConfig(device="cpu", seed=0),
    )
    encoder = PromptEncoder(tokenizer, max_length=256)
    # every entity an answer: any pick is right, whichever the model scores best
    rows = [dict(r, answers=r["entities"]) for r in (record_row(i) for i in range(6))]
    examples = build_examples(TASKS["record"], rows, "x")
    single = ParallelContext.single()
    assert evaluate_choices(engine, examples, encoder, single, batch_size=5) == {
        "eval_accuracy": 1.0
    }


@pytest.mark.parametrize("task", ["wsc", "record", "drop"])
def test_ranks_sharing_the_row_pass_see_what_one_pass_sees(task):
    """ReCoRD's examples differ in candidates: the rows a trained example becomes are the
    largest part's."""
    rows = {
        "wsc": [
            {"text": f"A{'x' * i} saw B.", "span1_text": "A", "span2_text": "B", "label": i % 2}
            for i in range(9)
        ],
        "record": [record_row(i) for i in range(9)],
        "drop": [
            {"passage": f"P{'x' * i}.", "question": "Q?", "answers_spans": {"spans": [str(i)]}}
            for i in range(9)
        ],
    }[task]
    examples = build_examples(TASKS[task], rows, "x")
    loaded = LoadedRows(task, examples, examples[:4])
    objective = "lm" if task == "drop" else "classification"  # every candidate a row
    (alone, _), *parts = build_parts(loaded, 1, objective, 64) + build_parts(
        loaded, 3, objective, 64
    )
    if task == "record":
        assert alone.rows_per_example == 4
    for data, _ in parts:
        assert (data.longest, data.rows_per_example) == (alone.longest, alone.rows_per_example)
        batch, expected = data.batch(4, 1), alone.batch(4, 1)
        assert batch.keys() == expected.keys()
        assert all(torch.equal(batch[k], expected[k]) for k in batch)


@pytest.mark.parametrize(
    "task, objective, metrics",
    [
        ("wsc", "classification", {"eval_accuracy"}),
        ("record", "accuracy", {"eval_accuracy"}),
        ("drop", "f1", {"eval_f1", "eval_exact_match"}),
    ],
)
def test_each_task_trains_and_evaluates_through_the_cli(tmp_path, task, objective, metrics):
    from tests.helpers.launch import python_train

    rows = {
        "wsc": [
            {"text": f"Ann {i} met Bea.", "span1_text": "Ann", "span2_text": "She", "label": i % 2}
            for i in range(6)
        ],
        "record": [dict(record_row(i), answers=record_row(i)["entities"][:2]) for i in range(6)],
        "drop": [
            {"passage": f"It is {i}.", "question": "What?", "answers_spans": {"spans": [str(i)]}}
            for i in range(6)
        ],
    }[task]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    out = tmp_path / "out"
    args = ["--task", task, "--train-file", train, "--eval-file", train, "--objective", objective]
    args += ["--max-steps", "2", "--batch-size", "2", "--max-new-tokens", "2"]
    proc = python_train([*args, "--output-dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    # decoding length: DROP's, named as ignored by the others
    assert ("--max-new-tokens" in proc.stderr) == (task != "drop"), proc.stderr[-3000:]
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2] and metrics <= evals[-1].keys()
    assert all(0 <= e[m] <= 1 for e in evals for m in metrics)


def test_a_drop_answer_in_one_string_is_one_answer_and_a_bad_list_cell_names_its_column():
    # a string taken as the list of its letters: trained on "t", every letter a right answer
    row = {"passage": "Tom scored twice.", "question": "How many?", "answers_spans": "two"}
    (example,) = build_examples(TASKS["drop"], [row], "x")
    assert example.answers == ("two",)
    with pytest.raises(ValueError, match="^x, row 1: answers_spans .* not as JSON"):
        build_examples(TASKS["drop"], [dict(row, answers_spans="['two']")], "x")
