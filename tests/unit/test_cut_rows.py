"""Rows longer than the token limit: cut from the left as MeZO cuts them, and counted in one
warning line per file (MeZO warns "Exceed max length"); the run cut them silently."""

from distzo.data.encoding import PromptEncoder
from distzo.data.task_data import LoadedRows, PromptData, TextData, load_task_rows
from distzo.data.templates import Example
from distzo.models.tiny import byte_tokenizer
from tests.helpers.rows import write_jsonl


def prompt_data(
    tmp_path, task, train, evals, objective=None, max_new_tokens=4, max_length=24
) -> PromptData:
    loaded = load_task_rows(
        task, write_jsonl(tmp_path / "t.jsonl", train), write_jsonl(tmp_path / "e.jsonl", evals)
    )
    assert loaded is not None
    encoder = PromptEncoder(byte_tokenizer(), max_length)
    return PromptData(loaded, encoder, 0, 2, max_new_tokens, objective)


def test_each_file_names_how_many_of_its_rows_the_limit_cuts(tmp_path):
    long, short = {"sentence": "x" * 30, "label": 1}, {"sentence": "ok", "label": 0}
    data = prompt_data(tmp_path, "sst2", [long, short, long], [short])
    assert data.cut_notices == (
        "--train-file: 2 of 3 rows are longer than 24 tokens (--max-length, or the model's "
        "positions): they lose tokens from the left; raise --max-length or shorten the rows",
    )
    assert prompt_data(tmp_path, "sst2", [short], [short]).cut_notices == ()


def test_an_answer_longer_than_the_limit_is_said_to_lose_its_end(tmp_path):
    row = {"premise": "It fell.", "question": "cause", "choice1": "a" * 40, "choice2": "b"}
    rows = [{**row, "label": 1}, {**row, "label": 0}]
    (train, evals) = prompt_data(tmp_path, "copa", rows, rows).cut_notices
    assert train.startswith("--train-file: 1 of 2 rows") and "1 of them lose the end" in train
    assert evals.startswith("--eval-file: 2 of 2 rows") and "2 of them lose the end" in evals


def test_a_squad_evaluation_counts_its_prompts_against_the_room_left_to_decode(tmp_path):
    """A SQuAD prompt of 40 tokens fits 64 with its answer to train on, and not 64 less the
    30 to decode."""
    row = {"title": "T", "context": "ctx", "question": "Q?", "answers": ["x"]}
    (evals,) = prompt_data(tmp_path, "squad", [row], [row], None, 30, 64).cut_notices
    assert evals.startswith("--eval-file: 1 of 1 rows are longer than 34 tokens (")
    assert "less --max-new-tokens 30)" in evals
    (train, _) = prompt_data(tmp_path, "squad", [row], [row], "f1", 30, 64).cut_notices
    assert train.startswith("--train-file: 1 of 1 rows are longer than 34 tokens")


def test_text_rows_longer_than_the_limit_are_counted(tmp_path):
    rows = [{"text": "y" * 40}, {"text": "short row"}]
    loaded = load_task_rows(
        "text", write_jsonl(tmp_path / "t.jsonl", rows), write_jsonl(tmp_path / "e.jsonl", rows)
    )
    assert loaded is not None
    data = TextData(loaded, PromptEncoder(byte_tokenizer(), max_length=24), 0, 2)
    assert [line[:36] for line in data.cut_notices] == [
        "--train-file: 1 of 2 rows are longer",
        "--eval-file: 1 of 2 rows are longer ",
    ]


def test_a_text_row_of_exactly_the_limit_is_not_counted(tmp_path):
    rows = [{"text": "y" * 23}]  # 23 bytes after the leading </s>: 24 tokens, all kept
    loaded = load_task_rows(
        "text", write_jsonl(tmp_path / "t.jsonl", rows), write_jsonl(tmp_path / "e.jsonl", rows)
    )
    assert loaded is not None
    data = TextData(loaded, PromptEncoder(byte_tokenizer(), max_length=24), 0, 2)
    assert data.train.width == 24 and data.cut_notices == ()


def test_a_squad_plan_holds_the_answer_decoded_after_the_longest_prompt(tmp_path):
    """The memory plan's longest sequence: an evaluation decodes ``--max-new-tokens``
    after its prompt, within the token limit."""
    row = {"title": "T", "context": "ctx", "question": "Q?", "answers": ["x"]}
    joint = prompt_data(tmp_path, "squad", [row], [row], None, 4, 256).longest - 4
    assert joint > 4
    assert prompt_data(tmp_path, "squad", [row], [row], None, 9, 256).longest == joint + 9
    assert prompt_data(tmp_path, "squad", [row], [row], None, 9, joint + 5).longest == joint + 5


