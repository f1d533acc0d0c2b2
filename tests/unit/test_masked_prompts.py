"""MeZO's RoBERTa prompts (``distzo.data.masked_prompts``) and the job that trains a masked
LM on them: the encodings MeZO's own ``tokenize_multipart_input`` gives, the refusals, and
``python -m distzo.train --model <a RoBERTa folder> --task sst2`` end to end."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForMaskedLM, RobertaConfig

from distzo.config.job import JobConfig
from distzo.data.masked_prompts import MASKED_PROMPTS, MaskedPromptEncoder
from distzo.data.sampling import Sampling
from distzo.data.task_data import LoadedRows, MaskedPromptData, load_task_rows
from distzo.data.templates import MaskedExample
from distzo.job.build import build_task_data
from distzo.job.evaluation import has_dev
from distzo.models.tiny import shared_byte_tokenizer
from distzo.replay import replay
from tests.helpers.launch import train_in_process
from tests.helpers.masked_prompts import WORDS, roberta_tokenizer, save_tiny_roberta

SHORT = ("A cat is an animal.", "The plot is dull and slow")
LONG = ("a gripping, funny film. " * 30, "What city hosts the games? " * 12)
IT_WAS = [0, 37, 393, 289, 357, 410, 18, 324, 343, 4, 18, 2]
THIS_IS = [0, 37, 393, 289, 357, 410, 18, 346, 289, 4, 18, 2]
PAIR = [0, 37, 393, 289, 357, 410, 18, 4, 16, 363, 400, 289, 405, 390, 408, 2]
INFERENCE = [0, 37, 393, 289, 357, 410, 35, 4, 16, 363, 400, 289, 405, 390, 408, 2]
CUT_110 = (116, 113, [16, 412, 411, 324, 343, 4, 18, 2])
CUT_256 = (256, 211, [35, 225, 403, 394, 414, 363, 407, 35])
# What MeZO's tokenize_multipart_input (medium_models/src/dataset.py, run as written on the
# tiny tokenizer by benchmarks/masked_prompts_check.py) gives each task's SHORT row (ids,
# mask position) and LONG row (length, mask position, last ids; None: its assertion, the
# <mask> cut off).
MEZO = {
    "sst2": ((IT_WAS, 9), None),
    "sst5": ((IT_WAS, 9), CUT_110),
    "mr": ((IT_WAS, 9), CUT_110),
    "cr": ((IT_WAS, 9), CUT_110),
    "mpqa": ((IT_WAS, 9), CUT_110),
    "subj": ((THIS_IS, 9), (116, 113, [16, 412, 411, 346, 289, 4, 18, 2])),
    "cola": ((THIS_IS, 9), None),
    "trec": (
        ([0, 4, 30, 225, 37, 393, 289, 357, 410, 18, 2], 1),
        (114, 1, [411, 18, 225, 69, 406, 16, 412, 2]),
    ),
    "qqp": ((PAIR, 7), None),
    "mrpc": ((PAIR, 7), None),
    "qnli": ((INFERENCE, 7), None),
    "rte": ((INFERENCE, 7), CUT_256),
    "mnli": ((INFERENCE, 7), CUT_256),
    "snli": ((INFERENCE, 7), CUT_256),
}


def encoded(task: str, sentences: tuple[str, ...]):
    prompt = MASKED_PROMPTS[task]
    encoder = MaskedPromptEncoder(roberta_tokenizer(), task, prompt.max_length)
    example = MaskedExample(sentences[: len(prompt.columns)], 0)
    (encoding,) = encoder.choices_many([example])
    return encoder, encoding


def test_every_task_of_mezos_run_fewshot_has_a_prompt():
    assert sorted(MEZO) == sorted(MASKED_PROMPTS)


@pytest.mark.parametrize("task", sorted(MEZO))
def test_a_row_encodes_as_mezos_tokenize_multipart_input(task):
    """The template's parts each tokenized alone, the sentence limits and the row's limit
    (its end cut) as MeZO's, and every label word scored at the <mask> itself."""
    short, long = MEZO[task]
    encoder, encoding = encoded(task, SHORT)
    ids, at = short
    assert encoding.rows == (tuple(ids),)
    tokenizer = encoder.tokenizer
    words = [tokenizer.convert_tokens_to_ids("Ġ" + w) for w in MASKED_PROMPTS[task].words]
    assert encoding.scored == tuple((0, at, word, c) for c, word in enumerate(words))
    if long is None:
        with pytest.raises(ValueError, match="its <mask> falls past the 128-token limit"):
            encoded(task, LONG)
        return
    _, encoding = encoded(task, LONG)
    (row,) = encoding.rows
    assert (len(row), encoding.scored[0][1], list(row[-8:])) == long


