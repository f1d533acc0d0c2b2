"""``--columns``: a source's columns read under the task's names (SetFit/sst5's and
CogComp/trec's ``text`` as ``sentence``, CogComp/trec's ``coarse_label`` as ``label``), for
local files and ``hf:`` splits alike, checked in one line before a row builds an example;
and an ``hf:`` split's ``ClassLabel`` read by its class names where the task reads names,
so CogComp/trec's 0 (ABBR) is LM-BFF's Expression, not Description. The hub datasets are
parquet folders written here, read as ``hf:FOLDER:SPLIT`` offline."""

import json

import pytest
from datasets import ClassLabel, Dataset, Features, Value

from distzo.config.checks import resolve_defaults
from distzo.config.job import resolve, to_toml
from distzo.data.masked_prompts import MASKED_PROMPTS
from distzo.data.task_data import load_task_rows
from distzo.dist import LaunchEnv
from distzo.job.run_dir import check_resumed_options
from distzo.models import hub_reads

# CogComp/trec's classes in its own ClassLabel order, and its rows' questions
TREC_COARSE = ["ABBR", "ENTY", "DESC", "HUM", "LOC", "NUM"]
TREC_ROWS = [{"text": f"Question {i}?", "coarse_label": i, "fine_label": i} for i in range(6)]
TREC = Features(
    {
        "text": Value("string"),
        "coarse_label": ClassLabel(names=TREC_COARSE),
        "fine_label": ClassLabel(names=[f"{name}:other" for name in TREC_COARSE]),
    }
)
SST5_NAMES = ["very negative", "negative", "neutral", "positive", "very positive"]
SST5_ROWS = [{"text": f"a film {i}", "label": i, "label_text": SST5_NAMES[i]} for i in range(5)]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No hub: datasets offline, its cache in tmp_path."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    monkeypatch.setattr(hub_reads, "hub_answers", lambda: False)


def hub_split(folder, rows, features=None) -> str:
    """``rows`` as the train split of a hub-style parquet dataset in ``folder``."""
    (folder / "data").mkdir(parents=True)
    path = folder / "data" / "train-00000-of-00001.parquet"
    Dataset.from_list(rows, features=features).to_parquet(str(path))
    return f"hf:{folder}:train"


def jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_cogcomps_trec_split_trains_with_lm_bffs_labels(offline, tmp_path):
    source = hub_split(tmp_path / "trec", TREC_ROWS, TREC)
    columns = (("sentence", "text"), ("label", "coarse_label"))
    rows = load_task_rows("trec", source, source, masked=True, columns=columns)
    assert rows is not None
    words = MASKED_PROMPTS["trec"].words
    assert [words[example.label] for example in rows.train] == [
        "Expression", "Entity", "Description", "Human", "Location", "Number"
    ]  # fmt: skip
    assert [example.sentences for example in rows.train] == [(r["text"],) for r in TREC_ROWS]


def test_a_class_label_whose_names_the_task_does_not_read_gives_its_numbers(offline, tmp_path):
    """fine_label's names are no task class names: its numbers are read as they were."""
    source = hub_split(tmp_path / "trec", TREC_ROWS, TREC)
    columns = (("sentence", "text"), ("label", "fine_label"))
    rows = load_task_rows("trec", source, source, masked=True, columns=columns)
    assert rows is not None and [example.label for example in rows.train] == list(range(6))


def test_glues_sst2_split_reads_as_it_did_for_the_causal_task(offline, tmp_path):
    """GLUE's ClassLabel names (negative, positive) are the task's, in its order."""
    glue = [{"sentence": f"film {i}", "label": i % 2, "idx": i} for i in range(4)]
    features = Features(
        {
            "sentence": Value("string"),
            "label": ClassLabel(names=["negative", "positive"]),
            "idx": Value("int32"),
        }
    )
    source = hub_split(tmp_path / "glue", glue, features)
    plain = jsonl(tmp_path / "plain.jsonl", glue)
    for masked in (False, True):
        hub = load_task_rows("sst2", source, source, masked=masked)
        local = load_task_rows("sst2", plain, plain, masked=masked)
        assert hub is not None and local is not None
        assert hub.train == local.train and hub.digests == local.digests


