"""The tokens a prompt task scores are the joint text's, as MeZO's: a BPE's space-word token
after a prompt that ends in a space, a SentencePiece word after a newline; a long sequence
keeps its leading special token; a generated answer ends at the end-of-sequence token.

Tokenizers with real merges are trained in code on a few sentences (no download): one
byte-level BPE (GPT-2, OPT, SmolLM2, Qwen) and one SentencePiece-style BPE (Llama-2,
Mistral: words marked by a leading "▁")."""

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from distzo.data.encoding import PromptEncoder
from distzo.data.templates import TASKS, Example, build_examples
from distzo.models.tiny import byte_tokenizer
from distzo.objectives import answer_text

CORPUS = [
    "The man fell because he tripped. I laughed so he cried.",
    "a gripping film It was great",
    "a dull film It was terrible",
    "Cats purr.\nDoes this mean that it is true? Yes or No?\nYes\nNo",
] * 20


def byte_level_bpe() -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's regex
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="</s>", eos_token="</s>")


def sentencepiece_bpe() -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE(byte_fallback=True))
    core.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]  # Llama-2's tokenizer.json
    )
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    core.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"])
    core.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>")


def tokens(tokenizer, ids):
    return tokenizer.convert_ids_to_tokens(list(ids))


def test_a_prompt_ending_in_a_space_scores_the_joint_space_word_tokens():
    tokenizer = byte_level_bpe()
    (copa,) = build_examples(
        TASKS["copa"],
        [
            {
                "premise": "The man fell.",
                "question": "cause",
                "choice1": "He tripped.",
                "choice2": "I laughed.",
                "label": 0,
            }
        ],  # fmt: skip
        "x",
    )
    assert copa.prompt.endswith("because ")  # alone, that space is a token of its own
    encoder = PromptEncoder(tokenizer, max_length=64)
    ids, answer = encoder.encode(copa.prompt, copa.continuations[0])
    assert ids == tokenizer(copa.prompt + copa.continuations[0])["input_ids"]
    assert tokens(tokenizer, ids[-answer:]) == ["Ġhe", "Ġtripped", "."]
    rows = encoder.encode_choices(copa)
    first = [token for row, _, token, choice in rows.scored if choice == 0]
    assert tokens(tokenizer, first) == ["Ġhe", "Ġtripped", "."]
    assert list(rows.rows[0]) == ids


def test_sentencepiece_candidates_are_the_joint_texts_words():
    tokenizer = sentencepiece_bpe()
    encoder = PromptEncoder(tokenizer, max_length=64)
    (sst2,) = build_examples(TASKS["sst2"], [{"sentence": "a gripping film", "label": 1}], "x")
    # " great" alone is ["▁", "▁great"]; after "It was" it is one word: one shared row
    assert tokens(tokenizer, tokenizer(" great", add_special_tokens=False)["input_ids"]) == [
        "▁",
        "▁great",
    ]
    rows = encoder.encode_choices(sst2)
    assert len(rows.rows) == 1 and encoder.shares_prompt(sst2)
    assert tokens(tokenizer, [token for *_, token, _ in rows.scored]) == ["▁terrible", "▁great"]
    joint = tokenizer(sst2.prompt + " great")["input_ids"]
    assert list(rows.rows[0]) == joint[:-1]
    (rte,) = build_examples(
        TASKS["rte"], [{"premise": "Cats purr.", "hypothesis": "it is", "label": 0}], "x"
    )
    ids, answer = encoder.encode(rte.prompt, "Yes")
    # alone, "Yes" is "▁Yes"; after "\n" the joint text has no word marker there
    assert tokens(tokenizer, tokenizer("Yes", add_special_tokens=False)["input_ids"]) == ["▁Yes"]
    assert ids == tokenizer(rte.prompt + "Yes")["input_ids"]
    scored = tokens(tokenizer, ids[-answer:])
    assert "▁Yes" not in scored and "".join(scored).endswith("Yes")


