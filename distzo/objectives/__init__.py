"""What a ZO step minimises: one number per perturbed model.

* ``lm``: teacher forcing on the label tokens (MeZO with ``--only_train_option``).
* ``classification``: cross-entropy over the candidates' mean log-likelihoods (MeZO's
  ``--train_as_classification``).
* ``accuracy`` / ``f1``: non-differentiable metrics of each perturbed model (MeZO's
  ``--non_diff``, section 3.3): minus the candidate-scoring accuracy, minus SQuAD F1 of
  greedy decoding.

An objective turns a batch into one loss per pass through a ``PassRunner`` (the engine's
view of the model at one step's perturbations), reading the LM head only at the
positions its labels need. It knows nothing of offload, ranks or data files.
"""

from distzo.objectives.choice import (
    CHOICE_KEYS,
    Accuracy,
    ChoiceEncoding,
    Classification,
    candidate_scores,
    collate_choices,
)
from distzo.objectives.generation import F1, collate_prompts, greedy_decode
from distzo.objectives.lm import LanguageModeling, lm_sums
from distzo.objectives.metrics import answer_text, exact_match, f1_score, normalize_answer
from distzo.objectives.protocol import Objective, PassRunner
from distzo.objectives.scoring import HEAD_CHUNK, HeadTargets, picked_log_probs

OBJECTIVES = ("lm", "classification", "accuracy", "f1")

__all__ = [
    "CHOICE_KEYS",
    "HEAD_CHUNK",
    "OBJECTIVES",
    "Accuracy",
    "ChoiceEncoding",
    "Classification",
    "F1",
    "HeadTargets",
    "LanguageModeling",
    "Objective",
    "PassRunner",
    "answer_text",
    "candidate_scores",
    "collate_choices",
    "collate_prompts",
    "exact_match",
    "f1_score",
    "greedy_decode",
    "lm_sums",
    "normalize_answer",
    "picked_log_probs",
]
