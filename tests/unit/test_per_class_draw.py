"""LM-BFF's k-shot sets (--train-per-class, --dev-per-class): K rows of each label as its
generate_k_shot_data.py draws them, refused in one line where a label has too few rows,
where a task has no labels or where MeZO's counts are given too."""

import logging

import numpy as np
import pytest

from distzo.config.job import resolve
from distzo.data.per_class import per_class_draw
from distzo.data.sampling import Sampling
from distzo.data.task_data import load_task_rows
from tests.helpers.rows import sst2_like, write_jsonl


def _lm_bff_sets(rows: list[tuple[str, int]], k: int, seed: int) -> tuple[list, list]:
    """LM-BFF's steps on a list of (text, label) rows: numpy's global generator seeded,
    the list shuffled in place, then K of each label (first-come order) and the next K."""
    np.random.seed(seed)
    shuffled = list(rows)
    np.random.shuffle(shuffled)
    return _k_of_each(shuffled, k)


def _k_of_each(shuffled: list[tuple[str, int]], k: int) -> tuple[list, list]:
    by_label: dict[int, list] = {}
    for row in shuffled:
        by_label.setdefault(row[1], []).append(row)
    return (
        [row for group in by_label.values() for row in group[:k]],
        [row for group in by_label.values() for row in group[k : 2 * k]],
    )