def test_a_cut_sequence_keeps_its_leading_special_token_and_its_answer():
    tokenizer = byte_tokenizer()  # puts </s> first, as OPT's does
    bos = tokenizer.bos_token_id
    encoder = PromptEncoder(tokenizer, max_length=8)
    ids, answer = encoder.encode("a very long prompt indeed", " yes")
    assert len(ids) == 8 and ids[0] == bos and tokenizer.decode(ids[-answer:]) == " yes"
    assert tokenizer.decode(ids[1:-answer]) == "eed"
    ids, answer = encoder.encode("p", " an answer longer than the window")
    assert len(ids) == 8 and ids[0] == bos and tokenizer.decode(ids[1:]) == " an ans"
    prompt = encoder.encode_prompt("a very long prompt indeed", 3)
    assert prompt[0] == bos and tokenizer.decode(prompt[1:]) == "deed"
    example = Example("a very long prompt indeed", (" yes", " no"), 0)
    assert all(row[0] == bos and len(row) == 8 for row in encoder.encode_choices(example).rows)
    with pytest.raises(ValueError, match="max length 1 leaves no room"):
        PromptEncoder(tokenizer, max_length=1)


def test_without_a_leading_special_token_a_cut_answer_keeps_one_prompt_token_before_it():
    """A token is scored from the position before it: an answer filling every position
    (a BPE with no leading special token, GPT-2's) left its first token never scored."""
    tokenizer = byte_level_bpe()
    encoder = PromptEncoder(tokenizer, max_length=4)
    assert (encoder.lead, encoder.answer_room) == (0, 3)
    ids, answer = encoder.encode("It was", " great film It was terrible")
    assert (len(ids), answer) == (4, 3)
    assert tokens(tokenizer, ids) == ["Ġwas", "Ġgreat", "Ġfilm", "ĠIt"]


def test_candidates_sharing_their_first_tokens_are_scored_on_each_of_their_tokens():
    """The prompt alone scores candidates that are one token each; two of several tokens
    that end alike but for their last took one row, scored on their last token only, so
    their mean log-likelihoods left out the tokens they share."""
    encoder = PromptEncoder(byte_tokenizer(), max_length=64)
    encoding = encoder.encode_choices(Example("It was", (" ab", " ac"), 0))
    assert len(encoding.rows) == 2 and len(encoding.scored) == 6
    assert [c for *_, c in encoding.scored] == [0, 0, 0, 1, 1, 1]


def test_a_candidate_with_no_tokens_of_its_own_is_refused():
    """Scored on no token, its mean log-likelihood is no score: refused in one line
    (the templates refuse an empty candidate in a file; an Example built in code reaches
    the encoder as it is)."""
    encoder = PromptEncoder(byte_tokenizer(), max_length=64)
    example = Example("It was", ("", " ok"), 1)
    for encode in (encoder.encode_choices, lambda e: encoder.choices_many([e])[0]):
        with pytest.raises(ValueError, match="candidate '' has no tokens to score"):
            encode(example)


def test_a_tokenizer_that_appends_its_end_token_keeps_its_start_token_and_drops_the_end():
    """Llama's tokenizer with ``add_eos_token`` writes ``<s> text </s>``: a cut sequence lost
    its ``<s>``, every candidate was scored on the ``</s>`` after it, and a SQuAD prompt to
    decode from ended in ``</s>`` (the model answered after an end of sequence)."""
    tokenizer = sentencepiece_bpe()
    tokenizer.add_bos_token = tokenizer.add_eos_token = True
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    encoder = PromptEncoder(tokenizer, max_length=8)
    ids, answer = encoder.encode("Cats purr. Cats purr. Cats purr.", "\nYes")
    assert len(ids) == 8 and ids[0] == bos and eos not in ids
    assert tokenizer.decode(ids[-answer:]).endswith("Yes")
    prompt = encoder.encode_prompt("Cats purr. Cats purr. Cats purr.\nAnswer:", 3)
    assert prompt[0] == bos and prompt[-1] != eos and len(prompt) == 5
    rows = encoder.encode_choices(Example("It was", (" great", " terrible"), 0))
    assert eos not in [token for *_, token, _ in rows.scored]
    text, _ = encoder.encode_text("Cats purr.")  # a raw text row ends where its document does
    assert text[0] == bos and text[-1] == eos
    cut, was_cut = encoder.encode_text("Cats purr. Cats purr. Cats purr.")
    assert was_cut and len(cut) == 8 and cut[0] == bos and cut[-1] == eos


