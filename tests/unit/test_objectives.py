"""Objectives: MeZO's classification loss, its non-differentiable accuracy and F1, and the
LM head read only at the positions the labels need."""

import weakref

import pytest
import torch

from distzo import ZOConfig, ZOEngine
from distzo.data.encoding import (
    ChoiceTrainData,
    PromptEncoder,
    PromptOnlyTrainData,
    PromptTrainData,
)
from distzo.data.templates import TASKS, Example, build_examples
from distzo.dist import ParallelContext
from distzo.engine import RESIDENT_BLOCK_ID, UNPERTURBED
from distzo.job.evaluation import evaluate_choices, evaluate_generation, evaluate_lm
from distzo.models.tiny import byte_tokenizer
from distzo.objectives import (
    F1,
    Accuracy,
    Classification,
    HeadTargets,
    LanguageModeling,
    answer_text,
    collate_choices,
    collate_prompts,
    greedy_decode,
    picked_log_probs,
)
from distzo.objectives.choice import prepare_choices
from distzo.objectives.generation import prepare_prompts
from tests.helpers.models import random_batch, tiny_opt

TOKENIZER = byte_tokenizer()
SINGLE = ParallelContext.single()


def DECODE(ids):
    return TOKENIZER.decode(ids, skip_special_tokens=True)


def model(seed=3, dtype=torch.float32):
    return tiny_opt(seed=seed, dtype=dtype, vocab_size=len(TOKENIZER), max_position_embeddings=256)


def rte_examples(n=6):
    rows = [
        {"premise": f"Fact {i}.", "hypothesis": f"Claim {i % 3}.", "label": i % 2} for i in range(n)
    ]
    # "Yes" / "No": several tokens, a row per candidate
    return build_examples(TASKS["rte"], rows, "x")


def letter_examples(n=6):
    # One byte per candidate: one row per example scores all three (the shared-prompt path).
    return [Example(f"Pick for item {i}:", ("A", "B", "C"), i % 3) for i in range(n)]


