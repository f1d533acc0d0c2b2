"""Prompt tasks: templates, loaders, malformed input, evaluation against a plain loop."""

import csv
import json
import sys

import pytest
import torch

from distzo import ZOConfig, ZOEngine
from distzo.data import templates
from distzo.data.encoding import PromptEncoder, epoch_order, step_indices
from distzo.data.loaders import load_numbered_rows, load_rows, parse_hub_spec
from distzo.data.task_data import LoadedRows, TextData, load_task_rows, rows_digest
from distzo.data.templates import TASKS, build_examples
from distzo.dist import ParallelContext
from distzo.job.evaluation import evaluate_choices, evaluate_lm
from distzo.models.tiny import byte_tokenizer
from distzo.objectives import answer_text, exact_match, f1_score
from distzo.zo.noise import noise_seed
from tests.helpers.models import tiny_opt
from tests.helpers.rows import write_jsonl

KNOWN = {
    "sst2": (
        {"sentence": " a gripping film ", "label": 1},
        "a gripping film It was",
        (" terrible", " great"),
        1,
    ),
    "rte": (
        {"premise": "Cats purr.", "hypothesis": "Cats make sounds.", "label": 0},
        'Cats purr.\nDoes this mean that "Cats make sounds." is true? Yes or No?\n',
        ("Yes", "No"),
        0,
    ),
    "cb": (
        {"premise": "It rained.", "hypothesis": "The ground is wet.", "label": 2},
        'Suppose It rained. Can we infer that "The ground is wet."? Yes, No, or Maybe?\n',
        ("Yes", "No", "Maybe"),
        2,
    ),
    "boolq": (
        {"passage": "Water boils at 100 C.", "question": "does water boil at 100 c", "label": True},
        "Water boils at 100 C. Does water boil at 100 c?\n",
        ("No", "Yes"),
        1,
    ),
    "wic": (
        {"word": "bank", "sentence1": "A river bank.", "sentence2": "A bank loan.", "label": 0},
        'Does the word "bank" have the same meaning in these two sentences? Yes, No?\nA river '
        "bank.\nA bank loan.\n",
        ("No", "Yes"),
        0,
    ),
    "copa": (
        {
            "premise": "The man fell.",
            "question": "cause",
            "choice1": "He tripped.",
            "choice2": "I laughed.",
            "label": 0,
        },
        "The man fell because ",
        ("he tripped.", "I laughed."),
        0,
    ),
    "multirc": (
        {"paragraph": "Tom has a dog.", "question": "What pet?", "answer": "A dog", "label": 1},
        'Tom has a dog.\nQuestion: What pet?\nI found this answer "A dog". Is that correct? Yes or '
        "No?\n",
        ("No", "Yes"),
        1,
    ),
    "wsc": (
        {
            "text": "Mark told Pete many lies about himself.",
            "span1_index": 0,
            "span2_index": 6,
            "span1_text": "Mark",
            "span2_text": "Himself",
            "label": 1,
        },
        "Mark told Pete many lies about himself.\nIn the previous sentence, does the pronoun "
        '"himself" refer to Mark? Yes or No?\n',
        ("No", "Yes"),
        1,
    ),
    "record": (
        {
            "passage": "Tom met Ann in Rome.\n@highlight\nA trip\n@highlight\nA visit",
            "query": "@placeholder flew home from Rome.",
            "entities": ["Tom", "Ann", "Rome"],
            "answers": ["Ann"],
        },
        "Tom met Ann in Rome.\n- A trip\n- A visit\n-",
        (" Tom flew home from Rome.", " Ann flew home from Rome.", " Rome flew home from Rome."),
        1,
    ),
    "drop": (
        {
            "passage": "Tom scored 2 goals.",
            "question": " How many goals? ",
            "answers_spans": {"spans": ["2", "two"], "types": ["number", "number"]},
        },
        "Passage: Tom scored 2 goals.\nQuestion: How many goals?\nAnswer:",
        (" 2\n",),
        0,
    ),
    "squad": (
        {
            "title": "Pets",
            "context": "Tom has a dog.",
            "question": " What pet? ",
            "answers": {"text": ["a dog", "dog"]},
        },
        "Title: Pets\nContext: Tom has a dog.\nQuestion: What pet?\nAnswer:",
        (" a dog\n",),
        0,
    ),
}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_each_template_renders_the_known_example(name):
    row, prompt, continuations, label = KNOWN[name]
    (example,) = build_examples(TASKS[name], [row], "known.jsonl")
    assert example.prompt == prompt
    assert example.continuations == continuations
    assert example.label == label


def test_squad_keeps_every_gold_answer():
    (example,) = build_examples(TASKS["squad"], [KNOWN["squad"][0]], "x")
    assert example.answers == ("a dog", "dog")


def test_a_tasks_rows_share_its_candidates_and_hold_no_dict():
    """Every rank holds every row: each row's own copy of a verbalizer's words, and each
    Example's __dict__, were 210 of an SST-2 row's 450 bytes. COPA's choices, a row's own,
    are not kept past their row."""
    rows = [KNOWN["sst2"][0], {"sentence": "a dull film", "label": 0}]
    first, second = build_examples(TASKS["sst2"], rows, "x")
    assert first.continuations is second.continuations
    assert not hasattr(first, "__dict__")
    kept = templates._candidates.cache_info().currsize
    copa = KNOWN["copa"][0]
    build_examples(TASKS["copa"], [copa, {**copa, "choice1": "He slipped."}], "x")
    assert templates._candidates.cache_info().currsize == kept