# MeZO's medium_models/run_fewshot.sh, each task's --mapping as written (a label as LM-BFF's
# files write it: its number, or its name), and the columns that fill sent_0, sent_1.
MEZO_MAPPING = {
    "sst2": ({0: "terrible", 1: "great"}, ("sentence",)),
    "sst5": ({0: "terrible", 1: "bad", 2: "okay", 3: "good", 4: "great"}, ("sentence",)),
    "mr": ({0: "terrible", 1: "great"}, ("sentence",)),
    "cr": ({0: "terrible", 1: "great"}, ("sentence",)),
    "mpqa": ({0: "terrible", 1: "great"}, ("sentence",)),
    "subj": ({0: "subjective", 1: "objective"}, ("sentence",)),
    "cola": ({0: "incorrect", 1: "correct"}, ("sentence",)),
    "trec": (
        {0: "Description", 1: "Entity", 2: "Expression", 3: "Human", 4: "Location", 5: "Number"},
        ("sentence",),
    ),
    "qqp": ({0: "No", 1: "Yes"}, ("question1", "question2")),
    "mrpc": ({0: "No", 1: "Yes"}, ("sentence1", "sentence2")),
    "qnli": ({"not_entailment": "No", "entailment": "Yes"}, ("question", "sentence")),
    "rte": ({"not_entailment": "No", "entailment": "Yes"}, ("premise", "hypothesis")),
    "mnli": (
        {"contradiction": "No", "entailment": "Yes", "neutral": "Maybe"},
        ("premise", "hypothesis"),
    ),
    "snli": (
        {"contradiction": "No", "entailment": "Yes", "neutral": "Maybe"},
        ("premise", "hypothesis"),
    ),
}


@pytest.mark.parametrize("task", sorted(MEZO_MAPPING))
def test_each_label_is_scored_by_mezos_word_for_it(task, tmp_path):
    """A row of each label, read from a file, is scored by the word MeZO's --mapping gives
    that label, its columns filling sent_0 and sent_1 in MeZO's order."""
    mapping, columns = MEZO_MAPPING[task]
    assert sorted(MEZO_MAPPING) == sorted(MASKED_PROMPTS)
    data = tmp_path / f"{task}.jsonl"
    texts = {column: f"Text of {column}." for column in columns}
    data.write_text("".join(json.dumps({**texts, "label": k}) + "\n" for k in mapping))
    rows = load_task_rows(task, str(data), str(data), masked=True)
    words = MASKED_PROMPTS[task].words
    assert [words[row.label] for row in rows.train] == list(mapping.values())
    assert {row.sentences for row in rows.train} == {tuple(texts[c] for c in columns)}


@pytest.mark.parametrize("task", ["rte", "mnli", "snli"])
def test_rte_and_mnli_keep_240_tokens_of_the_premise_snli_all(task):
    """MeZO's --first_sent_limit 240 (RTE, MNLI; not SNLI): a premise of over 256 tokens
    keeps its first 240, so the <mask> stays in the 256-token row; SNLI's is cut off."""
    premise = "a gripping, funny film. " * 60
    if task == "snli":
        with pytest.raises(ValueError, match="its <mask> falls past the 256-token limit"):
            encoded(task, (premise, "Cats purr."))
        return
    encoder, encoding = encoded(task, (premise, "Cats purr."))
    kept = encoder.tokenizer(premise[:-1], add_special_tokens=False)["input_ids"]
    assert len(kept) > 256
    (row,) = encoding.rows
    assert list(row[1:241]) == kept[:240]
    assert encoding.scored[0][1] == 242  # <s>, 240 premise tokens, "?", then the <mask>


