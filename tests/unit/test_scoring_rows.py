"""A scoring run (``--max-steps 0``) trains on no row: its build tokenizes none of the
training rows (minutes on every rank for a hub split of a million) and warns of no cut in
them, while the rows are still read, checked and digested as a training run's are."""

import json

import pytest

from distzo.config.job import JobConfig
from distzo.data.encoding import PromptEncoder
from distzo.data.masked_prompts import MaskedPromptEncoder
from distzo.data.task_data import LoadedRows, load_task_rows, rows_digest
from distzo.data.templates import Example, MaskedExample
from distzo.job.build import build_task_data, default_model_config
from distzo.models.tiny import byte_tokenizer
from tests.helpers.launch import train_in_process
from tests.helpers.rows import write_jsonl

LONG = {"sentence": "a training row far longer than the limit " * 3, "label": 1}
EVAL = [{"sentence": "fine", "label": 1}, {"sentence": "bad", "label": 0}]


def test_a_scoring_run_warns_of_no_training_row_and_digests_the_rows_alike(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [LONG, {"sentence": "ok", "label": 0}])
    evals = write_jsonl(tmp_path / "eval.jsonl", EVAL)
    argv = ["--task", "sst2", "--train-file", train, "--eval-file", evals, "--max-length", "40"]
    argv += ["--batch-size", "2", "--eval-batch-size", "2", "--log-every", "0", "--device", "cpu"]
    stderr, digests = {}, {}
    for steps in ("1", "0"):
        out = tmp_path / f"steps{steps}"
        proc = train_in_process([*argv, "--max-steps", steps, "--output-dir", str(out)])
        assert proc.returncode == 0, proc.stderr[-2000:]
        stderr[steps] = proc.stderr
        header = json.loads((out / "seedlog.jsonl").read_text().splitlines()[0])
        digests[steps] = (header["train_rows"], header["eval_rows"])
    notice = "--train-file: 1 of 2 rows are longer than 40 tokens"
    assert notice in stderr["1"]
    assert "--train-file:" not in stderr["0"]
    loaded = load_task_rows("sst2", train, evals)
    assert loaded is not None
    assert digests["0"] == digests["1"] == (rows_digest(loaded.train), rows_digest(loaded.eval))


def _scoring_job(task: str) -> JobConfig:
    job = JobConfig()
    job.data.task, job.optim.max_steps = task, 0
    return job


def _sentences(examples) -> set[str]:
    return {e.prompt if isinstance(e, Example) else e.sentences[0] for e in examples}


@pytest.mark.parametrize("objective", ["classification", "lm"])
def test_a_scoring_build_tokenizes_the_evaluated_rows_alone(tmp_path, monkeypatch, objective):
    train = write_jsonl(tmp_path / "train.jsonl", [LONG] * 3)
    evals = write_jsonl(tmp_path / "eval.jsonl", EVAL)
    loaded = load_task_rows("sst2", train, evals)
    assert loaded is not None
    seen: list[Example] = []
    joints = PromptEncoder.joints

    def spied(self, examples):
        seen.extend(examples)
        return joints(self, examples)

    monkeypatch.setattr(PromptEncoder, "joints", spied)
    job = _scoring_job("sst2")
    job.optim.objective, job.data.max_length = objective, 40
    data = build_task_data(job, loaded, byte_tokenizer(), default_model_config("sst2"), 0)
    assert seen and _sentences(seen) == _sentences(loaded.eval)
    assert data.cut_notices == ()
    # the memory plan's figures: the evaluation's alone (the long row would fill 40)
    assert data.rows_per_example == 0 and data.longest < 40
    job.optim.max_steps = 1  # a training run's build: the same rows, tokenized and counted
    trained = build_task_data(job, loaded, byte_tokenizer(), default_model_config("sst2"), 0)
    assert _sentences(seen) == _sentences(loaded.eval) | _sentences(loaded.train)
    assert trained.cut_notices[0].startswith("--train-file: 3 of 3 rows are longer than 40")
    assert trained.rows_per_example >= 1 and trained.longest == 40


