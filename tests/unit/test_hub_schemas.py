"""``hf:`` datasets with the hub's own features (their dataset cards' ``dataset_info``):
SuperGLUE's ReCoRD (``entity_spans`` and ``idx`` beside the columns read), WSC.fixed (a
``ClassLabel`` label), COPA, MultiRC (an ``idx`` struct) and DROP (``answers_spans`` a
sequence of {spans, types}), written as parquet datasets in a local folder and read
through ``_hub_rows`` as ``hf:FOLDER:SPLIT``. Their test splits hide the labels (-1)
and ReCoRD's answers ([]): refused naming the split to use."""

import json

import pytest
from datasets import ClassLabel, Dataset, Features, Sequence, Value

from distzo.data.task_data import load_task_rows
from distzo.models import hub_reads

BOOL = ClassLabel(names=["False", "True"])
FEATURES = {
    "record": Features(
        {
            "passage": Value("string"),
            "query": Value("string"),
            "entities": Sequence(Value("string")),
            "entity_spans": Sequence(
                {"text": Value("string"), "start": Value("int32"), "end": Value("int32")}
            ),
            "answers": Sequence(Value("string")),
            "idx": {"passage": Value("int32"), "query": Value("int32")},
        }
    ),
    "wsc": Features(
        {
            "text": Value("string"),
            "span1_index": Value("int32"),
            "span2_index": Value("int32"),
            "span1_text": Value("string"),
            "span2_text": Value("string"),
            "idx": Value("int32"),
            "label": BOOL,
        }
    ),
    "copa": Features(
        {
            "premise": Value("string"),
            "choice1": Value("string"),
            "choice2": Value("string"),
            "question": Value("string"),
            "idx": Value("int32"),
            "label": ClassLabel(names=["choice1", "choice2"]),
        }
    ),
    "multirc": Features(
        {
            "paragraph": Value("string"),
            "question": Value("string"),
            "answer": Value("string"),
            "idx": {name: Value("int32") for name in ("paragraph", "question", "answer")},
            "label": BOOL,
        }
    ),
    "drop": Features(
        {
            "section_id": Value("string"),
            "query_id": Value("string"),
            "passage": Value("string"),
            "question": Value("string"),
            "answers_spans": Sequence({"spans": Value("string"), "types": Value("string")}),
        }
    ),
}


def row(task: str, i: int) -> dict:
    rows: dict[str, dict] = {
        "record": {
            "passage": f"Tom met Ann in Rome, day {i}.\n@highlight\nA trip",
            "query": "@placeholder went home.",
            "entities": ["Tom", "Ann", "Rome"],
            "entity_spans": {"text": ["Tom", "Ann"], "start": [0, 8], "end": [2, 10]},
            "answers": [["Tom", "Ann", "Rome"][i % 3]],
            "idx": {"passage": i, "query": 0},
        },
        "wsc": {
            "text": f"Ann {i} met Bea. She smiled.",
            "span1_index": 0,
            "span2_index": 4,
            "span1_text": "Ann",
            "span2_text": "She",
            "idx": i,
            "label": i % 2,
        },
        "copa": {
            "premise": f"The man {i} fell.",
            "choice1": "He tripped.",
            "choice2": "He sang.",
            "question": "cause",
            "idx": i,
            "label": i % 2,
        },
        "multirc": {
            "paragraph": f"Day {i}.",
            "question": "Which day?",
            "answer": str(i),
            "idx": {"paragraph": 0, "question": 0, "answer": i},
            "label": i % 2,
        },
        "drop": {
            "section_id": "s",
            "query_id": str(i),
            "passage": f"It has {i} legs.",
            "question": "How many legs?",
            "answers_spans": {"spans": [str(i), "legs"], "types": ["number", "span"]},
        },
    }
    return rows[task]


def hidden(task: str, values: dict) -> dict:
    """A row of the hub's test split: its label -1, ReCoRD's answers empty."""
    if task == "record":
        return dict(values, answers=[])
    return dict(values, label=-1)


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No hub: datasets offline, its cache in tmp_path."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    monkeypatch.setattr(hub_reads, "hub_answers", lambda: False)


@pytest.mark.parametrize("task", sorted(FEATURES))
def test_a_hub_schema_gives_the_rows_a_plain_file_gives(offline, tmp_path, task):
    rows = [row(task, i) for i in range(3)]
    folder = tmp_path / task
    (folder / "data").mkdir(parents=True)
    splits = {"train": rows}
    if task != "drop":  # the hub's DROP has no test split
        splits["test"] = [hidden(task, r) for r in rows]
    for split, split_rows in splits.items():
        dataset = Dataset.from_list(split_rows, features=FEATURES[task])
        dataset.to_parquet(str(folder / "data" / f"{split}-00000-of-00001.parquet"))
    plain = tmp_path / "rows.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in rows))

    loaded = load_task_rows(task, f"hf:{folder}:train", f"hf:{folder}:train")
    assert loaded is not None
    expected = load_task_rows(task, str(plain), str(plain))
    assert expected is not None and loaded.train == expected.train
    if task == "drop":
        return
    with pytest.raises(ValueError, match="test, row 1: .* a test split hides them .* validation"):
        load_task_rows(task, f"hf:{folder}:train", f"hf:{folder}:test")