def test_a_sentence_longer_than_the_tokenizers_maximum_raises_no_false_warning():
    """RoBERTa's tokenizer warns of "indexing errors" for a text over its 512 tokens, but
    the sentence limits and the row's limit cut it (and the run counts the rows cut):
    the warning was false, on every long premise of a run."""
    import logging

    from transformers.utils import logging as hf_logging

    tokenizer = roberta_tokenizer()
    tokenizer.model_max_length = 16
    heard: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())
    hf_logging.get_logger("transformers").addHandler(handler)
    try:
        encoder = MaskedPromptEncoder(tokenizer, "rte", 40)
        ((ids, full),) = encoder.encode_ids([MaskedExample((LONG[0], "Cats purr."), 0)])
    finally:
        hf_logging.get_logger("transformers").removeHandler(handler)
    assert (len(ids), full > 40) == (40, True)
    assert [m for m in heard if "indexing errors" in m] == []


def test_a_tokenizer_with_no_mask_token_is_refused():
    with pytest.raises(ValueError) as err:
        MaskedPromptEncoder(shared_byte_tokenizer(), "sst2", 128)
    assert str(err.value) == (
        "--task sst2: the model's tokenizer has no mask token, which MeZO's masked-LM prompt "
        "(*cls**sent_0*_It_was*mask*.*sep+*) needs; give the masked LM's own tokenizer "
        "(RoBERTa's has <s>, </s> and <mask>)"
    )


def test_a_label_word_of_several_tokens_is_refused():
    tokenizer = roberta_tokenizer(tuple(w for w in WORDS if w != "great"))
    MaskedPromptEncoder(tokenizer, "cola", 128)  # its words are one token each
    with pytest.raises(ValueError) as err:
        MaskedPromptEncoder(tokenizer, "sst2", 128)
    message = str(err.value)
    assert message.startswith("--task sst2: label word 'great' (with its leading space) is ")
    assert message.endswith(
        "MeZO's prompts score one token at the <mask>: give a tokenizer with the word in its "
        "vocabulary (RoBERTa's)"
    )


def test_rows_are_read_as_mezos_columns_and_label_names(tmp_path):
    """RTE's GLUE names as its labels (entailment: MeZO's "Yes", the first word)."""
    train = tmp_path / "rte.jsonl"
    train.write_text(
        '{"premise": "A cat is an animal.", "hypothesis": "Cats purr.", "label": '
        '"not_entailment"}\n{"premise": "P.", "hypothesis": "H.", "label": 0}\n'
    )
    rows = load_task_rows("rte", str(train), str(train), masked=True)
    assert rows.train == [
        MaskedExample(("A cat is an animal.", "Cats purr."), 1),
        MaskedExample(("P.", "H."), 0),
    ]
    assert MASKED_PROMPTS["rte"].words[:2] == ("Yes", "No")


def test_trec_and_sst5_read_their_class_names_as_lm_bffs_numbers(tmp_path):
    """CogComp/trec's ClassLabel orders ABBR, ENTY, DESC, HUM, LOC, NUM; LM-BFF numbers
    Description 0, Entity 1, Expression 2: a name is read as LM-BFF's number, an int as
    LM-BFF's own (its files'). SetFit/sst5's label_text names its 0..4 as MeZO's words."""
    trec = tmp_path / "trec.jsonl"
    names = ["ABBR", "ENTY", "DESC", "HUM", "LOC", "NUM", 2]
    trec.write_text("".join(json.dumps({"sentence": "Q?", "label": n}) + "\n" for n in names))
    rows = load_task_rows("trec", str(trec), str(trec), masked=True)
    words = MASKED_PROMPTS["trec"].words
    assert [words[row.label] for row in rows.train] == [
        "Expression", "Entity", "Description", "Human", "Location", "Number", "Expression"
    ]  # fmt: skip
    sst5 = tmp_path / "sst5.jsonl"
    names = ["very negative", "negative", "neutral", "positive", "very positive"]
    sst5.write_text("".join(json.dumps({"sentence": "s", "label": n}) + "\n" for n in names))
    assert [r.label for r in load_task_rows("sst5", str(sst5), str(sst5), masked=True).train] == [
        0, 1, 2, 3, 4
    ]  # fmt: skip


def test_trec_rows_in_cogcomps_columns_are_told_to_name_their_class(tmp_path):
    trec = tmp_path / "trec.jsonl"
    trec.write_text('{"sentence": "Q?", "coarse_label": 0}\n')
    with pytest.raises(ValueError) as err:
        load_task_rows("trec", str(trec), str(trec), masked=True)
    assert str(err.value).endswith(
        "the file has 'coarse_label', as CogComp/trec names it: read it as 'label' with "
        "--columns label=coarse_label (an hf: split gives its class names; a file must write "
        "them (ABBR, DESC...), not its numbers: its 0 is ABBR, LM-BFF's 0 Description)"
    )


