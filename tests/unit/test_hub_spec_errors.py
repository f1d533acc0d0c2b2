"""An ``hf:`` spec that names no config of a dataset with several, a split or config the
dataset lacks, or a folder ``save_to_disk`` wrote: one line naming what is wrong and the
spec to write, not the first line of ``datasets``' message and "use a local file". The
datasets are folders written here, read as ``hf:FOLDER...`` offline."""

import pytest
from datasets import Dataset

from distzo.data.loaders import load_rows
from distzo.models import hub_reads

ROWS = [{"sentence": "a film", "label": 1}]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No hub: datasets offline, its cache in tmp_path."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    monkeypatch.setattr(hub_reads, "hub_answers", lambda: False)


def configured(folder) -> str:
    """A dataset of configs ``first`` and ``second`` (a train split each), as GLUE's."""
    card = ["---", "configs:"]
    for config in ("first", "second"):
        (folder / config).mkdir(parents=True)
        Dataset.from_list(ROWS).to_parquet(str(folder / config / "train-00000-of-00001.parquet"))
        card += [f"- config_name: {config}", "  data_files:", "  - split: train"]
        card += [f"    path: {config}/*.parquet"]
    (folder / "README.md").write_text("\n".join([*card, "---", ""]))
    return str(folder)


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        (  # no config of several
            "{p}:train",
            "{p} has configs first, second and the spec names none; write hf:{p}:CONFIG:SPLIT, "
            "e.g. hf:{p}:first:train",
        ),
        (  # hf:nyu-mll/glue:sst2 reads sst2 as the split: the user left the split out
            "{p}:second",
            "second is a config of {p} and the spec names no split; write hf:{p}:second:SPLIT, "
            "e.g. hf:{p}:second:train",
        ),
        (
            "{p}:third:train",
            "{p} has no config 'third'; its configs are first, second: write e.g. "
            "hf:{p}:first:train",
        ),
        (
            "{p}:first:validation",
            "{p} has no split 'validation'; its splits are train: write e.g. hf:{p}:first:train",
        ),
    ],
    ids=["no-config", "no-split", "unknown-config", "unknown-split"],
)
def test_a_spec_the_dataset_does_not_answer_names_what_it_has(offline, tmp_path, spec, said):
    path = configured(tmp_path / "glue")
    assert load_rows(f"hf:{path}:first:train") == ROWS
    source = "hf:" + spec.format(p=path)
    with pytest.raises(ValueError) as err:
        load_rows(source)
    assert str(err.value) == f"{source}: {said.format(p=path)}"


def test_a_save_to_disk_folder_is_named_with_the_file_to_write(offline, tmp_path):
    folder = tmp_path / "saved"
    Dataset.from_list(ROWS).save_to_disk(str(folder))
    with pytest.raises(ValueError) as err:
        load_rows(f"hf:{folder}:train")
    assert str(err.value) == (
        f"hf:{folder}:train: {folder} is a folder Dataset.save_to_disk wrote, which is read "
        "as no dataset; write its rows to a file (Dataset.to_parquet('train.parquet')) and "
        "give that file"
    )