def test_the_rows_digest_of_every_tasks_examples_is_the_one_logged_runs_hold():
    """Runs logged before compare this digest on resume: how an Example is held must not
    change it (the value is the one the code before ``slots`` gave, but boolq's prompt,
    MeZO's BoolQTemplateV3 since: its runs logged before are refused as other rows)."""
    examples = [
        e for name in sorted(TASKS) for e in build_examples(TASKS[name], [KNOWN[name][0]], "k")
    ]
    assert rows_digest(examples) == "c2e3908af1f898d9"


@pytest.mark.parametrize(
    "name, row, message",
    [
        (
            "rte",
            {"premise": "p", "label": 0},
            "row 1: missing column 'hypothesis' \\(task rte needs premise, hypothesis, label\\)",
        ),
        ("sst2", {"sentence": "s", "label": 5}, "row 1: label 5 is outside 0..1"),
        # one past the last class: the first index without a candidate
        ("cb", {"premise": "p", "hypothesis": "h", "label": 3}, "row 1: label 3 is outside 0..2"),
        ("sst2", {"sentence": "s", "label": -1}, "row 1: label -1 marks a row with no label"),
        ("sst2", {"sentence": "s", "label": "pos"}, "row 1: label 'pos' is not an integer"),
        (
            "copa",
            {"premise": "p", "question": "why", "choice1": "a", "choice2": "b", "label": 0},
            "row 1: question 'why' must be cause or effect",
        ),
        (
            "squad",
            {"title": "t", "context": "c", "question": "q", "answers": []},
            "row 1: answers must be a non-empty list",
        ),
        (  # was "candidate '' has no tokens to score", named by neither file nor row
            "copa",
            {"premise": "p", "question": "cause", "choice1": "a", "choice2": " ", "label": 0},
            "row 1: choice2 is empty; write the choice's text",
        ),
        (  # was accepted: the two scored alike, the row's "prediction" was the tie's pick
            "copa",
            {
                "premise": "p",
                "question": "cause",
                "choice1": "It rained",
                "choice2": "it rained",
                "label": 0,
            },
            "row 1: choice1 and choice2 are the same text \\('It rained'\\); a row needs two",
        ),
        (  # was trained on " \n", and any answer of articles matched it exactly
            "squad",
            {"title": "t", "context": "c", "question": "q", "answers": ["c", ""]},
            "row 1: answers \\['c', ''\\] hold an empty one; remove it",
        ),
    ],
)
def test_malformed_rows_name_the_file_and_row(name, row, message):
    with pytest.raises(ValueError, match="data.jsonl, " + message) as info:
        build_examples(TASKS[name], [row], "data.jsonl")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "name, names",
    [
        ("sst2", ["negative", "Positive"]),
        ("rte", ["entailment", "not_entailment"]),
        ("rte", ["Entailment", "not entailment"]),
        ("cb", ["entailment", "contradiction", " neutral"]),
    ],
)
def test_labels_written_as_their_names_read_as_their_index(name, names):
    """SuperGLUE's RTE and CB files and GLUE's RTE TSV write "not_entailment", not 1."""
    columns = [c for c in TASKS[name].columns if c != "label"]
    rows = [dict({c: "x" for c in columns}, label=label) for label in names]
    assert [e.label for e in build_examples(TASKS[name], rows, "x")] == list(range(len(names)))


def test_a_label_name_of_no_class_lists_the_names():
    row = {"premise": "p", "hypothesis": "h", "label": "maybe"}
    with pytest.raises(ValueError) as info:
        build_examples(TASKS["cb"], [row], "cb.jsonl")
    assert str(info.value) == (
        "cb.jsonl, row 1: label 'maybe' is not an integer; write one of 0..2 or a name: "
        "entailment, contradiction, neutral"
    )


ROWS = [{"sentence": "good", "label": 1}, {"sentence": "bad, really", "label": 0}]


def write(path, fmt):
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif fmt == "json":
        path.write_text(json.dumps(ROWS))
    elif fmt in ("csv", "tsv"):
        with path.open("w", newline="") as fh:
            writer = csv.DictWriter(
                fh, ["sentence", "label"], delimiter="\t" if fmt == "tsv" else ","
            )
            writer.writeheader()
            writer.writerows(ROWS)
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(ROWS), path)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "tsv", "parquet"])
def test_every_local_format_loads_the_same_examples(tmp_path, fmt):
    path = tmp_path / f"data.{fmt}"
    write(path, fmt)
    loaded = load_task_rows("sst2", str(path), str(path))
    assert [(e.prompt, e.label) for e in loaded.train] == [
        ("good It was", 1),
        ("bad, really It was", 0),
    ]