@pytest.mark.parametrize(
    ("task", "whose"),
    [("sst5", "SetFit/sst5"), ("trec", "CogComp/trec")]
    + [(task, "a hub copy") for task in ("mr", "cr", "mpqa", "subj")],
)
def test_a_text_column_of_the_hubs_copies_is_told_the_columns_option(tmp_path, task, whose):
    """SST-5's, TREC's, and the hub's copies of LM-BFF's mr, cr, mpqa and subj name their
    sentence 'text'; subj's numbers are told too (a copy counting objective first would
    swap its labels silently)."""
    data = tmp_path / f"{task}.jsonl"
    data.write_text('{"text": "Q?", "label": 1}\n')
    with pytest.raises(ValueError) as err:
        load_task_rows(task, str(data), str(data), masked=True)
    note = " and keep LM-BFF's labels: 0 subjective, 1 objective" if task == "subj" else ""
    assert str(err.value).endswith(
        f"; the file has 'text', as {whose} names it: read it as 'sentence' with --columns "
        f"sentence=text{note}"
    )


def test_cogcomps_two_columns_are_named_in_one_columns_option(tmp_path):
    data = tmp_path / "trec.jsonl"
    data.write_text('{"text": "Q?", "coarse_label": "ABBR"}\n')
    with pytest.raises(ValueError) as err:
        load_task_rows("trec", str(data), str(data), masked=True)
    assert "with --columns sentence=text,label=coarse_label (an hf: split" in str(err.value)


def test_snli_rows_without_a_gold_label_are_left_out_as_lm_bffs_files_lack_them(tmp_path):
    """stanfordnlp/snli labels -1 the rows its annotators did not agree on (SNLI's own
    files write "-"); LM-BFF's SNLI files hold none, so they are no rows of the sets."""
    snli = tmp_path / "snli.jsonl"
    labels = [0, -1, 2, "-", "neutral"]
    snli.write_text(
        "".join(
            json.dumps({"premise": "P.", "hypothesis": "H.", "label": n}) + "\n" for n in labels
        )
    )
    rows = load_task_rows("snli", str(snli), str(snli), masked=True)
    assert [row.label for row in rows.train] == [0, 2, 1] == [row.label for row in rows.eval]
    assert rows.notices == (  # counted in one line, which the job logs (they were silent)
        "--task snli leaves out the rows without a gold label (label -1 or -), as LM-BFF's "
        "files hold none: 2 of --train-file's 5 and 2 of --eval-file's 5",
    )
    labelled = tmp_path / "labelled.jsonl"
    labelled.write_text(snli.read_text().splitlines()[0] + "\n")
    rows = load_task_rows("snli", str(snli), str(labelled), masked=True)
    assert rows.notices[0].endswith("files hold none: 2 of --train-file's 5")
    assert load_task_rows("snli", str(labelled), str(labelled), masked=True).notices == ()
    mnli = tmp_path / "mnli.jsonl"  # GLUE's MNLI has no such rows: one is an error there
    mnli.write_text(snli.read_text())
    with pytest.raises(ValueError, match="row 2: label -1 marks a row with no label"):
        load_task_rows("mnli", str(mnli), str(mnli), masked=True)


def test_a_masked_only_task_is_refused_for_a_causal_lm(tmp_path):
    train = tmp_path / "sst5.jsonl"
    train.write_text('{"sentence": "fine", "label": 3}\n')
    with pytest.raises(ValueError, match="^--task sst5 has a masked-LM prompt only"):
        load_task_rows("sst5", str(train), str(train))


def test_a_cut_row_is_counted_and_the_data_has_one_row_an_example(tmp_path):
    encoder = MaskedPromptEncoder(roberta_tokenizer(), "rte", 40)
    long, short = MaskedExample(("Cats purr.", LONG[1]), 0), MaskedExample(SHORT, 1)
    rows = type("Rows", (), {"task": "rte", "train": [short, long], "eval": [short], "dev": []})
    data = MaskedPromptData(rows, encoder, seed=0, eval_batch_size=2)
    assert data.cut_notices == (
        "--train-file: 1 of 2 rows are longer than 40 tokens (--max-length, or the model's "
        "positions): they lose tokens from the end, their <mask> kept (MeZO's cut); raise "
        "--max-length or shorten the rows",
    )
    batch = data.batch(2, step=0)
    assert batch["input_ids"].shape == (2, 1, 40)
    assert batch["score_token"].shape == (2, 2)