@pytest.mark.parametrize("label", ["label", "label_text"])
def test_setfits_sst5_file_and_split_read_through_columns(offline, tmp_path, label):
    renamed = [{"sentence": r["text"], "label": r["label"]} for r in SST5_ROWS]
    expected = load_task_rows(
        "sst5", *[jsonl(tmp_path / "renamed.jsonl", renamed)] * 2, masked=True
    )
    columns = (("sentence", "text"), ("label", label))
    for source in (hub_split(tmp_path / "sst5", SST5_ROWS), jsonl(tmp_path / "s.jsonl", SST5_ROWS)):
        rows = load_task_rows("sst5", source, source, masked=True, columns=columns)
        assert rows is not None and expected is not None
        assert rows.train == expected.train and rows.digests == expected.digests


def test_a_column_the_task_lacks_is_refused_before_any_file_is_read(tmp_path):
    missing = str(tmp_path / "none.jsonl")  # never read: the mapping is refused first
    with pytest.raises(ValueError) as err:
        load_task_rows("sst5", missing, missing, masked=True, columns=(("text", "text"),))
    assert str(err.value) == (
        "--columns text=text: --task sst5 has no column 'text'; its columns are sentence, label "
        "(write TASK_COLUMN=SOURCE_COLUMN)"
    )


def test_a_source_column_a_row_lacks_is_named_with_the_columns_it_has(tmp_path):
    data = jsonl(tmp_path / "sst5.jsonl", SST5_ROWS)
    with pytest.raises(ValueError) as err:
        load_task_rows("sst5", data, data, masked=True, columns=(("sentence", "review"),))
    assert str(err.value) == (
        f"{data}, row 1: no column 'review' (--columns sentence=review); its columns are "
        "text, label, label_text"
    )


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("sentence", "'sentence' is not TASK_COLUMN=SOURCE_COLUMN; write e.g. --columns "),
        ("sentence=text,=label", "'=label' is not TASK_COLUMN=SOURCE_COLUMN"),
        ("label=a,label=b", "the task's column 'label' is mapped twice; map it once"),
    ],
)
def test_a_malformed_columns_option_is_one_line_as_the_options_are_read(given, message):
    with pytest.raises(ValueError, match=f"^--columns {given}: {message}"):
        resolve(["--task", "sst2", "--columns", given]).validate()


def resolved(*argv: str, run=None):
    """The job of ``argv`` in run directory ``run``, its defaults resolved (as validate's)."""
    job = resolve(["--task", "text", *argv] + (["--output-dir", str(run)] if run else []))
    resolve_defaults(job)
    return job


def test_columns_are_recorded_and_a_resume_with_another_mapping_is_refused(tmp_path):
    """config.toml holds the mapping (a TOML file's [data] columns gives it); a resume
    reading other columns would train on other rows, so it is refused as other data
    options are, and a run from before the option (no columns recorded) resumes unset."""
    job = resolved("--columns", "text=body", run=tmp_path)
    (tmp_path / "config.toml").write_text(to_toml(job))
    recorded = resolve(["--config", str(tmp_path / "config.toml")])
    assert recorded.data.column_map == (("text", "body"),)
    check_resumed_options(job, LaunchEnv())  # the run's own mapping resumes
    other = resolved("--columns", "text=title", run=tmp_path)
    with pytest.raises(ValueError, match=r"^--resume: --columns text=body -> text=title would"):
        check_resumed_options(other, LaunchEnv())
    (tmp_path / "config.toml").write_text(to_toml(resolved()))  # unset: no columns key
    check_resumed_options(resolved(run=tmp_path), LaunchEnv())


def test_a_missing_column_names_the_rows_other_columns_and_the_option(tmp_path):
    """A source of names no hint knows (SetFit/sst2's text, a user's own) was refused
    naming the task's columns alone; the row's others and --columns are named now."""
    data = jsonl(tmp_path / "sst2.jsonl", [{"text": "a film", "label": 1, "idx": 0}])
    with pytest.raises(ValueError) as err:
        load_task_rows("sst2", data, data)
    assert str(err.value) == (
        f"{data}, row 1: missing column 'sentence' (task sst2 needs sentence, label); the row "
        "also has 'text', 'idx': --columns sentence=COLUMN reads one of them as 'sentence'"
    )


def test_a_class_label_cell_holding_no_value_is_the_rows_missing_label(offline, tmp_path):
    """A null in a ClassLabel column was compared with the class count, a TypeError said
    as 'cannot load from the hub'; the row is refused as a file's row without its label."""
    features = Features(
        {"sentence": Value("string"), "label": ClassLabel(names=["negative", "positive"])}
    )
    rows = [{"sentence": "a film", "label": 1}, {"sentence": "a play", "label": None}]
    source = hub_split(tmp_path / "glue", rows, features)
    with pytest.raises(ValueError) as err:
        load_task_rows("sst2", source, source)
    assert str(err.value) == (
        f"{source}, row 2: missing column 'label' (task sst2 needs sentence, label); give "
        "every row its 'label'"
    )