def test_a_tokenizer_with_neither_a_pad_nor_an_end_token_pads_its_batches():
    """Padding is masked out and never scored, so any id fills it: the first batch stopped
    with a TypeError (torch.full of None) after the run directory was written."""
    from distzo.objectives import collate_choices

    tokenizer = byte_level_bpe()
    tokenizer.bos_token = tokenizer.eos_token = None
    assert tokenizer.pad_token_id is None and tokenizer.eos_token_id is None
    encoder = PromptEncoder(tokenizer, max_length=64)
    batch = encoder.collate([encoder.encode("It was", " great"), encoder.encode("I", " cried")])
    assert batch["input_ids"][1, -1] == 0 and batch["attention_mask"][1, -1] == 0
    rows = encoder.encode_choices(Example("He fell because", (" he tripped.", " I cried."), 0))
    assert collate_choices([rows], encoder.pad_id)["input_ids"].shape[0] == 1


def test_a_generated_answer_ends_at_the_end_of_sequence_token():
    tokenizer = byte_tokenizer()
    encoder = PromptEncoder(tokenizer, max_length=64)
    paris = tokenizer(" Paris", add_special_tokens=False)["input_ids"]
    after = tokenizer(" QQQ\nmore", add_special_tokens=False)["input_ids"]
    generated = paris + [tokenizer.eos_token_id] + after
    assert encoder.answer(generated) == " Paris"
    assert answer_text(encoder.answer, generated) == "Paris"
    assert answer_text(encoder.answer, paris + after) == "Paris QQQ"  # the newline cuts


def test_a_generated_answer_ends_at_any_end_of_sequence_token_the_model_lists():
    """A generation config's list (Llama 3 Instruct's ``<|eot_id|>`` beside the tokenizer's
    ``<|end_of_text|>``) ends an answer where ``generate`` stops: an instruct model's answer
    ran on past its end-of-turn token."""
    tokenizer = byte_tokenizer()
    (turn_end,) = tokenizer("|", add_special_tokens=False)["input_ids"]
    encoder = PromptEncoder(tokenizer, max_length=64, stop_ids=(turn_end,))
    paris = tokenizer(" Paris", add_special_tokens=False)["input_ids"]
    after = tokenizer(" QQQ", add_special_tokens=False)["input_ids"]
    assert encoder.answer(paris + [turn_end] + after) == " Paris"
    assert encoder.answer(paris + [tokenizer.eos_token_id] + after) == " Paris"
    assert PromptEncoder(tokenizer, max_length=64).answer(paris + [turn_end]) == " Paris|"


def test_the_trainer_ends_answers_where_the_models_own_generation_config_says(tmp_path):
    """The list comes from the model folder's generation_config.json; a config derived from
    config.json (a random-init shape's defaults: eos 2 is a byte of the tiny tokenizer) adds
    nothing."""
    import json

    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from distzo.config.job import resolve
    from distzo.job.trainer import Trainer
    from tests.helpers.models import LLAMA

    row = {"title": "T", "context": "The code is 4.", "question": "Code?", "answers": ["4"]}
    data = tmp_path / "squad.jsonl"
    data.write_text((json.dumps(row) + "\n") * 4)
    source = tmp_path / "model"
    LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(source)
    byte_tokenizer().save_pretrained(source)
    flags = ["--task", "squad", "--train-file", str(data), "--eval-file", str(data)]
    flags += ["--max-steps", "1", "--batch-size", "2", "--max-new-tokens", "3", "--device", "cpu"]
    stops = {}
    for listed in ([], [7, 9]):
        if listed:
            GenerationConfig(eos_token_id=listed).save_pretrained(source)
        out = tmp_path / f"run{len(listed)}"
        with Trainer(resolve([*flags, "--model", str(source), "--output-dir", str(out)])) as t:
            t.build()
            stops[len(listed)] = t.data.encoder.stop_ids
    eos = byte_tokenizer().eos_token_id
    assert stops == {0: {eos}, 2: {eos, 7, 9}}