def test_the_dev_rows_are_their_own_and_a_row_whose_mask_is_cut_is_refused_by_number():
    """The dev rows (--num-dev) are encoded, counted and evaluated as themselves; a row
    whose <mask> the limit cuts off is refused at load, naming it, not mid-training; the
    default objective is MeZO's classification, and a causal LM's lm is refused."""
    encoder = MaskedPromptEncoder(roberta_tokenizer(), "rte", 40)
    long, short = MaskedExample(("Cats purr.", LONG[1]), 0), MaskedExample(SHORT, 1)
    data = MaskedPromptData(LoadedRows("rte", [short], [short], [long]), encoder, 0, 2)
    assert (data.objective, data.dev_examples, data.eval_examples) == (
        "classification", [long], [short]
    )  # fmt: skip
    assert has_dev(data)  # the evaluations during training score them
    assert data.cut_notices == (
        "--num-dev rows of --train-file: 1 of 1 rows are longer than 40 tokens (--max-length, "
        "or the model's positions): they lose tokens from the end, their <mask> kept (MeZO's "
        "cut); raise --max-length or shorten the rows",
    )
    with pytest.raises(ValueError) as err:
        MaskedPromptData(LoadedRows("rte", [short], [short]), encoder, 0, 2, objective="lm")
    assert str(err.value) == (
        "--objective lm does not apply to a masked LM's --task rte; choose classification "
        "(MeZO's loss) or accuracy"
    )
    sst2 = MaskedPromptEncoder(roberta_tokenizer(), "sst2", 40)
    sst2_short, cut_off = MaskedExample(SHORT[:1], 0), MaskedExample((LONG[0],), 1)
    with pytest.raises(ValueError) as err:
        MaskedPromptData(LoadedRows("sst2", [sst2_short, cut_off], [sst2_short]), sst2, 0, 2)
    assert re.fullmatch(
        r"--train-file, example 2: the prompt is \d+ tokens and its <mask> falls past the "
        r"40-token limit; raise --max-length or shorten the row",
        str(err.value),
    )


def test_drawn_rows_are_named_by_the_option_and_the_file_row_that_gave_them(tmp_path):
    """LM-BFF's --dev-per-class rows were called --num-dev rows in the cut warning, and a
    drawn row whose <mask> the limit cuts off was named by its place in the drawn set."""
    lines = [("great fun", 1), ("dull", 0), ("fine", 1), ("slow", 0), (LONG[0], 1), ("ok", 0)]
    data, evals = tmp_path / "mr.jsonl", tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"sentence": t, "label": n}) + "\n" for t, n in lines))
    evals.write_text(json.dumps({"sentence": "fun", "label": 1}) + "\n")
    drawn = Sampling(seed=0, train_per_class=1, dev_per_class=2)
    rows = load_task_rows("mr", str(data), str(evals), drawn, masked=True)
    # LM-BFF's draw at seed 0: rows 6, 3 to train, 2, 4, 1, 5 as dev (LONG's 5 the 4th)
    assert [[row.row for row in part] for part in (rows.train, rows.dev)] == [
        [6, 3],
        [2, 4, 1, 5],
    ]
    # mr keeps 110 tokens of a sentence: LONG's row is 116 tokens, its <mask> at 113
    cut = MaskedPromptEncoder(roberta_tokenizer(), "mr", 115)
    assert MaskedPromptData(rows, cut, 0, 2).cut_notices == (
        "--dev-per-class rows of --train-file: 1 of 4 rows are longer than 115 tokens "
        "(--max-length, or the model's positions): they lose tokens from the end, their "
        "<mask> kept (MeZO's cut); raise --max-length or shorten the rows",
    )
    cut_off = MaskedPromptEncoder(roberta_tokenizer(), "mr", 40)  # the <mask> falls past it
    with pytest.raises(ValueError) as err:
        MaskedPromptData(rows, cut_off, 0, 2)
    assert re.fullmatch(
        r"--dev-per-class rows of --train-file, row 5: the prompt is \d+ tokens and its "
        "<mask> falls past the 40-token limit; raise --max-length or shorten the row",
        str(err.value),
    )