def test_text_files_give_one_row_per_line(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("first line\n\nsecond line\n")
    assert load_rows(str(path)) == [{"text": "first line"}, {"text": "second line"}]
    assert load_task_rows("text", str(path), str(path)).train == ["first line", "second line"]


def test_lines_end_at_newlines_only_and_a_byte_order_mark_is_skipped(tmp_path):
    odd = "a\u2028b\x85c\x0cd"  # str.splitlines would cut at each of these
    jsonl = tmp_path / "data.jsonl"
    row = json.dumps({"sentence": odd, "label": 1}, ensure_ascii=False)
    jsonl.write_bytes(("\ufeff" + row + "\r\n" + row + "\n").encode())
    assert load_rows(str(jsonl)) == [{"sentence": odd, "label": 1}] * 2
    text = tmp_path / "corpus.txt"
    text.write_bytes(f"\ufeff{odd}\r\nsecond\n".encode())
    assert load_rows(str(text)) == [{"text": odd}, {"text": "second"}]
    table = tmp_path / "data.csv"
    table.write_bytes("\ufeffsentence,label\ngood,1\n".encode())
    assert load_rows(str(table)) == [{"sentence": "good", "label": "1"}]


def test_a_tsv_is_read_as_glue_writes_it_quotes_and_all(tmp_path):
    sentences = ['" the film is a mess', 'a "gripping" film', "plain", 'ends with "']
    path = tmp_path / "train.tsv"
    path.write_text(
        "sentence\tlabel\n" + "".join(f"{s}\t{i % 2}\n" for i, s in enumerate(sentences))
    )
    assert load_rows(str(path)) == [
        {"sentence": s, "label": str(i % 2)} for i, s in enumerate(sentences)
    ]


@pytest.mark.parametrize(
    "content, suffix, message",
    [
        ('{"sentence": "a", "label": 1}\n{broken\n', "jsonl", "data.jsonl, row 2: not valid JSON"),
        ("[1, 2]", "json", "expected a JSON list of objects"),
        # CR-only endings (classic Mac OS): the file is one line, named with the fix
        (
            '{"sentence": "a", "label": 1}\r{"sentence": "b", "label": 0}\r',
            "jsonl",
            "row 1: "
            r"not valid JSON \(Extra data\); its lines end in a carriage return alone .* tr ",
        ),
        (
            '{"sentence": "a", "label": 1}\r{"sentence": "b", "label": 0}\r',
            "json",
            "data.json, row 1: .*carriage return alone",
        ),
        ("sentence,label\na,1,extra\n", "csv", "data.csv, row 1: wrong number of fields"),
        ("x", "xml", "unsupported format .xml"),
        ("not parquet", "parquet", "not a readable parquet file"),
    ],
)
def test_malformed_files_are_one_line_errors(tmp_path, content, suffix, message):
    path = tmp_path / f"data.{suffix}"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        load_task_rows("sst2", str(path), str(path))
    assert "\n" not in str(info.value)


def test_a_pyarrow_that_cannot_be_imported_is_one_line(tmp_path, monkeypatch):
    """pip gives numpy 1.x (our floor) pyarrow 26, which needs numpy 2 and fails at
    import: a parquet file's load was that ImportError's traceback."""
    fake = tmp_path / "site" / "pyarrow"
    fake.mkdir(parents=True)
    broken = "pyarrow requires NumPy 2.0 or newer, found 1.24.4"
    (fake / "__init__.py").write_text(f"raise ImportError({broken!r})\n")
    for name in [m for m in sys.modules if m == "pyarrow" or m.startswith("pyarrow.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(fake.parent))
    path = tmp_path / "data.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(ValueError) as info:
        load_rows(str(path))
    assert str(info.value) == (
        f"{path}: pyarrow cannot be imported ({broken}); install one that works with this "
        "numpy (pyarrow 26 and later need numpy 2: pip install 'pyarrow<26', or 'numpy>=2')"
    )


def test_missing_files_and_hub_specs():
    with pytest.raises(ValueError, match="does not exist"):
        load_rows("/no/such/file.jsonl")
    with pytest.raises(ValueError, match="^data file /dev/null is not a regular file"):
        load_rows("/dev/null")  # it exists: "does not exist" sent the user looking for it
    assert parse_hub_spec("hf:nyu-mll/glue:sst2:train") == ("nyu-mll/glue", "sst2", "train")
    assert parse_hub_spec("hf:imdb:test") == ("imdb", None, "test")
    with pytest.raises(ValueError, match="hf:PATH"):
        parse_hub_spec("hf:only")
    with pytest.raises(ValueError, match="give --train-file and --eval-file"):
        load_task_rows("sst2", None, None)
    with pytest.raises(ValueError, match="unknown --task 'stsb'"):
        load_task_rows("stsb", "a", "b")


def test_training_labels_cover_the_answer_tokens_only():
    tokenizer = byte_tokenizer()
    encoder = PromptEncoder(tokenizer, max_length=64)
    ids, answer = encoder.encode("It was", " great")
    batch = encoder.collate([(ids, answer), encoder.encode("Hm", " bad")])
    labels = batch["labels"][0]
    kept = labels[labels != -100].tolist()
    assert tokenizer.decode(kept) == " great"
    assert batch["attention_mask"][1].sum() == len(encoder.encode("Hm", " bad")[0])
    # a long prompt loses tokens from the left, never the answer
    ids, answer = PromptEncoder(tokenizer, max_length=8).encode("a very long prompt indeed", " yes")
    assert len(ids) == 8 and tokenizer.decode(ids[-answer:]) == " yes"


def test_the_counting_task_draws_by_step_and_evaluates_on_a_stream_of_its_own():
    """The generated task: a window that exactly fits the vocabulary is allowed; a batch
    asked without a step is the step after the last drawn (each call a new batch); the
    evaluation set is no training step's batch, and is scored on every token."""
    from distzo.data import CountingTask

    with pytest.raises(ValueError, match=r"counting window \[16, 32\) does not fit"):
        CountingTask(31)
    task = CountingTask(32, seed=3)
    drawn = [task.batch(8)["input_ids"] for _ in range(3)]
    assert all(torch.equal(d, task.batch(8, step)["input_ids"]) for step, d in enumerate(drawn))
    assert not torch.equal(drawn[0], drawn[1])
    task.batch(8, 7)
    assert torch.equal(task.batch(8)["input_ids"], task.batch(8, 8)["input_ids"])
    evals = task.eval_set(8)
    assert torch.equal(evals["labels"], evals["input_ids"])
    assert not any(torch.equal(evals["input_ids"], d) for d in drawn)


def test_step_batches_are_a_pure_function_of_the_step():
    assert step_indices(10, 4, 3, seed=1) == step_indices(10, 4, 3, seed=1)
    epoch = [i for step in range(5) for i in step_indices(10, 2, step, seed=1)]
    assert sorted(epoch) == list(range(10))  # one epoch covers every item once


def test_an_empty_training_set_has_no_batch_in_one_line():
    with pytest.raises(ValueError, match="the training set is empty"):
        step_indices(0, 4, 0, seed=1)


def test_each_epoch_draws_its_own_order():
    """Epochs are permutations seeded by (seed, epoch), as MeZO reshuffles each one: a
    second epoch covers every item again in another order, not the first one's."""
    epochs = [
        [i for step in range(5) for i in step_indices(10, 2, step + 5 * e, 1)] for e in (0, 1)
    ]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(10))
    assert epochs[0] != epochs[1]


def test_an_epoch_draws_its_permutation_once(monkeypatch):
    """A step reads its batch off its epoch's permutation: drawing one per position of the
    batch cost B draws linear in the rows each step (6 s a step on ten million rows), and
    the positions are those of the per-position draw, so the batches stay the same."""
    expected = [
        int(
            torch.randperm(7, generator=torch.Generator().manual_seed(noise_seed(3, p // 7, 1, 0)))[
                p % 7
            ]
        )
        for p in range(30)
    ]
    draws = []
    randperm = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: draws.append(a) or randperm(*a, **k))
    epoch_order.cache_clear()
    taken = [i for step in range(10) for i in step_indices(7, 3, step, seed=3)]
    assert taken == expected  # a batch spanning an epoch's end included
    assert len(draws) == 5  # epochs 0 to 4, once each


def test_a_text_evaluation_set_is_padded_a_call_at_a_time():
    """The text task's evaluation set is not one tensor of every row padded to the longest
    (24 bytes a position: 6 GB per rank for a million-row --eval-file): each call collates
    its rows to that width, the tensors it took from the padded set, so the metrics stay."""
    tokenizer = byte_tokenizer()
    encoder = PromptEncoder(tokenizer, max_length=12)
    texts = ["a", "a fine film", "slow", "much too long for the limit here", "ok then"]
    data = TextData(LoadedRows("text", ["some text"], texts), encoder, 0, 2)
    padded = encoder.collate([(ids, len(ids)) for ids, _ in map(encoder.encode_text, texts)])
    held = data.eval_set if isinstance(data.eval_set, dict) else vars(data.eval_set)
    assert not any(isinstance(v, torch.Tensor) for v in held.values())
    for indices in ([0], [3, 1], [4, 4, 2]):
        taken = data.eval_set.take(indices)
        assert all(torch.equal(taken[k], v[indices]) for k, v in padded.items())
    assert data.longest == padded["input_ids"].shape[1] == 12
    engine = ZOEngine(tiny_opt(seed=3, vocab_size=len(tokenizer)), ZOConfig(device="cpu", seed=0))
    single = ParallelContext.single()
    assert evaluate_lm(engine, data.eval_set, single, 2) == evaluate_lm(engine, padded, single, 2)


def test_choice_evaluation_matches_a_plain_per_candidate_loop():
    tokenizer = byte_tokenizer()
    model = tiny_opt(seed=3, vocab_size=len(tokenizer), max_position_embeddings=256)
    reference = tiny_opt(seed=3, vocab_size=len(tokenizer), max_position_embeddings=256).eval()
    rows = [
        {"premise": f"Fact {i}.", "hypothesis": f"Claim {i % 3}.", "label": i % 2} for i in range(7)
    ]
    examples = build_examples(TASKS["rte"], rows, "x")
    encoder = PromptEncoder(tokenizer, max_length=256)
    engine = ZOEngine(model, ZOConfig(device="cpu", seed=0))
    got = evaluate_choices(engine, examples, encoder, ParallelContext.single(), batch_size=3)

    correct = 0
    with torch.no_grad():
        for e in examples:
            scores = []
            for continuation in e.continuations:
                prompt = tokenizer(e.prompt)["input_ids"]
                answer = tokenizer(continuation, add_special_tokens=False)["input_ids"]
                ids = torch.tensor([prompt + answer])
                log_probs = torch.log_softmax(reference(input_ids=ids).logits[0, :-1].float(), -1)
                targets = ids[0, 1:]
                picked = log_probs[torch.arange(len(targets)), targets][-len(answer) :]
                scores.append(picked.mean().item())
            correct += int(max(range(len(scores)), key=scores.__getitem__) == e.label)
    assert got["eval_accuracy"] == pytest.approx(correct / len(examples))


def test_squad_metrics():
    assert exact_match("The Dog!", "dog") == 1.0
    assert f1_score("a big dog", "the dog") == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    assert f1_score("cat", "dog") == 0.0
    # SQuAD v1.1's script and MeZO: nothing in common is 0, also when both normalise to
    # nothing; exact match still counts them equal
    assert f1_score("", "the") == f1_score("a", "The.") == 0.0
    assert exact_match("a", "The.") == 1.0
    assert exact_match("An apple", "apple") == 1.0  # "an" is an article too
    # tokens in common count as often as both sides hold them: 2 of 2 and 2 of 3
    assert f1_score("cat cat", "cat cat dog") == pytest.approx(2 * 1.0 * (2 / 3) / (1 + 2 / 3))


def test_an_answer_ends_at_the_first_newline_even_a_leading_one():
    """MeZO stops decoding at the newline token, so a generation that begins with one
    answers nothing, whatever follows it."""
    text = {(1,): " \nParis\n", (2,): "Paris \nLyon"}
    assert answer_text(lambda ids: text[tuple(ids)], [1]) == ""
    assert answer_text(lambda ids: text[tuple(ids)], [2]) == "Paris"


def test_prompt_tasks_train_and_evaluate_through_the_cli(tmp_path):
    from tests.helpers.launch import python_train, torchrun

    sst = [{"sentence": f"review number {i}", "label": i % 2} for i in range(20)]
    train, evaluation = (
        write_jsonl(tmp_path / "train.jsonl", sst),
        write_jsonl(tmp_path / "eval.jsonl", sst[:7]),
    )
    out = tmp_path / "sst2"
    proc = torchrun(
        2,
        [
            "--task",
            "sst2",
            "--train-file",
            train,
            "--eval-file",
            evaluation,
            "--max-steps",
            "6",
            "--batch-size",
            "4",
            "--eval-batch-size",
            "4",
            "--output-dir",
            str(out),
        ],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 6] and all(0 <= e["eval_accuracy"] <= 1 for e in evals)
    # 7 examples over 2 ranks: accuracy is a multiple of 1/7, so no example was dropped or doubled
    assert all(abs(e["eval_accuracy"] * 7 - round(e["eval_accuracy"] * 7)) < 1e-9 for e in evals)
    assert (out / "export" / "tokenizer.json").exists()

    squad = [
        {
            "title": "T",
            "context": f"The code is {i}.",
            "question": "What is the code?",
            "answers": [str(i)],
        }
        for i in range(6)
    ]
    train, evaluation = (
        write_jsonl(tmp_path / "sq.jsonl", squad),
        write_jsonl(tmp_path / "sq_eval.jsonl", squad[:3]),
    )
    proc = python_train(
        [
            "--task",
            "squad",
            "--train-file",
            train,
            "--eval-file",
            evaluation,
            "--max-steps",
            "2",
            "--batch-size",
            "2",
            "--max-new-tokens",
            "3",
            "--output-dir",
            str(tmp_path / "squad"),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads((tmp_path / "squad" / "eval.jsonl").read_text().splitlines()[-1])
    assert {"eval_f1", "eval_exact_match"} <= last.keys()

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"line {i} of text" for i in range(10)))
    proc = python_train(
        [
            "--task",
            "text",
            "--train-file",
            str(corpus),
            "--eval-file",
            str(corpus),
            "--max-steps",
            "2",
            "--batch-size",
            "2",
            "--output-dir",
            str(tmp_path / "text"),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("task", ["sst2", "text"])
def test_a_file_without_rows_is_named_before_any_model(tmp_path, task):
    """An empty file (or one of blank lines) is refused when read, whichever of the two it
    is: an empty training set stopped the run at its first step, after the model's build."""
    row = {"sentence": "a film", "label": 1, "text": "a film"}
    full, empty = tmp_path / "full.jsonl", tmp_path / "empty.jsonl"
    full.write_text(json.dumps(row) + "\n")
    empty.write_text("\n\n")
    for train, evals in ((empty, full), (full, empty)):
        with pytest.raises(ValueError, match=f"^{empty}: no rows$"):
            load_task_rows(task, str(train), str(evals))


def test_a_generated_task_refuses_either_data_file():
    for files in (("t.jsonl", None), (None, "e.jsonl")):
        with pytest.raises(ValueError, match="--task counting generates its data"):
            load_task_rows("counting", *files)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--task", "sst2"],
            "error: --task sst2 reads its data: give --train-file and --eval-file",
        ),
        (
            ["--task", "sst2", "--train-file", "rows.tsv"],
            "error: --task sst2 reads its data: give --eval-file",
        ),
        (
            ["--task", "counting", "--train-file", "x.jsonl"],
            "error: --task counting generates its data",
        ),
        (["--task", "stsb"], "error: unknown --task 'stsb'"),
        (
            ["--peft", "prefix", "--prefix-length", "50"],
            "error: --seq-len 16 exceeds the model's max_position_embeddings 64 less the "
            "50-token prefix; lower --seq-len",
        ),
    ],
)
def test_task_input_errors_are_one_line_before_any_model(args, message):
    from tests.helpers.launch import train_in_process

    proc = train_in_process(args)
    assert proc.returncode == 2 and proc.stderr.strip().startswith(message), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_malformed_row_stops_the_cli_with_file_and_row(tmp_path):
    from tests.helpers.launch import train_in_process

    bad = write_jsonl(
        tmp_path / "bad.jsonl", [{"sentence": "ok", "label": 1}, {"sentence": "no label"}]
    )
    proc = train_in_process(["--task", "sst2", "--train-file", bad, "--eval-file", bad])
    assert proc.returncode == 2
    # the row has no other column to read as its label: the fix is the data's
    assert proc.stderr.strip() == (
        f"error: {bad}, row 2: missing column 'label' (task sst2 needs sentence, label); "
        "give every row its 'label'"
    )


def test_a_prefix_adapters_virtual_tokens_leave_room_in_the_models_positions(tmp_path):
    from distzo.config.job import JobConfig
    from distzo.job.build import build_task_data, default_model_config
    from tests.helpers.launch import train_in_process

    rows = [{"sentence": "a long review " * 60, "label": 1}, {"sentence": "short", "label": 0}]
    data = write_jsonl(tmp_path / "long.jsonl", rows)
    job = JobConfig()
    job.data.task, job.peft.peft = "sst2", "prefix"
    loaded = load_task_rows("sst2", data, data)
    built = build_task_data(job, loaded, byte_tokenizer(), default_model_config("sst2"), 0)
    assert built.encoder.max_length == 512 - 5 and built.longest == 507  # the long row, cut
    proc = train_in_process(
        ["--task", "sst2", "--train-file", data, "--eval-file", data, "--peft", "prefix"]
        + ["--max-length", "512", "--output-dir", str(tmp_path / "run")]
    )
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: --max-length 512 exceeds the model's max_position_embeddings 512 less the "
        "5-token prefix; lower --max-length"
    )
    assert not (tmp_path / "run").exists()


def test_answer_room_past_the_positions_is_refused_before_any_decoding(tmp_path):
    """A prompt to decode from keeps its leading </s> and one token: 32 positions leave
    room for 30 new tokens, and 31 would have run off the model's positions mid-run."""
    from distzo.data.task_data import PromptData
    from distzo.job.evaluation import evaluate_generation

    row = {"title": "T", "context": "a long context " * 5, "question": "Q?", "answers": ["x"]}
    data = write_jsonl(tmp_path / "squad.jsonl", [row, row])
    loaded = load_task_rows("squad", data, data)
    encoder = PromptEncoder(byte_tokenizer(), max_length=32)
    with pytest.raises(
        ValueError, match="--max-new-tokens 31 leaves no room .* give --max-new-tokens 30 or less"
    ):
        PromptData(loaded, encoder, seed=0, eval_batch_size=2, max_new_tokens=31)
    PromptData(loaded, encoder, seed=0, eval_batch_size=2, max_new_tokens=30)
    assert len(encoder.encode_prompt(loaded.eval[0].prompt, 30)) == 2
    model = tiny_opt(seed=3, vocab_size=len(encoder.tokenizer), max_position_embeddings=32)
    engine = ZOEngine(model, ZOConfig(device="cpu", seed=0))
    metrics = evaluate_generation(engine, loaded.eval, encoder, ParallelContext.single(), 2, 30)
    assert set(metrics) == {"eval_f1", "eval_exact_match"}


def test_a_text_evaluation_file_with_no_token_to_predict_is_a_clear_error(tmp_path):
    """Empty rows (or one-token rows) leave the metrics nothing to average over: the
    evaluation divided by zero after the model was built."""
    from distzo.data.task_data import TextData

    train = write_jsonl(tmp_path / "train.jsonl", [{"text": "some words"}])
    empty = write_jsonl(tmp_path / "eval.jsonl", [{"text": ""}, {"text": ""}])
    encoder = PromptEncoder(byte_tokenizer(), max_length=32)
    with pytest.raises(ValueError, match="--eval-file: no row has a next token to predict"):
        TextData(load_task_rows("text", train, empty), encoder, seed=0, eval_batch_size=2)


def test_a_model_folder_without_tokenizer_files_has_no_tokenizer(tmp_path):
    """transformers builds an OPT folder's tokenizer class with an empty vocabulary when the
    folder holds no tokenizer files: a prompt task is the documented input error, and a
    counting run's export or replay carries no empty tokenizer beside the weights."""
    from distzo.config.job import resolve
    from distzo.job.build import load_tokenizer, source_tokenizer

    tiny_opt().save_pretrained(tmp_path)  # config.json and the weights, no tokenizer files
    assert source_tokenizer(tmp_path) is None
    job = resolve(["--model", str(tmp_path), "--task", "sst2", "--train-file", "t.tsv"])
    with pytest.raises(ValueError, match="no tokenizer to read the task's text"):
        load_tokenizer(job, tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    assert source_tokenizer(tmp_path) is not None


@pytest.mark.parametrize(
    "name, row, message",
    [
        ("sst2", {"sentence": "s", "label": 1.5}, "label 1.5 is not an integer; write one of 0..1"),
        ("sst2", {"sentence": "s", "label": float("inf")}, "label inf is not an integer"),
        ("sst2", {"sentence": 5, "label": 1}, "column 'sentence' holds 5 \\(int\\), not text"),
        (
            "rte",
            {"premise": ["a", "b"], "hypothesis": "h", "label": 0},
            "column 'premise' holds \\['a', 'b'\\] \\(list\\), not text",
        ),
        (
            "squad",
            {"title": "t", "context": "c", "question": "q", "answers": "['a dog']"},
            "answers \"\\['a dog'\\]\" is a list written as text but not as JSON",
        ),
    ],
)
def test_values_a_template_would_misread_are_one_line_errors(name, row, message):
    """int(1.5) is 1 and f"{['a', 'b']}" a prompt of its repr: refused, not trained on."""
    with pytest.raises(ValueError, match="data.jsonl, row 1: " + message) as info:
        build_examples(TASKS[name], [row], "data.jsonl")
    assert "\n" not in str(info.value)


def test_squad_answers_written_as_json_in_a_csv_cell_are_a_list(tmp_path):
    path = tmp_path / "squad.csv"
    path.write_text('title,context,question,answers\nT,C,Q,"[""a dog"", ""dog""]"\n')
    (example,) = load_task_rows("squad", str(path), str(path)).train
    assert example.answers == ("a dog", "dog")
    assert example.continuations == (" a dog\n",)


@pytest.mark.parametrize(
    "name, content",
    [
        ("data.jsonl", '\n\n{"sentence": "a", "label": 0}\n{"sentence": "b", "label": 7}\n'),
        ("data.csv", 'sentence,label\n"a\nb",0\n\nc,7\n'),
    ],
)
def test_row_numbers_are_the_files_own_across_blank_lines(tmp_path, name, content):
    """The loader names a JSONL row by its line (a CSV's by its line less the header);
    a template's error must use the same number, not the index among non-blank rows."""
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=f"{name}, row 4: label 7 is outside"):
        load_task_rows("sst2", str(path), str(path))


@pytest.mark.parametrize("before, row", [("ok,1\n", 2), ("ok,1\n\n\n", 4), ('"a\nb",1\n', 3)])
def test_a_csv_row_the_reader_fails_on_is_numbered_as_a_row_it_reads(tmp_path, before, row):
    """The csv reader's line count stops short of a row it fails on (after blank lines it
    named row 1 for row 4's oversized field): the row is the next non-blank line."""
    path = tmp_path / "big.csv"
    path.write_text("sentence,label\n" + before + "x" * 200_000 + ",1\n")
    with pytest.raises(ValueError, match=f"big.csv, row {row}: a field is larger"):
        load_rows(str(path))


@pytest.mark.parametrize(
    ("name", "header"),
    [("data.csv", "sentence,label,sentence"), ("data.tsv", "sentence\tlabel\tsentence")],
)
def test_a_header_naming_a_column_twice_is_refused(tmp_path, name, header):
    """The csv reader keeps the last of two same-named columns: the first column's text
    was dropped without a word (pandas, datasets' reader, names the second sentence.1)."""
    path = tmp_path / name
    sep = "\t" if name.endswith(".tsv") else ","
    path.write_text(header + "\n" + sep.join(["good", "1", "ignored"]) + "\n")
    with pytest.raises(ValueError) as err:
        load_rows(str(path))
    assert str(err.value) == (
        f"{path}: the header names column 'sentence' twice; give each column its own name"
    )


def test_a_json_lists_non_utf8_byte_is_named_by_its_line(tmp_path):
    """A JSON list's rows are numbered by their place in the list, not by line: the byte
    in the second row of an indented list was named "row 7", its line."""
    path = tmp_path / "data.json"
    text = json.dumps([ROWS[0], {"sentence": "XX", "label": 0}], indent=2)
    path.write_bytes(text.encode().replace(b"XX", b"\xff"))
    with pytest.raises(ValueError) as err:
        load_rows(str(path))
    assert str(err.value) == f"{path}, line 7: not UTF-8 (byte 0xff); save the file as UTF-8"


@pytest.mark.parametrize("name", ["data.csv", "data.tsv"])
def test_blank_lines_before_the_header_are_skipped_as_pandas_skips_them(tmp_path, name):
    """The csv reader took the first line, blank, for the header: every row was refused as
    'row 1: wrong number of fields for the header []'. A row is its line less one, as after
    blank lines between rows."""
    path = tmp_path / name
    sep = "\t" if name.endswith(".tsv") else ","
    path.write_text(f"\n\r\nsentence{sep}label\ngood{sep}1\n\nbad{sep}0\n")
    assert load_numbered_rows(str(path)) == [
        (3, {"sentence": "good", "label": "1"}),
        (5, {"sentence": "bad", "label": "0"}),
    ]
    path.write_text(f"\n\nsentence{sep}label\ngood\n")
    with pytest.raises(ValueError, match=f"{name}, row 3: wrong number of fields"):
        load_rows(str(path))


def test_a_json_file_of_json_lines_loads_as_datasets_reads_it(tmp_path):
    """datasets' Dataset.to_json writes JSON Lines by default, to a .json name."""
    path = tmp_path / "data.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert load_rows(str(path)) == ROWS
    path.write_text(json.dumps(ROWS[0]) + "\n{broken\n")
    with pytest.raises(ValueError, match="data.json, row 2: not valid JSON"):
        load_rows(str(path))


def test_a_folder_and_empty_hub_names_are_one_line_errors(tmp_path):
    folder = tmp_path / "saved.jsonl"
    folder.mkdir()
    with pytest.raises(ValueError, match="saved.jsonl is a folder; give a data file"):
        load_rows(str(folder))
    for spec in ("hf::train", "hf:glue:sst2:", "hf:glue::train"):
        with pytest.raises(ValueError, match="hf:PATH"):
            parse_hub_spec(spec)


def test_text_training_rows_with_no_token_to_predict_are_left_out(tmp_path):
    """A batch drawn only from empty rows has no label token: the step raised mid-run,
    after the model was built; the rows add nothing to the loss, so they are left out."""
    from distzo.data.task_data import TextData

    rows = [{"text": ""}] * 6 + [{"text": "some words"}]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    encoder = PromptEncoder(byte_tokenizer(), max_length=32)
    data = TextData(load_task_rows("text", train, train), encoder, seed=0, eval_batch_size=2)
    assert all((data.batch(2, step)["labels"][:, 1:] != -100).any() for step in range(20))
    empty = write_jsonl(tmp_path / "empty.jsonl", [{"text": ""}])
    with pytest.raises(ValueError, match="--train-file: no row has a next token to predict"):
        TextData(load_task_rows("text", empty, train), encoder, seed=0, eval_batch_size=2)


def test_a_text_row_that_is_not_a_string_is_named_as_such(tmp_path):
    path = write_jsonl(tmp_path / "num.jsonl", [{"text": 5}])
    with pytest.raises(ValueError, match="row 1: column 'text' holds 5 \\(int\\), not text"):
        load_task_rows("text", path, path)


def test_a_csv_label_written_as_a_whole_float_is_read_as_datasets_reads_it(tmp_path):
    """pandas writes an int column holding a missing value as floats ("1.0"); datasets'
    csv loader reads 1.0 back, which is label 1; "1.5" stays refused."""
    path = tmp_path / "data.csv"
    path.write_text("sentence,label\ngood,1.0\nbad,0.0\n")
    assert [e.label for e in load_task_rows("sst2", str(path), str(path)).train] == [1, 0]
    path.write_text("sentence,label\ngood,1.5\n")
    with pytest.raises(ValueError, match="data.csv, row 1: label 1.5 is not an integer"):
        load_task_rows("sst2", str(path), str(path))


@pytest.mark.parametrize(
    "name, row, hint",
    [
        (
            "rte",
            {"sentence1": "p", "sentence2": "h", "label": 0},
            "missing column 'premise' .*; the file has 'sentence1', as GLUE's rte "
            r"\(nyu-mll/glue\) names it: read it as 'premise' with --columns "
            "premise=sentence1,hypothesis=sentence2$",
        ),
        (
            "boolq",
            {"passage": "p", "question": "q", "answer": True},
            "missing column 'label' .*; the file has 'answer', as google/boolq names it: read it "
            "as 'label' with --columns label=answer$",
        ),
    ],
)
def test_another_datasets_column_names_are_named_with_the_rename(name, row, hint):
    """GLUE's RTE rows (sentence1, sentence2) were refused for a missing 'premise' with no
    word that the file has it under another name."""
    with pytest.raises(ValueError, match="data.jsonl, row 1: " + hint):
        build_examples(TASKS[name], [row], "data.jsonl")


@pytest.mark.parametrize("suffix", [".jsonl", ".txt", ".csv"])
def test_an_unreadable_data_file_is_one_line(tmp_path, monkeypatch, suffix):
    """A file the user may not read raised PermissionError's traceback (the tests run as
    root, where chmod 000 still reads: the read is made to fail as it would)."""
    from pathlib import Path

    path = tmp_path / f"data{suffix}"
    path.write_text(json.dumps(ROWS[0]) + "\n")

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)
    monkeypatch.setattr(Path, "open", denied)  # JSONL and text files are read a line at a time
    with pytest.raises(
        ValueError, match=rf"data{suffix}: cannot read the file \(Permission denied"
    ):
        load_rows(str(path))


