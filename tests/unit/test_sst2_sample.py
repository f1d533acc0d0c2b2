"""benchmarks/sst2_sample.py: the SST-2 sample a user writes for learning.py, here from a
local file standing in for the hub's split (the hub is not reachable in CI)."""

import pytest

from distzo.data.loaders import load_rows
from tests.helpers.scripts import benchmark_script


@pytest.fixture(scope="module")
def sample():
    with benchmark_script("sst2_sample") as module:
        yield module


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "split.jsonl"
    rows = [f'{{"sentence": "row {i} is\\tfine", "label": {i % 2}, "idx": {i}}}' for i in range(40)]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_the_sample_is_two_disjoint_draws_in_the_task_schema(sample, source, tmp_path):
    out = tmp_path / "sst2"
    sample.main(["--out", str(out), "--source", str(source), "--train", "12", "--heldout", "5"])
    train, heldout = load_rows(str(out / "train.tsv")), load_rows(str(out / "heldout.tsv"))
    assert len(train) == 12 and len(heldout) == 5
    assert set(train[0]) == {"sentence", "label"}
    sentences = [r["sentence"] for r in train + heldout]
    assert len(set(sentences)) == 17  # no row twice, none in both files
    assert all("\t" not in s and s.startswith("row ") for s in sentences)
    assert not list(tmp_path.glob(".sst2.tmp"))
    again = tmp_path / "again"  # the same seed draws the same rows
    sample.main(["--out", str(again), "--source", str(source), "--train", "12", "--heldout", "5"])
    assert (again / "train.tsv").read_text() == (out / "train.tsv").read_text()


def test_a_bad_request_is_refused_before_anything_is_written(sample, source, tmp_path):
    out = tmp_path / "sst2"
    with pytest.raises(SystemExit, match=r"40 \+ 1 rows asked for, the source has 40"):
        sample.main(["--out", str(out), "--source", str(source), "--train", "40", "--heldout", "1"])
    assert not out.exists()
    out.mkdir()
    with pytest.raises(SystemExit, match="exists; remove it or give another --out"):
        sample.main(["--out", str(out), "--source", str(source)])
    with pytest.raises(SystemExit, match="does not exist"):
        sample.main(["--out", str(tmp_path / "x"), "--source", str(tmp_path / "none.jsonl")])