@pytest.mark.parametrize(
    ("task", "table", "max_length", "limit"),
    [("rte", 130, None, 128), ("rte", 514, None, 256), ("sst2", 514, None, 128)]
    + [("rte", 130, 40, 40)],
)
def test_a_rows_limit_is_mezos_within_the_models_positions_or_max_length(
    task, table, max_length, limit
):
    """MeZO's --max_seq_length for the task (128; 256 for RTE), no more than the model's
    token positions (RoBERTa's table less its pad id + 1), unless --max-length says."""
    tokenizer = roberta_tokenizer()
    config = RobertaConfig(vocab_size=len(tokenizer), max_position_embeddings=table)
    job = JobConfig()
    job.data.task, job.data.max_length = task, max_length
    rows = LoadedRows(task, [MaskedExample(SHORT[: len(MASKED_PROMPTS[task].columns)], 0)], [])
    data = build_task_data(job, rows, tokenizer, config, 0)
    assert isinstance(data, MaskedPromptData) and data.encoder.max_length == limit


@pytest.fixture(scope="module")
def roberta_folder(tmp_path_factory) -> Path:
    return save_tiny_roberta(tmp_path_factory.mktemp("roberta") / "model")


@pytest.mark.parametrize(
    "options, message",
    [
        (
            ["--task", "copa"],
            "--task copa has no masked-LM prompt (MeZO's RoBERTa tasks are sst2, sst5, mr, "
            "cr, mpqa, subj, cola, trec, qqp, mrpc, qnli, rte, mnli, snli); pick one of them, "
            "or train --task copa on a causal LM",
        ),
        (
            ["--task", "sst2", "--objective", "lm"],
            "--objective lm needs a causal LM, and model type 'roberta' is a masked LM",
        ),
        (  # the task's columns are checked before any file (none.tsv is never read)
            ["--task", "sst5", "--columns", "text=text"],
            "--columns text=text: --task sst5 has no column 'text'; its columns are sentence, "
            "label (write TASK_COLUMN=SOURCE_COLUMN)",
        ),
        (  # f1 scores a generation task, which no masked-LM task is: refused with the
            # options, lm named as a causal LM's (the model is not read yet)
            ["--task", "sst2", "--objective", "f1"],
            "--objective f1 does not apply to --task sst2; choose one of lm (a causal LM's), "
            "classification, accuracy",
        ),
        (  # a task only a masked LM has a prompt for has no lm objective at all
            ["--task", "sst5", "--objective", "lm"],
            "--objective lm does not apply to --task sst5; choose one of classification, accuracy",
        ),
        (  # 130 rows less the prefix's 127 leave 3, of which RoBERTa keeps 2 before a token
            ["--task", "sst2", "--peft", "prefix", "--prefix-length", "127"],
            "the model's max_position_embeddings 130 less the 2 it keeps before a first token "
            "and the 127-token prefix leaves no room for a sequence; lower --prefix-length",
        ),
        (  # the label words are scored at the <mask>, inside the prompt, not after it
            ["--task", "trec", "--max-length", "1"],
            "--max-length 1 leaves no room for the <mask> after the row's first token; raise "
            "--max-length (at least 2, or 0: MeZO's limit for the task)",
        ),
        (  # RoBERTa's positions count from its pad id + 1: 130 rows hold 128 tokens
            ["--task", "sst2", "--max-length", "129"],
            "--max-length 129 exceeds the model's max_position_embeddings 130 (128 token "
            "positions); lower --max-length",
        ),
    ],
)
def test_the_job_refuses_what_a_masked_lm_cannot_train(roberta_folder, tmp_path, options, message):
    run = tmp_path / "run"
    files = ["--train-file", str(tmp_path / "none.tsv"), "--eval-file", str(tmp_path / "x")]
    proc = train_in_process(
        ["--model", str(roberta_folder), *options, *files, "--output-dir", str(run)]
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: " + message), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not run.exists()


def test_a_row_holding_the_mask_token_s_text_is_refused_by_number():
    """The tokenizer reads a row's "<mask>" as the mask token: the label words would be
    scored at the row's, which comes before the prompt's, without a word."""
    sst2 = MaskedPromptEncoder(roberta_tokenizer(), "sst2", 40)
    fine, masked = MaskedExample(SHORT[:1], 0), MaskedExample(("a <mask> film",), 1)
    with pytest.raises(ValueError) as err:
        MaskedPromptData(LoadedRows("sst2", [fine, masked], [fine]), sst2, 0, 2)
    assert str(err.value) == (
        "--train-file, example 2: the row's text holds '<mask>', which the tokenizer reads as "
        "the mask token, so the prompt has 2 and the label words would be scored at the "
        "row's; remove '<mask>' from the row"
    )


def test_a_config_of_too_few_positions_is_named_without_a_prefix_to_lower(roberta_folder, tmp_path):
    """Three rows, two of them RoBERTa's before a first token, and no prefix: the fix is the
    config, not a --prefix-length the run does not have."""
    folder = tmp_path / "model"
    shutil.copytree(roberta_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 3}))
    files = ["--train-file", str(tmp_path / "none.tsv"), "--eval-file", str(tmp_path / "x")]
    proc = train_in_process(
        ["--model", str(folder), "--task", "sst2", *files, "--output-dir", str(tmp_path / "r")]
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: the model's max_position_embeddings 3 less the 2 it keeps before a first "
        "token leaves no room for a sequence; check the model's config.json"
    ), proc.stderr