def test_the_plan_holds_the_longest_candidate_whichever_its_place():
    example = Example("p", (" a", " bbbb"), 0)  # joints of 4 and 7 tokens
    encoder = PromptEncoder(byte_tokenizer(), 64)
    assert PromptData(LoadedRows("sst2", [example], [example]), encoder, 0, 2).longest == 7


def test_sequences_of_exactly_the_limit_lose_nothing_and_are_not_counted():
    """The limits are inclusive: a joint sequence of ``max_length`` tokens, an answer of
    ``answer_room`` and a prompt of ``max_length`` less ``--max-new-tokens`` keep every
    token, so no warning counts them; one token more does."""
    tokenizer = byte_tokenizer()  # a byte a token, after a leading </s>

    def notices(task, example, max_length, objective=None):
        encoder = PromptEncoder(tokenizer, max_length)
        loaded = LoadedRows(task, [example], [example])
        return PromptData(loaded, encoder, 0, 2, 4, objective).cut_notices

    longest = Example("p" * 10, (" a", " bb"), 1)  # joints of 13 and 14 tokens
    assert notices("sst2", longest, 14) == () and len(notices("sst2", longest, 13)) == 2
    answer = Example("p", (" " + "a" * 12, " b"), 0)  # a 13-token answer, 15 in all
    (train, evals) = notices("sst2", answer, 14)
    assert "lose the end" not in train + evals
    assert "lose the end" in notices("sst2", answer, 13)[0]
    prompt = Example("Q: " + "q" * 10, (" y",), 0)  # 14 tokens, 4 more decoded
    assert notices("squad", prompt, 18, "f1") == ()
    assert len(notices("squad", prompt, 17, "f1")) == 2


def test_the_run_warns_of_the_cut_rows_before_it_trains(tmp_path, caplog):
    from distzo.config.job import resolve
    from distzo.job.trainer import Trainer

    rows = [{"sentence": "a long review " * 4, "label": 1}, {"sentence": "ok", "label": 0}]
    data = write_jsonl(tmp_path / "sst2.jsonl", rows)
    argv = ["--task", "sst2", "--train-file", data, "--eval-file", data, "--max-length", "24"]
    with caplog.at_level("WARNING", logger="distzo.train"):
        with Trainer(resolve([*argv, "--output-dir", str(tmp_path / "run")])) as trainer:
            trainer.build()
    warned = [r.getMessage()[:35] for r in caplog.records if r.levelname == "WARNING"]
    assert warned == ["--train-file: 1 of 2 rows are longe", "--eval-file: 1 of 2 rows are longer"]


def test_the_tokenizers_own_length_warning_stays_quiet(capfd, caplog):
    """Past ``model_max_length`` transformers warns that the sequence "will result in
    indexing errors": false where the encoder cuts it (and the run counts the cut rows)."""
    tokenizer = byte_tokenizer()
    tokenizer.model_max_length = 16
    encoder = PromptEncoder(tokenizer, max_length=16)
    with caplog.at_level("WARNING"):
        ids, answer = encoder.encode("a prompt well past the limit", " great")
    assert len(ids) == 16 and answer == 6
    assert "indexing errors" not in capfd.readouterr().err + caplog.text


def test_candidates_the_cut_makes_the_same_tokens_are_counted(tmp_path):
    """Two COPA choices that differ only past the room left for an answer are cut to the
    same tokens: scored alike, the row can only be a tie's pick."""
    same_start = "the wind blew the door open and "
    row = {"premise": "It fell.", "question": "cause", "label": 0}
    alike = {**row, "choice1": same_start + "shut", "choice2": same_start + "stuck"}
    apart = {**row, "choice1": "x" * 40, "choice2": "y" * 40}
    (train, evals) = prompt_data(tmp_path, "copa", [alike], [alike, apart]).cut_notices
    # COPA trains LM-style, on the right choice alone: no other candidate is scored there
    assert "1 of them lose the end" in train and "same tokens" not in train
    assert "2 of them lose the end of their answer too, and in 1 the candidates become the " in (
        evals
    )
    assert "same tokens, which no model can tell apart; raise --max-length" in evals
    assert prompt_data(tmp_path, "copa", [alike], [alike], max_length=80).cut_notices == ()