def test_whitespace_around_a_field_next_to_the_candidates_changes_nothing_scored():
    """A WiC sentence2 with a trailing space ended the prompt in " \\n", one token alone and
    two in the joint text: each candidate was scored on both whitespace tokens as well as
    its word (SmolLM2: three tokens, not one). A COPA choice's leading space doubled the one
    after "because" and kept its capital (SmolLM2's pick flipped); a trailing one was a
    scored token, as a SQuAD answer's was a label token."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ["The bank. \n", "The bank.\nNo", "The bank.\nYes", "He fell because he tripped. "]
    core.train_from_iterator(corpus * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core)
    assert tokens(tokenizer, tokenizer(". \n")["input_ids"]) == [".", "Ġ\u010a"]  # one alone
    encoder = PromptEncoder(tokenizer, max_length=64)
    wic = {"word": "bank", "sentence1": "The bank.", "sentence2": "The bank.", "label": 0}
    copa = {"premise": "He fell.", "question": "cause", "choice2": "I cried.", "label": 0}
    squad = {"title": "T", "context": "C", "question": "Q?", "answers": ["Paris"]}
    padded = [
        ("wic", wic, {"sentence1": " The bank. ", "sentence2": "The bank. "}),
        ("copa", {**copa, "choice1": "He tripped."}, {"choice1": " He tripped. "}),
        ("copa", {**copa, "choice1": "He tripped."}, {"choice2": " I cried. "}),
        ("squad", squad, {"answers": [" Paris "]}),
    ]
    for task, clean, spaced in padded:
        (want,) = build_examples(TASKS[task], [clean], "x")
        (got,) = build_examples(TASKS[task], [{**clean, **spaced}], "x")
        assert (got.prompt, got.continuations) == (want.prompt, want.continuations), task
    (example,) = build_examples(TASKS["wic"], [{**wic, "sentence2": "The bank. "}], "x")
    scored = [token for *_, token, _ in encoder.encode_choices(example).scored]
    assert tokens(tokenizer, scored) == ["No", "Yes"]  # not ["Ġ", "Ċ", "No", "Ġ", "Ċ", "Yes"]


def test_a_folder_without_a_generation_config_ends_answers_at_its_config_end_tokens(tmp_path):
    """Without generation_config.json, ``generate`` stops at config.json's list (Gemma 3's
    ``<eos>`` and ``<end_of_turn>``): an answer ran on past the end-of-turn token, which the
    decoding dropped as a special token ("Paris and more" for "Paris"). An id of that list
    that is a plain character of the tokenizer still ends nothing."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    from distzo.config.job import resolve
    from distzo.job.trainer import Trainer
    from tests.helpers.models import LLAMA

    row = {"title": "T", "context": "The code is 4.", "question": "Code?", "answers": ["4"]}
    data = tmp_path / "squad.jsonl"
    data.write_text((json.dumps(row) + "\n") * 4)
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<end_of_turn>"]})
    turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    source = tmp_path / "model"
    config = LlamaConfig(**{**LLAMA, "vocab_size": len(tokenizer), "eos_token_id": [1, 7, turn]})
    LlamaForCausalLM(config).save_pretrained(source)
    tokenizer.save_pretrained(source)
    (source / "generation_config.json").unlink()
    flags = ["--task", "squad", "--train-file", str(data), "--eval-file", str(data)]
    flags += ["--max-steps", "1", "--batch-size", "2", "--max-new-tokens", "3", "--device", "cpu"]
    flags += ["--model", str(source), "--output-dir", str(tmp_path / "run")]
    with Trainer(resolve(flags)) as t:
        t.build()
        encoder = t.data.encoder
    assert encoder.stop_ids == {tokenizer.eos_token_id, turn}  # 7 is a byte
    paris = tokenizer(" Paris", add_special_tokens=False)["input_ids"]
    more = tokenizer(" and more", add_special_tokens=False)["input_ids"]
    assert encoder.answer(paris + [turn] + more) == " Paris"


def test_an_added_special_token_is_special_and_an_added_plain_one_is_not():
    """An instruct model's end-of-turn token is an added token marked special, which the
    tokenizer's ``all_special_ids`` leaves out (Gemma's ``<end_of_turn>``): it ends answers
    where config.json lists it; an added token not marked special is text, and ends none."""
    from tokenizers import AddedToken

    from distzo.models.weights import special_ids

    tokenizer = byte_tokenizer()
    tokenizer.add_tokens([AddedToken("<end_of_turn>", special=True), AddedToken("<b>")])
    turn, plain = tokenizer.convert_tokens_to_ids(["<end_of_turn>", "<b>"])
    assert turn not in tokenizer.all_special_ids
    assert special_ids(tokenizer) == {*tokenizer.all_special_ids, turn}
    assert plain not in special_ids(tokenizer) and special_ids(None) == frozenset()


def test_no_texts_encode_to_no_ids_without_a_tokenizer_call():
    """A fast tokenizer's batch call on no texts fails inside it (an IndexError): an empty
    batch of prompts, texts or examples is no ids, as it is no work."""
    encoder = PromptEncoder(byte_tokenizer(), max_length=16)
    assert encoder.encode_prompts([], 4) == []
    assert list(encoder.encode_texts([])) == [] and list(encoder.joints([])) == []