def test_a_named_roberta_shape_is_refused_to_train_naming_its_plan(tmp_path):
    """A random-init shape reads its text through the byte tokenizer, which has no <mask>:
    refused from the config, before any run directory, with the plan it is there for."""
    run = tmp_path / "run"
    files = ["--train-file", str(tmp_path / "none.tsv"), "--eval-file", str(tmp_path / "x")]
    proc = train_in_process(
        ["--model-config", "roberta-large", "--task", "sst2", *files, "--output-dir", str(run)]
    )
    assert (proc.returncode, proc.stderr.strip()) == (
        2,
        "error: --model-config roberta-large is a masked LM, and a named shape reads text "
        "through the byte tokenizer, which has no <mask> for its prompts; train --model with "
        "a checkpoint of it, or see its memory plan: python -m distzo.job.plan_report "
        "--model-config roberta-large",
    )
    assert not run.exists()


@pytest.mark.parametrize("adapter", [[], ["--peft", "prefix", "--prefix-length", "3"]])
def test_the_job_trains_a_roberta_on_mezos_sst2_prompt_and_exports_it(
    roberta_folder, tmp_path, adapter
):
    """The full model, and MeZO's prefix row (the job refused --peft prefix on a masked LM
    after the engine had learned to run it); the seed log replays either to the export."""
    rows = [("a gripping, funny film", 1), ("dull and slow", 0), ("funny", 1), ("slow", 0)]
    text = "sentence\tlabel\n" + "".join(f"{s}\t{label}\n" for s, label in rows)
    (tmp_path / "train.tsv").write_text(text)
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "distzo.train", "--model", str(roberta_folder), "--task", "sst2"]
        + ["--train-file", str(tmp_path / "train.tsv"), "--eval-file", str(tmp_path / "train.tsv")]
        + ["--max-steps", "2", "--batch-size", "2", "--lr", "1e-3", "--output-dir", str(run)]
        + adapter,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "eval before training: accuracy " in proc.stderr
    assert "-> accuracy " in proc.stderr
    # the seed log rebuilds the export (--export-best's replay too): the replay's engine
    # refused a masked LM its default objective, LanguageModeling, before it was given the run's
    weights = "adapter_model.safetensors" if adapter else "model.safetensors"
    replayed = replay(None, run / "seedlog.jsonl", tmp_path / "replayed")
    assert replayed is not None
    exported, rebuilt = load_file(run / "export" / weights), load_file(replayed / weights)
    assert exported.keys() == rebuilt.keys()
    assert all(torch.equal(rebuilt[k], v) for k, v in exported.items())
    base = AutoModelForMaskedLM.from_pretrained(roberta_folder)
    if adapter:  # a peft prefix adapter onto the masked LM: its logits are the base's no more
        ids = torch.tensor([[0, 5, 6, 7, 2]])
        tuned = PeftModel.from_pretrained(
            AutoModelForMaskedLM.from_pretrained(roberta_folder), run / "export"
        )
        assert not torch.allclose(tuned(input_ids=ids).logits, base(input_ids=ids).logits)
        return
    model = AutoModelForMaskedLM.from_pretrained(run / "export")
    assert type(model).__name__ == "RobertaForMaskedLM"
    moved = [not torch.equal(a, b) for a, b in zip(model.parameters(), base.parameters())]
    assert any(moved)  # the steps trained it