@pytest.mark.parametrize("seed", [13, 21, 42, 87, 100])
def test_the_draw_is_lm_bffs_k_shot_sets_row_for_row_in_its_order(seed):
    rows = [(f"row {i}", (i * 7 + i // 5) % 3) for i in range(90)]
    labels = [label for _, label in rows]
    assert per_class_draw(rows, labels, 3, 4, 4, seed, "t") == _lm_bff_sets(rows, 4, seed)


def test_colas_sets_follow_lm_bffs_in_place_shuffles_of_its_seeds_in_order(tmp_path):
    """GLUE's CoLA train.tsv has no header: LM-BFF's script shuffles the file's own list
    in place for each of its seeds (100, 13, 21, 42, 87), so a seed's set comes from the
    list every earlier seed shuffled (MeZO's script, run as written on 300 CoLA-like rows,
    gives these sets for all five seeds); every other task's list is shuffled afresh."""
    rows = [(f"row {i}", (i * 7 + i // 5) % 2) for i in range(60)]
    labels = [label for _, label in rows]
    in_place = list(rows)
    for seed in (100, 13, 21, 42, 87):
        np.random.seed(seed)
        np.random.shuffle(in_place)
        want = _k_of_each(in_place, 4)
        assert per_class_draw(rows, labels, 2, 4, 4, seed, "t", task="cola") == want
        assert per_class_draw(rows, labels, 2, 4, 4, seed, "t") == _lm_bff_sets(rows, 4, seed)
    assert per_class_draw(rows, labels, 2, 4, 4, 7, "t", task="cola") == _lm_bff_sets(
        rows, 4, 7
    )  # a seed outside the script's: its shuffle alone
    data = write_jsonl(tmp_path / "cola.jsonl", [{"sentence": s, "label": y} for s, y in rows])
    sampling = Sampling(seed=21, train_per_class=4, dev_per_class=4)
    loaded = load_task_rows("cola", data, data, sampling, masked=True)
    assert loaded is not None
    sets = ([(r.sentences[0], r.label) for r in part] for part in (loaded.train, loaded.dev))
    assert tuple(sets) == per_class_draw(rows, labels, 2, 4, 4, 21, "t", task="cola")


def test_sample_sets_draws_k_of_each_label_of_the_built_rows(tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", sst2_like(30))
    rows = load_task_rows("sst2", data, data, Sampling(train_per_class=3, dev_per_class=3))
    assert rows is not None and len(rows.eval) == 30
    assert (
        sorted(r.label for r in rows.train)
        == sorted(r.label for r in rows.dev)
        == [0] * 3 + [1] * 3
    )
    assert not set(rows.train) & set(rows.dev)
    other = load_task_rows("sst2", data, data, Sampling(train_per_class=3, seed=1))
    assert other is not None and other.dev == [] and other.train != rows.train
    # the same options draw the same rows: a resumed run's digests match
    again = load_task_rows("sst2", data, data, Sampling(train_per_class=3, dev_per_class=3))
    assert again is not None and again.digests == rows.digests


def test_a_label_with_too_few_rows_is_named_with_its_count_in_one_line():
    rows = list(range(12))
    labels = [0] * 9 + [1] * 3  # label 2 has none
    with pytest.raises(ValueError) as err:
        per_class_draw(rows, labels, 3, 2, 2, 0, "t.jsonl")
    assert str(err.value) == (
        "--train-per-class 2 and --dev-per-class 2 ask 4 rows of each label, but in "
        "--train-file t.jsonl label 1 has 3, label 2 has 0; add rows of that label "
        "(LM-BFF's draw takes K of every label)"
    )
    fix = "label 1 has 3; give --train-per-class and --dev-per-class 1 or less"
    with pytest.raises(ValueError, match=fix):
        per_class_draw(rows, [0] * 9 + [1] * 3, 2, 2, 2, 0, "t.jsonl")
    with pytest.raises(ValueError, match="label 1 has 3; give --train-per-class 2 or less"):
        per_class_draw(rows, [0] * 9 + [1] * 3, 2, 4, 1, 0, "t.jsonl")
    with pytest.raises(ValueError, match="^--train-per-class 4 asks 4 rows of each label, "):
        per_class_draw(rows, [0] * 9 + [1] * 3, 2, 4, 0, 0, "t.jsonl")  # one flag: "asks"


def test_a_task_without_labels_and_mezos_counts_beside_it_are_refused(tmp_path):
    with pytest.raises(ValueError, match="^--train-per-class draws rows of each label, and "):
        load_task_rows("squad", "t.jsonl", "e.jsonl", Sampling(train_per_class=2))
    with pytest.raises(ValueError, match="--task record's rows have no labels"):
        load_task_rows("record", "t.jsonl", "e.jsonl", Sampling(train_per_class=2))
    with pytest.raises(ValueError, match="^--train-per-class and --num-dev both draw"):
        resolve(["--train-per-class", "16", "--num-dev", "16"]).validate()
    with pytest.raises(ValueError, match="^--dev-per-class draws dev rows beside"):
        resolve(["--dev-per-class", "16"]).validate()
    with pytest.raises(ValueError, match="^--train-per-class must be >= 1"):
        resolve(["--train-per-class", "0"]).validate()
    job = resolve(["--train-per-class", "16", "--dev-per-class", "16", "--train-set-seed", "13"])
    assert job.data.sampling == Sampling(seed=13, train_per_class=16, dev_per_class=16)


def test_per_class_dev_rows_take_export_best_and_the_seed_as_num_dev_does(caplog):
    flags = ["--train-per-class", "4", "--export-best", "--train-set-seed", "13"]
    with caplog.at_level(logging.WARNING, logger="distzo.train"):
        resolve([*flags, "--dev-per-class", "4"])
        assert "ignored" not in caplog.text  # both apply
        resolve(flags)
    assert "ignored: --export-best (it applies only with --num-dev or --dev-per-class)" in (
        caplog.text
    )


def test_a_label_of_exactly_k_plus_d_rows_gives_them_all_and_each_fix_fits_its_case():
    rows, labels = list(range(8)), [0, 1] * 4  # 4 rows of each label: K=2 and D=2 exactly
    train, dev = per_class_draw(rows, labels, 2, 2, 2, 0, "t")
    assert sorted(train + dev) == rows
    one = "label 1 has 1; add rows of that label"  # K=D: no K//2 >= 1 fits a label of 1
    with pytest.raises(ValueError, match=one):
        per_class_draw(rows, [0] * 7 + [1], 2, 2, 2, 0, "t")
    two = "label 1 has 2; add rows of that label"  # its 2 rows are all --dev-per-class's
    with pytest.raises(ValueError, match=two):
        per_class_draw(rows, [0] * 6 + [1] * 2, 2, 3, 2, 0, "t")


def test_num_train_beside_it_is_refused_and_the_seed_names_it_where_ignored(caplog):
    with pytest.raises(ValueError, match="^--train-per-class and --num-train both draw"):
        resolve(["--train-per-class", "16", "--num-train", "16"]).validate()
    assert not Sampling().samples and Sampling(train_per_class=2).samples
    with caplog.at_level(logging.WARNING, logger="distzo.train"):
        resolve(["--train-set-seed", "13"])
    assert (
        "ignored: --train-set-seed (it applies only with --num-train, --num-dev, --num-eval, "
        "--train-per-class or --num-demos)" in caplog.text
    )
