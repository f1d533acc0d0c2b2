"""LM-BFF's k-shot-1k-test evaluation rows (--num-eval beside --train-per-class): the test
set its generate_k_shot_data.py writes, seed 42 whatever the data seed, a file of N rows or
fewer whole, CoLA's headerless dev list shuffled in place seed after seed."""

from typing import Any

import numpy as np
import pytest

from distzo.config.job import resolve
from distzo.data.per_class import LM_BFF_SEEDS, lm_bff_test_draw
from distzo.data.sampling import Sampling, mezo_draw, sample_sets
from distzo.data.task_data import load_task_rows
from distzo.job.trainer import Trainer
from tests.helpers.rows import sst2_like, write_jsonl


def _glue_test_rows(lines: list[int], cut: int) -> list[int]:
    """The script's steps on a GLUE dev list of more than ``cut`` rows: the global
    generator seeded with 42, the list shuffled in place, the first ``cut`` kept."""
    np.random.seed(42)
    np.random.shuffle(lines)
    return lines[:cut]


@pytest.mark.parametrize("task", ["sst2", "mnli", "qnli", "snli", "qqp"])
@pytest.mark.parametrize("seed", [*LM_BFF_SEEDS, 7])
def test_a_headed_glue_dev_file_is_cut_by_the_seed_42_shuffle_whatever_the_data_seed(task, seed):
    # split_header's lines[1:] is a copy: each seed shuffles the file's rows afresh (MNLI's
    # dev_matched and dev_mismatched alike), so no seed's set depends on another's
    drawn = lm_bff_test_draw(2500, 1000, seed, task)
    assert drawn == _glue_test_rows(list(range(2500)), 1000)
    assert drawn == np.random.RandomState(42).permutation(2500)[:1000].tolist()
    assert lm_bff_test_draw(1200, 7, seed, task) == _glue_test_rows(list(range(1200)), 7)


@pytest.mark.parametrize("count", [1001, 2210, 4000])
def test_the_csv_tasks_rows_are_pandas_sample_of_random_state_42_in_its_order(count):
    """sst5, mr, cr, mpqa, subj and trec: the script's ``DataFrame.sample(n=1000,
    random_state=42)``, numpy's ``RandomState(42).choice(count, 1000, replace=False)``."""
    choice = np.random.RandomState(42).choice(count, 1000, replace=False).tolist()
    for task in ("sst5", "mr", "cr", "mpqa", "subj", "trec"):
        assert lm_bff_test_draw(count, 1000, 13, task) == choice
    pd = pytest.importorskip("pandas")
    rows = pd.DataFrame({"sentence": [f"row {i}" for i in range(count)], "label": 0})
    sampled = rows.sample(n=1000, random_state=42)
    assert lm_bff_test_draw(count, 1000, 87, "mr") == sampled.index.tolist()


def test_a_file_of_n_rows_or_fewer_is_whole_in_its_order(tmp_path):
    # LM-BFF's `len(test_lines) > 1000`: SST-2's 872 dev rows are its test set as they are
    assert lm_bff_test_draw(872, 1000, 13, "sst2") == list(range(872))
    assert lm_bff_test_draw(1000, 1000, 13, "sst2") == list(range(1000))
    assert lm_bff_test_draw(1000, 1000, 21, "cola") == list(range(1000))
    data = write_jsonl(tmp_path / "rows.jsonl", sst2_like(10))
    whole = load_task_rows("sst2", data, data)
    assert whole is not None
    for count in (10, 11, 1000):  # where --num-eval alone refuses a count over the file's
        sampling = Sampling(num_eval=count, seed=3, train_per_class=1)
        loaded = load_task_rows("sst2", data, data, sampling)
        assert loaded is not None and loaded.eval == whole.eval
    with pytest.raises(ValueError, match="^--num-eval 11 asks more rows than the 10 of"):
        sample_sets([0, 1], whole.eval, Sampling(num_eval=11, seed=3), "t", "e")


def test_colas_test_set_is_the_seed_42_shuffle_applied_once_per_seed_in_the_scripts_order(
    tmp_path,
):
    """CoLA's dev.tsv has no header: split_header returns the list itself, so each seed
    of the script's order (100, 13, 21, 42, 87) shuffles the same list in place again."""
    in_place = list(range(1043))  # GLUE CoLA's dev rows
    for seed in LM_BFF_SEEDS:
        want = _glue_test_rows(in_place, 1000)
        assert lm_bff_test_draw(1043, 1000, seed, "cola") == want
    assert lm_bff_test_draw(1043, 1000, 100, "cola") == lm_bff_test_draw(1043, 1000, 13, "sst2")
    # a seed outside the script's: the one shuffle
    assert lm_bff_test_draw(1043, 1000, 7, "cola") == lm_bff_test_draw(1043, 1000, 7, "sst2")
    # through the loader: the built rows of a CoLA file, drawn as the script's test.tsv
    rows = [{"sentence": f"row {i}", "label": i % 2} for i in range(30)]
    data = write_jsonl(tmp_path / "cola.jsonl", rows)
    sampling = Sampling(seed=21, train_per_class=2, dev_per_class=2, num_eval=12)
    loaded = load_task_rows("cola", data, data, sampling, masked=True)
    assert loaded is not None
    twice = list(range(30))
    for _ in range(3):  # 100's, 13's and 21's shuffles of the one list
        drawn = _glue_test_rows(twice, 12)
    assert [row.sentences[0] for row in loaded.eval] == [f"row {i}" for i in drawn]


def test_the_eval_rows_digest_follows_the_draw_so_another_option_is_another_set(tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", sst2_like(40))

    def digests(**options: Any) -> dict[str, str]:
        loaded = load_task_rows("sst2", data, data, Sampling(**options))
        assert loaded is not None
        return loaded.digests

    k_shot = {"train_per_class": 2, "dev_per_class": 2}
    ours = digests(num_eval=12, seed=13, **k_shot)
    assert ours == digests(num_eval=12, seed=13, **k_shot)  # a resume reads the same rows
    # another count, MeZO's draw of the same count, and the file whole: other rows
    others = [digests(num_eval=13, seed=13, **k_shot), digests(num_eval=12, seed=13)]
    others.append(digests(seed=13, **k_shot))
    assert all(other["--eval-file"] != ours["--eval-file"] for other in others)
    # the data seed draws other training rows, the same seed-42 evaluation rows
    seed_21 = digests(num_eval=12, seed=21, **k_shot)
    assert seed_21["--train-file"] != ours["--train-file"]
    assert seed_21["--eval-file"] == ours["--eval-file"]
    assert mezo_draw(40, 12, 42) == lm_bff_test_draw(40, 12, 13)  # seed 42's permutation


def test_a_resume_with_another_num_eval_beside_train_per_class_is_refused(tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", sst2_like(20))
    flags = ["--task", "sst2", "--train-file", data, "--eval-file", data, "--device", "cpu"]
    flags += ["--max-steps", "1", "--log-every", "0", "--batch-size", "2"]
    flags += ["--output-dir", str(tmp_path / "run"), "--train-per-class", "2"]
    flags += ["--train-set-seed", "13"]
    with Trainer(resolve([*flags, "--num-eval", "8"])) as trainer:
        trainer.train()
        assert len(trainer.data.eval_examples) == 8
    with pytest.raises(ValueError, match="^--resume: --num-eval 8 -> 9 would change the"):
        Trainer(resolve([*flags, "--num-eval", "9", "--resume"])).train()