def test_the_default_text_models_generate_stops_at_the_byte_tokenizers_end_token():
    """The export's generation config (derived from the model's config) once stopped at
    id 2, the byte ``!``, and ran on past ``</s>``."""
    from transformers import GenerationConfig

    from distzo.job.build import default_model_config

    tokenizer = byte_tokenizer()
    generation = GenerationConfig.from_model_config(default_model_config("sst2"))
    assert generation.eos_token_id == tokenizer.eos_token_id == 1  # </s>
    assert generation.bos_token_id == tokenizer.bos_token_id
    assert generation.pad_token_id == tokenizer.pad_token_id == 0  # OPT's padding_idx: unchanged


def test_a_non_utf8_byte_in_a_csv_names_the_row_under_its_header(tmp_path):
    """A CSV's rows are numbered from the line after the header, as its other errors
    number them: line 3 is row 2."""
    bad = tmp_path / "bad.csv"
    bad.write_bytes(b"sentence,label\nok,1\n\xff bad,0\n")
    with pytest.raises(ValueError, match=r"bad.csv, row 2: not UTF-8 \(byte 0xff\)"):
        load_rows(str(bad))
    bad.write_bytes(b"sentence\xff,label\nok,1\n")
    with pytest.raises(ValueError, match=r"bad.csv, the header: not UTF-8"):
        load_rows(str(bad))