def test_a_scoring_build_of_the_text_task_tokenizes_no_training_row(tmp_path, monkeypatch):
    rows = LoadedRows("text", ["t" * 60, "u" * 60], ["short", "row"])
    seen: list[str] = []
    encode = PromptEncoder.encode_texts

    def spied(self, texts):
        seen.extend(texts)
        return encode(self, texts)

    monkeypatch.setattr(PromptEncoder, "encode_texts", spied)
    job = _scoring_job("text")
    job.data.max_length = 24
    data = build_task_data(job, rows, byte_tokenizer(), default_model_config("text"), 0)
    assert sorted(seen) == ["row", "short"] and data.cut_notices == ()
    assert data.rows_per_example == 0 and data.longest == len("short") + 1
    with pytest.raises(RuntimeError, match=r"^a scoring run \(--max-steps 0\) has no training"):
        data.batch(2, 0)


def test_a_scoring_build_of_a_masked_lm_encodes_no_training_row(monkeypatch):
    from transformers import RobertaConfig

    from tests.helpers.masked_prompts import roberta_tokenizer

    train = [MaskedExample(("a training sentence " * 40,), 1) for _ in range(2)]
    rows = LoadedRows("sst2", train, [MaskedExample(("fine",), 1)])
    seen: list[MaskedExample] = []
    encode = MaskedPromptEncoder.encode_ids

    def spied(self, examples):
        seen.extend(examples)
        return encode(self, examples)

    monkeypatch.setattr(MaskedPromptEncoder, "encode_ids", spied)
    tokenizer = roberta_tokenizer()
    config = RobertaConfig(vocab_size=len(tokenizer), max_position_embeddings=130)
    data = build_task_data(_scoring_job("sst2"), rows, tokenizer, config, 0)
    assert seen == rows.eval and data.cut_notices == () and data.rows_per_example == 0


def test_ranks_sharing_a_scoring_pass_read_the_evaluated_rows_alone():
    """The ranks' shared pass over the lengths (``RowShare.meet``, a collective) skips the
    training rows on every rank alike: the parts meet over the evaluated rows, and their
    counts are one scoring pass's."""
    import threading

    from distzo.data.row_share import RowShare
    from distzo.data.task_data import PromptData
    from distzo.dist.agreement import gathered
    from tests.unit.test_prompt_build_cost import CountingTokenizer
    from tests.unit.test_shared_row_pass import ThreadGroup, copa_rows

    loaded = LoadedRows("copa", copa_rows(50), copa_rows(11))
    whole = CountingTokenizer(byte_tokenizer())
    alone = PromptData(loaded, PromptEncoder(whole, 24), 0, 2, 4, "classification", trains=False)
    trained = PromptData(loaded, PromptEncoder(byte_tokenizer(), 24), 0, 2, 4, "classification")
    assert trained.cut_notices[1:] == alone.cut_notices  # the --eval-file line alone
    assert alone.cut_notices[0].startswith("--eval-file: ") and alone.rows_per_example == 0
    group, built = ThreadGroup(3), [None, None, None]

    def run(part: int) -> None:
        tokenizer, comm = CountingTokenizer(byte_tokenizer()), group.member(part)
        share = RowShare(part, 3, lambda compute: gathered(comm, compute))
        data = PromptData(
            loaded, PromptEncoder(tokenizer, 24), 0, 2, 4, "classification", share, False
        )
        built[part] = (data, tokenizer.texts)

    threads = [threading.Thread(target=run, args=(part,)) for part in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    probe = CountingTokenizer(byte_tokenizer())
    PromptEncoder(probe, 24)  # its probe of the special tokens
    for data, _ in built:
        assert (data.cut_notices, data.longest, data.eval_rows) == (
            alone.cut_notices,
            alone.longest,
            alone.eval_rows,
        )
    # 11 evaluated rows x 3 texts a row, split over the parts; no training row's
    assert whole.texts - probe.texts == 33
    assert sum(texts - probe.texts for _, texts in built) == 33
