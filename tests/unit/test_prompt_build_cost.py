"""A prompt task's build tokenizes each text once, batched, and keeps no encodings: on a
million SST-2 rows it made seven tokenizer calls a row (888 s) and kept every training
example's encodings (+3 GB), on every rank; the training steps kept an epoch's more."""

import dataclasses
import gc
import json
import tracemalloc

import pytest

from distzo.data.encoding import PromptEncoder
from distzo.data.loaders import iter_numbered_rows
from distzo.data.task_data import PromptData, TextData, load_task_rows
from distzo.data.templates import Example
from distzo.models.tiny import byte_tokenizer
from tests.unit.test_prompt_encoding import byte_level_bpe, sentencepiece_bpe


class CountingTokenizer:
    """A tokenizer that counts its calls and the texts they carry."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls, self.texts = tokenizer, 0, 0

    def __call__(self, text, **kwargs):
        self.calls += 1
        self.texts += len(text) if isinstance(text, list) else 1
        return self.tokenizer(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def sst2_data(tmp_path, rows: int, objective: str, tokenizer=None) -> PromptData:
    lines = [json.dumps({"sentence": f"film {i} was", "label": i % 2}) for i in range(rows)]
    for name in ("t.jsonl", "e.jsonl"):
        (tmp_path / name).write_text("\n".join(lines) + "\n")
    loaded = load_task_rows("sst2", str(tmp_path / "t.jsonl"), str(tmp_path / "e.jsonl"))
    assert loaded is not None
    encoder = PromptEncoder(tokenizer or byte_tokenizer(), 64)
    return PromptData(loaded, encoder, 0, 4, objective=objective)


def test_the_build_tokenizes_each_text_once_in_few_calls(tmp_path):
    counting = CountingTokenizer(byte_tokenizer())
    data = sst2_data(tmp_path, 3000, "classification", counting)
    # 3000 rows a file, each a prompt and two prompt + candidate texts (less the 2 calls
    # PromptEncoder makes to find the special tokens)
    assert counting.texts - 2 == 2 * 3000 * 3
    assert counting.calls - 2 <= 2 * 3
    assert data.rows_per_example == 2
    assert data.encoder._choices == {}  # nothing kept for the evaluation to reuse either


def test_an_epoch_of_training_batches_keeps_no_encodings(tmp_path):
    for objective in ("classification", "lm"):
        data = sst2_data(tmp_path, 400, objective)
        data.batch(4, 0)
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for step in range(100):  # an epoch
            data.batch(4, step)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert kept < 40_000, (objective, kept)  # an epoch's encodings held 160 kB


EXAMPLES = [
    Example("a gripping film It was", (" great", " terrible"), 1),
    Example("Cats purr.\nDoes this mean that it is true? Yes or No?\n", ("Yes", "No"), 0),
    Example("x" * 80, (" great", " terrible" * 20), 0),
    Example("It was", ("", " ok"), 1),
]


@pytest.mark.parametrize("make", [byte_tokenizer, byte_level_bpe, sentencepiece_bpe])
@pytest.mark.parametrize("max_length", [8, 64])
def test_batched_encodings_are_the_single_calls(make, max_length):
    encoder = PromptEncoder(make(), max_length)
    assert encoder.encode_many(EXAMPLES) == [
        encoder.encode(e.prompt, e.continuations[e.label]) for e in EXAMPLES
    ]
    assert encoder.encode_prompts([e.prompt for e in EXAMPLES], 3) == [
        encoder.encode_prompt(e.prompt, 3) for e in EXAMPLES
    ]
    usable = [e for e in EXAMPLES if "" not in e.continuations]
    assert encoder.choices_many(usable) == [encoder.encode_choices(e) for e in usable]
    for (head, joints), e in zip(encoder.joints(EXAMPLES), EXAMPLES):
        assert head == encoder._ids(e.prompt)  # the single calls ``encode`` makes
        assert joints == [encoder._joint(e.prompt, c) for c in e.continuations]


@pytest.mark.parametrize("task", ["sst2", "text"])
def test_loading_holds_no_copy_of_the_file(tmp_path, task):
    """A JSONL file was held as its bytes, its text, its lines and its dicts at once (a peak
    of twelve times the file on each rank); rows now come a line at a time, so the peak is
    little above what the loaded rows keep."""
    column = "sentence" if task == "sst2" else "text"
    rows = [json.dumps({column: f"row {i} " + "x" * 200, "label": i % 2}) for i in range(4000)]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(rows) + "\n")
    size = path.stat().st_size
    gc.collect()
    tracemalloc.start()
    loaded = load_task_rows(task, str(path), str(path))
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert loaded is not None and len(loaded.train) == 4000
    assert peak - kept < size, (peak - kept, size)  # the file whole was 3x its size above


def test_text_training_rows_rest_in_an_array(tmp_path):
    """The text task kept every training row as a Python list of ints: 8 bytes a token at
    best (36 for an id over 256), an epoch's worth on each rank; an array keeps 4."""
    lines = [f"row {i} " + "y" * 100 for i in range(2000)]
    (tmp_path / "t.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "e.txt").write_text("an evaluation row\n")
    loaded = load_task_rows("text", str(tmp_path / "t.txt"), str(tmp_path / "e.txt"))
    assert loaded is not None
    encoder = PromptEncoder(byte_tokenizer(), 64)
    gc.collect()
    tracemalloc.start()
    data = TextData(loaded, encoder, 0, 4)
    gc.collect()
    kept = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    tokens = 2000 * 64  # every row cut to the limit
    assert data.train.cut == 2000 and data.longest == 64
    assert kept < 5 * tokens, kept / tokens
    batch = data.batch(3, 0)
    assert batch["input_ids"].shape == (3, 64) and (batch["labels"] == batch["input_ids"]).all()


@pytest.mark.parametrize("suffix", [".tsv", ".csv"])
def test_loading_a_csv_holds_its_text_alone(tmp_path, suffix):
    """A CSV or TSV file's text went through a StringIO (4 bytes a character: four times an
    ASCII file) into a list of every row's dict, beside the Examples; its lines and rows now
    come one at a time, so the peak above the loaded rows is the file's text, once."""
    sep = "\t" if suffix == ".tsv" else ","
    lines = [f"row {i} " + "x" * 200 + f"{sep}{i % 2}" for i in range(4000)]
    path = tmp_path / f"t{suffix}"
    path.write_text(f"sentence{sep}label\n" + "\n".join(lines) + "\n")
    size = path.stat().st_size
    gc.collect()
    tracemalloc.start()
    loaded = load_task_rows("sst2", str(path), str(path))
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert loaded is not None and len(loaded.train) == 4000
    assert peak - kept < 2.5 * size, (peak - kept, size)  # the bytes and the text, at most


def test_loading_a_parquet_file_turns_a_batch_of_rows_into_dicts_at_a_time(tmp_path, monkeypatch):
    """A parquet table became a list of every row's dict (0.35 GB above a TSV's peak, a
    million SST-2 rows); its rows now come a batch of them at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from distzo.data import loaders

    monkeypatch.setattr(loaders, "PARQUET_BATCH", 100, raising=False)
    sentences = [f"row {i} " + "x" * 200 for i in range(4000)]
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"sentence": sentences, "label": [i % 2 for i in range(4000)]}), path)
    gc.collect()
    tracemalloc.start()
    loaded = load_task_rows("sst2", str(path), str(path))
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert loaded is not None
    assert [e.prompt.split()[1] for e in loaded.train] == [str(i) for i in range(4000)]
    assert peak - kept < kept / 4, (peak - kept, kept)


def test_a_hub_split_is_read_a_row_at_a_time(monkeypatch):
    """``list(load_dataset(...))`` made every row of a memory-mapped split a dict at once,
    beside the Examples (a peak of the whole split's dicts, on every rank)."""
    import datasets

    given = []

    class Split:
        def __iter__(self):
            for i in range(1000):
                given.append(i)
                yield {"sentence": f"row {i}", "label": i % 2}

    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: Split())
    rows = iter_numbered_rows("hf:org/sst2-like:train")
    assert next(rows) == (1, {"sentence": "row 0", "label": 0}) and given == [0]
    assert len(list(rows)) == 999


def test_rows_are_built_with_the_cycle_collector_paused(tmp_path, monkeypatch):
    """The collector's full passes over the Examples built so far were 60% of a million
    SST-2 rows' load (19.3 s, 7.5 s paused); it runs again after, a bad row's error too,
    and a caller who disabled it keeps it disabled."""
    from distzo.data import templates

    seen: list[bool] = []
    sst2 = templates.TASKS["sst2"]

    def recording(row):
        seen.append(gc.isenabled())
        return sst2.build(row)

    monkeypatch.setitem(templates.TASKS, "sst2", dataclasses.replace(sst2, build=recording))
    good, bad = tmp_path / "t.jsonl", tmp_path / "bad.jsonl"
    good.write_text('{"sentence": "fine", "label": 1}\n{"sentence": "dull", "label": 0}\n')
    bad.write_text('{"sentence": "fine", "label": 7}\n')
    loaded = load_task_rows("sst2", str(good), str(good))
    assert loaded is not None and [e.label for e in loaded.train] == [1, 0]
    assert seen == [False] * 4 and gc.isenabled()
    with pytest.raises(ValueError, match="row 1: label 7"):
        load_task_rows("sst2", str(bad), str(good))
    assert gc.isenabled()
    gc.disable()
    try:
        load_task_rows("sst2", str(good), str(good))
        assert not gc.isenabled()
    finally:
        gc.enable()


def varied_texts() -> list[str]:
    """A few hundred texts a data file may hold: empty, blank, unicode of every width,
    control characters, newlines, and long ones."""
    pieces = ["", " ", "\n", "a", "It was", " great", "naïve café", "日本語のテキスト"]
    pieces += ["🙂👍🏽", "x\ty"]
    pieces += ["Ünïcödé\u2028line", "\u200bzero width", "\x00nul", "  lead", "trail  ", "\r\n"]
    texts = [a + b for a in pieces for b in pieces]  # 256
    texts += ["word " * n for n in (50, 300)] + ["é" * 700, "🙂" * 400]
    return texts


def tokenizer_with_end_token():
    """Llama's with ``add_eos_token``: ``<s> text </s>``, the ``</s>`` cut off a prompt."""
    tokenizer = sentencepiece_bpe()
    tokenizer.add_bos_token = tokenizer.add_eos_token = True
    assert PromptEncoder(tokenizer, 64).trail == 1
    return tokenizer


@pytest.mark.parametrize(
    "make", [byte_tokenizer, byte_level_bpe, sentencepiece_bpe, tokenizer_with_end_token]
)
def test_encodings_are_the_tokenizers_own_calls_on_varied_texts(make):
    """Asking for ids alone and taking the tokenizer's lists uncopied changes no token:
    each text's ids are those a plain call of the tokenizer gives it, less the trailing
    special token where there is one."""
    tokenizer = make()
    encoder = PromptEncoder(tokenizer, 64)
    texts = varied_texts()
    plain = [list(tokenizer(t)["input_ids"]) for t in texts]
    assert encoder._all_ids_many(texts) == plain
    assert [encoder._all_ids(t) for t in texts] == plain
    trimmed = [ids[: len(ids) - encoder.trail] for ids in plain]
    assert encoder._ids_many(texts) == trimmed == [encoder._ids(t) for t in texts]
    assert list(encoder.encode_texts(texts)) == [
        (encoder._keep(ids, 64), len(ids) > 64) for ids in plain
    ]


class RecordingTokenizer:
    """A tokenizer that keeps what each call returned."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.returned: list[dict[str, list]] = []

    def __call__(self, text, **kwargs):
        self.returned.append(self.tokenizer(text, **kwargs))
        return self.returned[-1]

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_a_tokenizer_call_returns_ids_alone_taken_uncopied():
    """The attention masks a call returns by default, never read, and a copy of every id
    list were a third of a million SST-2 rows' lengths pass with the byte tokenizer."""
    recording = RecordingTokenizer(byte_tokenizer())
    encoder = PromptEncoder(recording, 64)
    texts = ["a gripping film", "It was great", ""]
    recording.returned.clear()
    ids = encoder._ids_many(texts)
    (returned,) = recording.returned
    assert list(returned) == ["input_ids"]
    assert all(a is b for a, b in zip(ids, returned["input_ids"], strict=True))
    assert list(encoder.encode_texts(texts))[0][0] == returned["input_ids"][0]
    encoder._ids("one text")
    assert list(recording.returned[-1]) == ["input_ids"]


def test_a_real_fast_tokenizers_encodings_are_its_own_calls(smollm2_dir):
    """SmolLM2's own tokenizer (a real BPE with merges), as the varied-texts test."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    encoder = PromptEncoder(tokenizer, 64)
    texts = varied_texts()
    plain = [list(tokenizer(t)["input_ids"]) for t in texts]
    assert encoder._ids_many(texts) == plain == [encoder._ids(t) for t in texts]