def test_a_parquet_file_datasets_wrote_reads_its_class_labels_by_name(offline, tmp_path):
    """CogComp/trec's split written with Dataset.to_parquet keeps its ClassLabel in the
    file's schema: read as numbers, its 0 (ABBR) trained as LM-BFF's 0 (Description), where
    the same rows as an hf: split read Expression."""
    path = tmp_path / "trec.parquet"
    Dataset.from_list(TREC_ROWS, features=TREC).to_parquet(str(path))
    columns = (("sentence", "text"), ("label", "coarse_label"))
    local = load_task_rows("trec", str(path), str(path), masked=True, columns=columns)
    source = hub_split(tmp_path / "trec", TREC_ROWS, TREC)
    hub = load_task_rows("trec", source, source, masked=True, columns=columns)
    assert local is not None and hub is not None
    assert local.train == hub.train and local.digests == hub.digests
    assert local.train[0].label == MASKED_PROMPTS["trec"].words.index("Expression")
    fine = load_task_rows(  # fine_label's names are no task's: its numbers, as an hf: split's
        "trec",
        str(path),
        str(path),
        masked=True,
        columns=(("sentence", "text"), ("label", "fine_label")),
    )
    assert fine is not None and [example.label for example in fine.train] == list(range(6))


@pytest.mark.parametrize(
    "written", ["text = body", "title=title, text=body", "text=body,title=title"]
)
def test_a_resume_with_the_same_mapping_written_otherwise_goes_on(tmp_path, written):
    """The mapping was compared as the option's text: the run's own pairs, spaced or in
    another order, were refused as 'would change the trajectory'."""
    job = resolved(
        "--columns", "title=title,text=body" if "title" in written else "text=body", run=tmp_path
    )
    (tmp_path / "config.toml").write_text(to_toml(job))
    check_resumed_options(resolved("--columns", written, run=tmp_path), LaunchEnv())


def test_a_null_in_a_mapped_column_names_the_mapping_not_another(tmp_path):
    """A row whose mapped column held null was refused as 'missing column sentence', with
    the hint to map sentence from a column: the very one --columns already maps."""
    data = jsonl(tmp_path / "sst5.jsonl", [SST5_ROWS[0], {"text": None, "label": 1}])
    with pytest.raises(ValueError) as err:
        load_task_rows("sst5", data, data, masked=True, columns=(("sentence", "text"),))
    assert str(err.value) == (
        f"{data}, row 2: column 'text' is empty (null), and --columns sentence=text reads it "
        "as 'sentence'; give the row a value or leave the row out"
    )


@pytest.mark.parametrize("columns", [(), (("sentence", "text"),)], ids=["as-is", "mapped"])
def test_a_files_own_error_further_on_comes_before_a_rows_missing_column(tmp_path, columns):
    """A bad line further on is the file's problem and comes first, whether the row before
    it lacks the task's column or the one --columns maps: a mapped column's refusal left
    the rest unread, and the bad line, which a fix of the row would meet next, unnamed."""
    data = tmp_path / "sst5.jsonl"
    data.write_text('{"label": 1}\n{"text": "fine", "label": 0}\n{"text": \n')
    with pytest.raises(ValueError) as err:
        load_task_rows("sst5", str(data), str(data), masked=True, columns=columns)
    assert str(err.value).startswith(f"{data}, row 3: not valid JSON"), str(err.value)


def test_a_parquet_schema_of_a_feature_type_datasets_lacks_still_reads(tmp_path):
    """A file another datasets version wrote may name a feature type this one does not
    know: its ClassLabel names are read from the schema's JSON, the rest as it was."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    features = {
        "text": {"_type": "FutureText"},  # a type no installed datasets has
        "coarse_label": {"names": TREC_COARSE, "_type": "ClassLabel"},
    }
    metadata = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    table = pa.Table.from_pylist([{"text": "Question?", "coarse_label": 0}])
    path = tmp_path / "trec.parquet"
    pq.write_table(table.replace_schema_metadata(metadata), path)
    columns = (("sentence", "text"), ("label", "coarse_label"))
    rows = load_task_rows("trec", str(path), str(path), masked=True, columns=columns)
    assert rows is not None and rows.train[0].label == MASKED_PROMPTS["trec"].words.index(
        "Expression"
    )
