"""Evaluation, sharded over all ranks and reduced: every rank scores its share of the
examples and the sums are added up, so the metric covers the whole set once.

Every rank makes the same number of forward calls (a rank short of work repeats a
dummy batch): under the sliced transfer each forward's uploads are collectives.

* classification / multiple choice: each candidate continuation scored by its mean
  token log-likelihood (MeZO's rule); accuracy of the argmax.
* generation (SQuAD): greedy decoding up to ``max_new_tokens`` or a newline; SQuAD's
  F1 and exact match against every gold answer (the best one counts).
* language modelling: next-token loss and accuracy over the label tokens.
"""

from __future__ import annotations

import collections
import math
import re
import string
from typing import Sequence

import torch

from distzo.data.prompt_data import PromptEncoder
from distzo.data.tasks import Example
from distzo.dist import ParallelContext
from distzo.engine import ZOEngine


def _share(count: int, parallel: ParallelContext) -> range:
    """This rank's contiguous share of ``count`` items (sizes differ by at most one)."""
    world, rank = parallel.env.world_size, parallel.env.rank
    base, extra = divmod(count, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def _calls(count: int, per_call: int, parallel: ParallelContext) -> int:
    """Forward calls every rank makes: enough for the largest share."""
    largest = math.ceil(count / parallel.env.world_size)
    return max(1, math.ceil(largest / per_call))


def _reduce(values: list[float], parallel: ParallelContext) -> list[float]:
    return parallel.reduce(torch.tensor(values, dtype=torch.float64)).tolist()


def token_log_probs(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per row: the mean log-probability of its label tokens."""
    labels = batch["labels"][:, 1:].to(logits.device)
    keep = labels != -100
    log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * keep).sum(-1) / keep.sum(-1).clamp(min=1)


def evaluate_choices(
    engine: ZOEngine, examples: Sequence[Example], encoder: PromptEncoder, parallel: ParallelContext, batch_size: int
) -> dict[str, float]:
    mine = [examples[i] for i in _share(len(examples), parallel)]
    sequences = [encoder.encode(e.prompt, c) for e in mine for c in e.continuations]
    spare = encoder.encode(examples[0].prompt, examples[0].continuations[0])  # for a call past this rank's share
    per_example = max(len(e.continuations) for e in examples)
    calls = _calls(len(examples) * per_example, batch_size, parallel)
    scores: list[float] = []
    for call in range(calls):
        chunk = sequences[call * batch_size : (call + 1) * batch_size]
        batch = encoder.collate(chunk or [spare])
        logits, _ = engine.forward(batch)
        if chunk:
            scores.extend(token_log_probs(logits, batch).tolist())
    correct, position = 0, 0
    for e in mine:
        options = scores[position : position + len(e.continuations)]
        position += len(e.continuations)
        correct += int(max(range(len(options)), key=options.__getitem__) == e.label)
    hits, total = _reduce([correct, len(mine)], parallel)
    return {"eval_accuracy": hits / total}


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, gold: str) -> float:
    predicted, truth = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum((collections.Counter(predicted) & collections.Counter(truth)).values())
    if not predicted or not truth:
        return float(predicted == truth)
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(truth)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def evaluate_generation(
    engine: ZOEngine,
    examples: Sequence[Example],
    encoder: PromptEncoder,
    parallel: ParallelContext,
    batch_size: int,
    max_new_tokens: int = 16,
) -> dict[str, float]:
    mine = [examples[i] for i in _share(len(examples), parallel)]
    tokenizer = encoder.tokenizer
    calls = _calls(len(examples), batch_size, parallel)
    f1 = em = 0.0
    for call in range(calls):
        chunk = mine[call * batch_size : (call + 1) * batch_size]
        prompts = [encoder.encode(e.prompt, "")[0] for e in (chunk or examples[:1])]
        generated: list[list[int]] = [[] for _ in prompts]
        for _ in range(max_new_tokens):  # a fixed count: every rank calls forward alike
            rows = [(p + g)[-encoder.max_length :] for p, g in zip(prompts, generated)]
            batch = encoder.collate([(r, 0) for r in rows])
            logits, _ = engine.forward(batch)
            for row, ids in enumerate(rows):
                generated[row].append(int(logits[row, len(ids) - 1].argmax()))
        for e, ids in zip(chunk, generated):
            prediction = tokenizer.decode(ids, skip_special_tokens=True).split("\n")[0].strip()
            f1 += max(f1_score(prediction, gold) for gold in e.answers)
            em += max(exact_match(prediction, gold) for gold in e.answers)
    f1_sum, em_sum, total = _reduce([f1, em, len(mine)], parallel)
    return {"eval_f1": f1_sum / total, "eval_exact_match": em_sum / total}


def evaluate_lm(
    engine: ZOEngine, batch: dict[str, torch.Tensor], parallel: ParallelContext, batch_size: int | None = None
) -> dict[str, float]:
    """Next-token loss and accuracy on the label tokens of ``batch``, rows sharded over the
    ranks and scored ``batch_size`` rows per forward call."""
    rows = list(_share(batch["input_ids"].shape[0], parallel))
    batch_size = batch_size or max(len(rows), 1)
    sums = [0.0, 0.0, 0.0]
    for call in range(_calls(batch["input_ids"].shape[0], batch_size, parallel)):
        chunk = rows[call * batch_size : (call + 1) * batch_size]
        shard = {k: v[chunk or rows[:1] or [0]] for k, v in batch.items()}  # a spare call repeats a row
        logits, _ = engine.forward(shard)
        if not chunk:
            continue
        targets = shard["labels"][:, 1:].to(logits.device)
        keep = targets != -100
        predicted = logits[:, :-1].float()
        sums[0] += torch.nn.functional.cross_entropy(predicted[keep], targets[keep], reduction="sum").item()
        sums[1] += (predicted.argmax(-1)[keep] == targets[keep]).sum().item()
        sums[2] += keep.sum().item()
    loss, hits, count = _reduce(sums, parallel)
    return {"eval_loss": loss / count, "eval_accuracy": hits / count}