def reference_scores(reference, example):
    """Mean log-likelihood of each candidate's tokens, one plain forward per candidate."""
    scores = []
    with torch.no_grad():
        for continuation in example.continuations:
            prompt = TOKENIZER(example.prompt)["input_ids"]
            answer = TOKENIZER(continuation, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([prompt + answer])
            log_probs = torch.log_softmax(reference(input_ids=ids).logits[0, :-1].double(), -1)
            picked = log_probs[torch.arange(ids.shape[1] - 1), ids[0, 1:]][-len(answer) :]
            scores.append(picked.mean())
    return torch.stack(scores)


def objective_value(engine, objective, batch):
    prepared = objective.prepare(batch, engine.device)
    examples = objective.num_items(batch)
    return engine.evaluate(
        lambda runner: objective.losses(runner, prepared, (UNPERTURBED,), examples)
    )[UNPERTURBED]


@pytest.mark.parametrize(
    "examples", [rte_examples(), letter_examples()], ids=["row_per_candidate", "shared_prompt"]
)
def test_classification_loss_is_the_cross_entropy_over_candidate_scores(examples):
    encoder = PromptEncoder(TOKENIZER, max_length=256)
    engine = ZOEngine(model(), ZOConfig(device="cpu", seed=0))
    batch = collate_choices([encoder.encode_choices(e) for e in examples], encoder.pad_id)
    got = objective_value(engine, Classification(), batch).item()

    reference = model().eval()
    losses = []
    for e in examples:
        scores = reference_scores(reference, e)
        losses.append(-torch.log_softmax(scores, 0)[e.label])
    assert got == pytest.approx(torch.stack(losses).mean().item(), rel=1e-5)
    rows = batch["input_ids"].shape[1]
    assert rows == (1 if examples[0].continuations == ("A", "B", "C") else 2)


def test_accuracy_objective_counts_the_best_scored_candidates():
    examples = rte_examples(8)
    encoder = PromptEncoder(TOKENIZER, max_length=256)
    engine = ZOEngine(model(), ZOConfig(device="cpu", seed=0))
    batch = collate_choices([encoder.encode_choices(e) for e in examples], encoder.pad_id)
    reference = model().eval()
    right = sum(int(reference_scores(reference, e).argmax()) == e.label for e in examples)
    assert objective_value(engine, Accuracy(), batch).item() == pytest.approx(
        -right / len(examples)
    )
    assert 0 < right < len(examples)  # neither all right nor all wrong: the count is exercised


def perturbed_engine(engine, sign, eps, step=0):
    """A fresh engine holding theta + sign * eps * z (the step's own noise, drawn the same way)."""
    params = engine.named_parameters()
    state = engine.state_dict()
    layouts = [(engine.resident_layout, RESIDENT_BLOCK_ID)] + [
        (layout, i + 1) for i, layout in enumerate(engine.block_layouts)
    ]
    for layout, block_id in layouts:
        z = engine.noise.full(layout.numel, step=step, block_id=block_id)
        for entry in layout.entries:
            flat = params[entry.names[0]].reshape(-1)
            perturbed = torch.add(
                flat, z[entry.offset : entry.offset + entry.numel], alpha=sign * eps
            )
            state["params"][entry.names[0]] = perturbed.view(entry.shape)
    other = ZOEngine(model(), ZOConfig(device="cpu", seed=0, noise_chunk=engine.config.noise_chunk))
    other.load_state_dict(state)
    return other


def test_accuracy_objective_equals_the_evaluation_of_each_perturbed_model():
    examples = rte_examples(12)
    encoder = PromptEncoder(TOKENIZER, max_length=256)
    eps = 0.3  # large enough that the two perturbed models disagree somewhere (with seed 2's z)
    engine = ZOEngine(
        model(),
        ZOConfig(device="cpu", seed=2, eps=eps, lr=0.0, noise_chunk=4096),
        objective=Accuracy(),
    )
    plus, minus = perturbed_engine(engine, 1, eps), perturbed_engine(engine, -1, eps)
    batch = ChoiceTrainData(examples, encoder, seed=0).batch(len(examples), 0)
    result = engine.step(batch)
    whole = len(examples) * 2  # every candidate row of the set in one call, as in the step
    assert -result.loss_plus == pytest.approx(
        evaluate_choices(plus, examples, encoder, SINGLE, whole)["eval_accuracy"]
    )
    assert -result.loss_minus == pytest.approx(
        evaluate_choices(minus, examples, encoder, SINGLE, whole)["eval_accuracy"]
    )
    assert result.loss_plus != result.loss_minus and result.projected_grad != 0


def squad_examples(n=4):
    rows = [
        {
            "title": "T",
            "context": f"The code is {i}.",
            "question": "What?",
            "answers": [f"code {i}"],
        }
        for i in range(n)
    ]
    return build_examples(TASKS["squad"], rows, "x")


def greedy_answers(engine, examples, encoder, new_tokens):
    prompts = [encoder.encode_prompt(e.prompt, new_tokens) for e in examples]
    prepared = prepare_prompts(
        collate_prompts(prompts, range(len(examples)), new_tokens, encoder.pad_id), engine.device
    )
    tokens = engine.evaluate(
        lambda runner: greedy_decode(runner, prepared, (UNPERTURBED,))[UNPERTURBED]
    )
    return [answer_text(DECODE, row) for row in tokens.tolist()]


def test_f1_objective_equals_the_evaluation_of_each_perturbed_model():
    encoder = PromptEncoder(TOKENIZER, max_length=256)
    eps, new_tokens = 0.3, 4
    engine = ZOEngine(model(), ZOConfig(device="cpu", seed=7, eps=eps, lr=0.0, noise_chunk=4096))
    plus, minus = perturbed_engine(engine, 1, eps), perturbed_engine(engine, -1, eps)
    # Gold answers made of what the + model says for half the rows: F1 is then neither 0 nor 1.
    said = greedy_answers(plus, squad_examples(), encoder, new_tokens)
    examples = [
        Example(e.prompt, e.continuations, 0, (said[i] + " extra",) if i % 2 == 0 else ("zzz",))
        for i, e in enumerate(squad_examples())
    ]

    engine.objective = F1(DECODE, [e.answers for e in examples])
    batch = PromptOnlyTrainData(examples, encoder, seed=0, max_new_tokens=new_tokens).batch(
        len(examples), 0
    )
    result = engine.step(batch)
    expected_plus = evaluate_generation(plus, examples, encoder, SINGLE, len(examples), new_tokens)[
        "eval_f1"
    ]
    expected_minus = evaluate_generation(
        minus, examples, encoder, SINGLE, len(examples), new_tokens
    )["eval_f1"]
    assert -result.loss_plus == pytest.approx(expected_plus)
    assert -result.loss_minus == pytest.approx(expected_minus)
    assert 0 < expected_plus < 1 and expected_plus != expected_minus


def test_greedy_decoding_equals_the_models_own_forward_token_by_token():
    """Each row of a right-padded batch of prompts of several lengths decodes what the
    model's own forward picks, one argmax at a time, for its prompt alone."""
    encoder, new_tokens = PromptEncoder(TOKENIZER, max_length=256), 4
    prompts = [encoder.encode_prompt(f"Q{i}: {'word ' * i}?", new_tokens) for i in range(3)]
    engine = ZOEngine(model(dtype=torch.float64), ZOConfig(device="cpu", seed=7, lr=0.0))
    prepared = prepare_prompts(
        collate_prompts(prompts, range(len(prompts)), new_tokens, encoder.pad_id), engine.device
    )
    tokens = engine.evaluate(
        lambda runner: greedy_decode(runner, prepared, (UNPERTURBED,))[UNPERTURBED]
    )
    reference = model(dtype=torch.float64).eval()
    for row, prompt in zip(tokens.tolist(), prompts):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(new_tokens):
                ids.append(int(reference(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        assert row == ids[len(prompt) :]


def test_a_batch_without_labels_is_scored_on_its_real_tokens_only():
    """``lm`` with no labels is a plain causal LM: every visible token, never padding, as
    if the labels were the ids with -100 on the padding."""
    labelled = random_batch(len(TOKENIZER), pad="right", seed=1)
    plain = {k: labelled[k] for k in ("input_ids", "attention_mask")}
    objective = LanguageModeling()
    assert objective.num_items(plain) == objective.num_items(labelled) == 35
    config = ZOConfig(device="cpu", seed=1, lr=1e-3, eps=1e-3)
    steps = [ZOEngine(model(), config).step(batch) for batch in (labelled, plain)]
    assert steps[0].losses == steps[1].losses


def step_results(objective, batches, dtype=torch.float64):
    engine = ZOEngine(
        model(dtype=dtype), ZOConfig(device="cpu", seed=1, lr=1e-3, eps=1e-3), objective=objective
    )
    return [engine.step(b) for b in batches], engine


@pytest.mark.parametrize("make", [LanguageModeling, Classification], ids=["lm", "classification"])
def test_the_head_at_label_positions_equals_the_full_head(make):
    encoder = PromptEncoder(TOKENIZER, max_length=256)
    examples = rte_examples(8)
    data = (ChoiceTrainData if make is Classification else PromptTrainData)(
        examples, encoder, seed=0
    )
    batches = [data.batch(4, step) for step in range(3)]
    at_labels, engine = step_results(make(), batches, torch.float32)
    full, full_engine = step_results(make(full_head=True), batches, torch.float32)
    for a, b in zip(at_labels, full, strict=True):
        assert a.loss_plus == pytest.approx(b.loss_plus, rel=1e-6)
        assert a.loss_minus == pytest.approx(b.loss_minus, rel=1e-6)
        # g magnifies by 1/(2 eps)
        assert a.projected_grad == pytest.approx(b.projected_grad, rel=1e-3, abs=1e-3)
    heads = [
        evaluate_choices(e, examples, encoder, SINGLE, 4, full_head=f)
        for e, f in ((engine, False), (full_engine, True))
    ]
    assert heads[0] == heads[1]
    lm_batch = PromptTrainData(examples, encoder, seed=0).batch(8, 0)
    lm = [evaluate_lm(engine, lm_batch, SINGLE, 3, full_head=f) for f in (False, True)]
    assert lm[0]["eval_loss"] == pytest.approx(lm[1]["eval_loss"], rel=1e-6)
    assert lm[0]["eval_accuracy"] == lm[1]["eval_accuracy"]


def test_head_at_labels_in_float64_gives_the_same_g():
    encoder = PromptEncoder(TOKENIZER, max_length=256)
    batches = [ChoiceTrainData(rte_examples(8), encoder, seed=0).batch(4, s) for s in range(3)]
    at_labels, _ = step_results(Classification(), batches)
    full, _ = step_results(Classification(full_head=True), batches)
    for a, b in zip(at_labels, full, strict=True):
        assert a.projected_grad == pytest.approx(b.projected_grad, rel=1e-9)


def test_the_lm_objective_reads_the_head_only_at_label_positions():
    encoder = PromptEncoder(TOKENIZER, max_length=256)
    batch = PromptTrainData(rte_examples(4), encoder, seed=0).batch(4, 0)
    prepared = LanguageModeling().prepare(batch, torch.device("cpu"))
    labels = int((batch["labels"][:, 1:] != -100).sum())
    assert prepared.targets.positions.numel() == labels < batch["input_ids"].numel() / 5


def test_single_token_candidates_share_one_head_position_per_example():
    encoder = PromptEncoder(TOKENIZER, max_length=256)
    batch = collate_choices([encoder.encode_choices(e) for e in letter_examples(5)], encoder.pad_id)
    prepared = prepare_choices(batch, torch.device("cpu"))
    assert prepared.targets.positions.numel() == 5 and prepared.targets.num_entries == 15
    assert batch["input_ids"].shape[:2] == (5, 1)


def test_a_batch_of_another_form_is_a_clear_error():
    engine = ZOEngine(model(), ZOConfig(device="cpu", seed=0), objective=Classification())
    ids = torch.randint(3, 200, (2, 8))
    with pytest.raises(
        ValueError, match="lacks score_position, score_token, score_candidate, label"
    ):
        engine.step({"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def test_each_head_chunk_is_freed_before_the_next_chunk_runs(monkeypatch):
    """The head runs HEAD_CHUNK positions at a time so that its float32 logits stay one
    chunk's: when the next chunk's head runs, the last chunk's logits and log-softmax are
    gone (held across the loop they added 0.16 GB to the H100's peak at Qwen3-1.7B)."""
    vocab, width, n = 50, 8, 10
    weight = torch.randn(vocab, width, generator=torch.Generator().manual_seed(0))
    made, alive_at_each_head = [], []  # weakrefs of every chunk-sized tensor so far

    class Runner:
        def head(self, p, hidden):
            alive_at_each_head.append(sum(ref() is not None for ref in made))
            logits = hidden @ weight.T
            made.append(weakref.ref(logits))
            return logits

    log_softmax = torch.log_softmax

    def kept(x, *args, **kwargs):
        out = log_softmax(x, *args, **kwargs)
        made.append(weakref.ref(out))
        return out

    monkeypatch.setattr(torch, "log_softmax", kept)
    tokens = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1))
    targets = HeadTargets.build(torch.arange(n), tokens, None, torch.device("cpu"), chunk=3)
    hidden = torch.randn(1, n, width, generator=torch.Generator().manual_seed(2))
    picked, hits = picked_log_probs(Runner(), UNPERTURBED, hidden, targets, with_hits=True)
    assert alive_at_each_head == [0, 0, 0, 0]  # four chunks of at most 3 positions
    full = log_softmax(hidden[0] @ weight.T, dim=-1)  # (one matmul: rounded otherwise)
    torch.testing.assert_close(picked, full[torch.arange(n), tokens])
    assert torch.equal(hits, full.argmax(-1) == tokens)


class MatrixHead:
    """A pass runner's LM head alone: ``hidden @ weight.T``."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def head(self, p, hidden):
        return hidden @ self.weight.T


def test_a_float64_models_picked_log_probs_stay_float64():
    """A ZO step differences two nearly equal losses: a float64 model's log-probabilities
    are not rounded to float32 on the way (g would lose half its digits)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 8, dtype=torch.float64, generator=generator)
    hidden = torch.randn(2, 3, 8, dtype=torch.float64, generator=generator)
    positions, tokens = torch.tensor([0, 4, 5]), torch.tensor([7, 1, 30])
    targets = HeadTargets.build(positions, tokens, None, torch.device("cpu"))
    picked, _ = picked_log_probs(MatrixHead(weight), UNPERTURBED, hidden, targets)
    expected = torch.log_softmax(hidden.reshape(6, 8) @ weight.T, -1)[positions, tokens]
    assert picked.dtype == torch.float64
    assert torch.allclose(picked, expected, rtol=1e-14, atol=0)


def test_an_answer_scores_against_its_best_gold_answer_not_the_first(monkeypatch):
    """SQuAD lists several gold answers; the F1 objective and the evaluation (F1 and exact
    match) take the best of them."""
    from distzo.job import generation_evaluation

    f1 = F1(lambda ids: "Paris", [["Lyon", "the city of Paris"]])
    assert f1.score(torch.tensor([[1, 2]]), [0]) == pytest.approx(0.5)  # 1 of 3 tokens
    rows = [{"title": "T", "context": "C.", "question": "Q?", "answers": ["Lyon", "Paris"]}]
    examples = build_examples(TASKS["squad"], rows, "x")
    monkeypatch.setattr(generation_evaluation, "answer_text", lambda decode, ids: "Paris")
    engine = ZOEngine(model(), ZOConfig(device="cpu", seed=0))
    encoder = PromptEncoder(TOKENIZER, max_length=256)
    metrics = evaluate_generation(engine, examples, encoder, SINGLE, 1, 2)
    assert metrics == {"eval_f1": 1.0, "eval_exact_match": 1.0}