def test_a_missing_tokenizer_names_how_to_get_it_for_a_folder_and_a_hub_name(tmp_path):
    """A Llama folder without tokenizer files fails in transformers (no empty tokenizer as
    OPT's): the line said transformers' reason alone, no fix; a hub name's snapshot gets
    its files by a download (an ``hf download --include`` that left them out), not a copy."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from distzo.config.job import resolve
    from distzo.job.build import load_tokenizer
    from tests.helpers.models import LLAMA

    LlamaForCausalLM(LlamaConfig(**{**LLAMA, "num_hidden_layers": 1})).save_pretrained(tmp_path)
    for model, fix in (
        (str(tmp_path), "copy the model's tokenizer files into it"),
        ("org/tiny", "where the hub is reachable: hf download org/tiny"),
    ):
        job = resolve(["--model", model, "--task", "sst2", "--train-file", "t.tsv"])
        with pytest.raises(ValueError, match="no tokenizer to read the task's text") as err:
            load_tokenizer(job, tmp_path)
        assert str(err.value).endswith(fix), str(err.value)


@pytest.mark.parametrize("end", ["\n", "\r\n", "\r"])
@pytest.mark.parametrize("delimiter", [",", "\t"])
def test_a_csv_files_rows_and_numbers_are_the_same_whatever_its_line_ends(tmp_path, delimiter, end):
    """Every row read, numbered by its line less the header's, whichever line end an editor
    wrote and where the file stops at its last row's last character (no line end)."""
    path = tmp_path / ("data.csv" if delimiter == "," else "data.tsv")
    lines = ["sentence,label", "a,0", "", "b,1", "c,7"]
    path.write_bytes(end.join(line.replace(",", delimiter) for line in lines).encode())
    assert load_numbered_rows(str(path)) == [
        (1, {"sentence": "a", "label": "0"}),
        (3, {"sentence": "b", "label": "1"}),
        (4, {"sentence": "c", "label": "7"}),
    ]


def test_a_quoted_csv_field_broken_by_a_lone_carriage_return_keeps_the_rows_numbers(tmp_path):
    path = tmp_path / "data.csv"
    path.write_bytes(b'sentence,label\n"a\rb",0\nc,1\n')
    assert load_numbered_rows(str(path)) == [
        (1, {"sentence": "a\rb", "label": "0"}),
        (3, {"sentence": "c", "label": "1"}),
    ]


def test_a_parquet_tables_rows_are_numbered_from_one_as_a_json_lists_are(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"sentence": ["a", "b"], "label": [0, 7]}), path)
    with pytest.raises(ValueError, match=r"t\.parquet, row 2: label 7 is outside"):
        load_task_rows("sst2", str(path), str(path))
