"""A generation task's evaluation (SQuAD, DROP): greedy decoding of a whole batch
together, ``max_new_tokens`` tokens cut at the first newline, SQuAD's F1 and exact match
against every gold answer (the best one counts); and, for a run trained on the ``lm``
objective (MeZO's ``--train_as_classification False``), that objective's loss on the same
rows: each example's prompt and right answer encoded as training encodes them
(``PromptEncoder.encode_many``) and scored by ``LanguageModeling``'s own loss, in the same
forward call as the batch's decoding, the negative log-likelihood summed over the ranks'
answer tokens and divided by their count (per token, as a training step's loss)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distzo.data.encoding import PromptEncoder
from distzo.data.templates import Example
from distzo.dist import ParallelContext
from distzo.engine import UNPERTURBED, ZOEngine
from distzo.job.eval_calls import (
    StopVote,
    calls,
    check_stop,
    counted_calls,
    reduce,
    rows_per_call,
    share,
    unless_broken,
)
from distzo.objectives import (
    LanguageModeling,
    PassRunner,
    answer_text,
    collate_prompts,
    exact_match,
    f1_score,
    greedy_decode,
)
from distzo.objectives.generation import PromptBatch, flagged, prepare_prompts
from distzo.zo.estimators import Pass


def evaluate_generation(
    engine: ZOEngine,
    examples: Sequence[Example],
    encoder: PromptEncoder,
    parallel: ParallelContext,
    batch_size: int,
    max_new_tokens: int = 16,
    stop: StopVote | None = None,
    loss: bool = False,
) -> dict[str, float]:
    """Greedy answers of ``batch_size`` examples at a time over all the ranks, decoded
    together; ``loss``: the ``lm`` objective's loss on the right answers too
    (``eval_loss``, first)."""
    mine = share(len(examples), parallel)
    batch_size = rows_per_call(batch_size, parallel.env.world_size)
    objective = LanguageModeling() if loss else None
    f1 = em = 0.0
    broken = 0
    nll = torch.zeros((), dtype=torch.float64, device=engine.device)
    tokens = 0  # the answer tokens ``nll`` sums over (``LanguageModeling.num_items``')
    for call in counted_calls(calls(len(examples), batch_size, parallel), parallel):
        check_stop(stop)
        chunk = list(mine[call * batch_size : (call + 1) * batch_size])
        indices = chunk or [0]  # a spare call repeats an example
        prompts = encoder.encode_prompts([examples[i].prompt for i in indices], max_new_tokens)
        prepared = prepare_prompts(
            collate_prompts(prompts, indices, max_new_tokens, encoder.pad_id), engine.device
        )
        answers = None
        if objective is not None:
            right = encoder.collate(encoder.encode_many([examples[i] for i in indices]))
            answers = objective.prepare(right, engine.device)

        def measure(runner: PassRunner) -> tuple[torch.Tensor, torch.Tensor | None]:
            decoded = _decode(runner, prepared)
            if objective is None or answers is None:
                return decoded, None
            # num_items 1: the summed loss, divided here by the ranks' summed tokens
            return decoded, objective.losses(runner, answers, (UNPERTURBED,), 1)[UNPERTURBED]

        decoded, summed = engine.evaluate(measure)
        if chunk and summed is not None and answers is not None:
            nll, tokens = nll + summed, tokens + answers.targets.num_entries
        for i, row in zip(chunk, decoded.tolist()):  # one read per batch
            prediction = answer_text(encoder.answer, row[:-1])
            broken += row[-1]
            f1 += max(f1_score(prediction, gold) for gold in examples[i].answers)
            em += max(exact_match(prediction, gold) for gold in examples[i].answers)
    f1_sum, em_sum, bad, nll_sum, token_sum, total = reduce(
        [f1, em, broken, nll, tokens, len(mine)], parallel
    )
    return {
        **({"eval_loss": unless_broken(nll_sum / token_sum, bad)} if loss else {}),
        "eval_f1": unless_broken(f1_sum / total, bad),
        "eval_exact_match": unless_broken(em_sum / total, bad),
    }


def _decode(runner: PassRunner, prepared: PromptBatch) -> torch.Tensor:
    """The greedy tokens of the unperturbed pass, each row's broken flag as a last column."""
    broken: dict[Pass, torch.Tensor] = {}
    tokens = greedy_decode(runner, prepared, (UNPERTURBED,), broken)[UNPERTURBED]
    return flagged(tokens, broken[UNPERTURBED])
