"""distzo's --num-demos (in-context learning) against MeZO's own draw and ``encode_prompt``.

    python benchmarks/icl_check.py --mezo path/to/MeZO --tokenizer MODEL_DIR_OR_NAME
        [--rows train.tsv] [--eval-rows heldout.tsv] [--num-demos 32] [--num-eval 40] [--bos]

MeZO's ``large_models`` modules are imported from its checkout as they are: ``tasks.py``
(its ``Dataset.sample_train_sets`` and ``sample_subset``, on a ``Dataset`` whose
``samples`` are built here as its ``build_sample`` builds them, no download),
``templates.py`` and ``utils.py``'s ``encode_prompt``. For each task (SST-2 on ``--rows``
and ``--eval-rows``, by default ``benchmarks/data/sst2-sample``; COPA and SQuAD on a few
rows of their schema written below), each draw (``per-row``: MeZO's run without
``--train_set_seed``; ``shared``: with ``--train_set_seed 5``) and two ``--max-length``
(MeZO's 2048, and 96, which cuts the demonstrations from the left), it compares:

* the draw: which evaluation rows, and which training rows each is shown, in order;
* the tokens: for every evaluation row, each candidate's ids and scored-token count
  (SQuAD: the prompt to decode from, less ``--max-new-tokens``), from distzo's
  ``load_task_rows`` (``Sampling(num_demos=...)``) and ``PromptEncoder`` against
  ``encode_prompt``'s.

``--bos`` loads the tokenizer with ``add_bos_token``, for one that adds no leading token
(SmolLM2's): MeZO's cut then keeps the first token, and distzo's must too.
A line per task, draw and length says AGREE or DIFFER; the last line sums them up.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distzo.data.demonstrations import demo_draws  # noqa: E402
from distzo.data.encoding import PromptEncoder  # noqa: E402
from distzo.data.sampling import Sampling, mezo_draw  # noqa: E402
from distzo.data.task_data import load_task_rows  # noqa: E402

SAMPLE = Path(__file__).resolve().parent / "data" / "sst2-sample"
SHARED_SEED = 5  # MeZO's --train_set_seed in the shared draw
MAX_NEW_TOKENS = 50  # MeZO's run.py default
LENGTHS = (2048, 96)  # MeZO's default --max_length, and one that cuts demonstrations

# COPA and SQuAD rows of their datasets' schema, written for this check (the repository
# holds no copy of either): what is compared is how each side builds and cuts the prompts
COPA = [
    ("The man turned on the faucet.", "effect", "The toilet filled with water.",
     "Water flowed from the spout.", 1),
    ("The girl found a bug in her cereal.", "effect", "She poured milk in the bowl.",
     "She lost her appetite.", 1),
    ("The woman retired.", "effect", "She received her pension.",
     "She paid off her mortgage.", 0),
    ("I wanted to conserve energy.", "effect", "I swept the floor.",
     "I shut off the light.", 1),
    ("The hamburger meat browned.", "cause", "The cook froze it.", "The cook grilled it.", 1),
    ("I emptied my pockets.", "effect", "I retrieved a ticket stub.",
     "I found a weapon.", 0),
    ("The runner wore shorts.", "cause", "The forecast predicted high temperatures.",
     "She planned to run along the beach.", 0),
    ("My body cast a shadow over the grass.", "cause", "The sun was rising.",
     "The grass was cut.", 0),
    ("The physician misdiagnosed the patient.", "effect", "The patient filed a lawsuit.",
     "The patient disclosed confidential information.", 0),
    ("The child caught a life-threatening illness.", "cause", "She didn't get vaccinated.",
     "She passed out.", 0),
]  # fmt: skip
SQUAD = [
    ("Normans", "The Normans were the people who in the 10th and 11th centuries gave their "
     "name to Normandy, a region in France.", "In what country is Normandy located?",
     ["France"]),
    ("Normans", "They were descended from Norse raiders and pirates from Denmark, Iceland "
     "and Norway.", "From which countries did the Norse originate?",
     ["Denmark, Iceland and Norway", "Denmark"]),
    ("Computation", "A computational problem is understood to be a task that is in principle "
     "amenable to being solved by a computer.", "What is a computational problem?",
     ["a task that is in principle amenable to being solved by a computer"]),
    ("Rivers", "The Rhine rises in the Swiss Alps and flows into the North Sea.",
     "Where does the Rhine rise?", ["the Swiss Alps"]),
    ("Rivers", "The Danube flows through ten countries, more than any other river.",
     "How many countries does the Danube flow through?", ["ten"]),
    ("Planets", "Jupiter is the largest planet of the Solar System.",
     "Which is the largest planet?", ["Jupiter"]),
]  # fmt: skip


def mezo_modules(checkout: Path) -> tuple[Any, Any, Any]:
    """MeZO's ``tasks``, ``templates`` and ``utils`` modules, imported from its checkout."""
    sys.path.insert(0, str(checkout / "large_models"))
    import tasks  # type: ignore[import-not-found]
    import templates  # type: ignore[import-not-found]
    import utils  # type: ignore[import-not-found]

    return tasks, templates, utils


def tsv_rows(path: Path) -> list[dict[str, Any]]:
    """An SST-2 TSV (``sentence\\tlabel`` header) as rows, split as GLUE's files are."""
    lines = path.read_text().split("\n")[1:]
    return [
        {"sentence": s, "label": int(label)}
        for s, label in (line.split("\t") for line in lines if line)
    ]


def copa_rows() -> list[dict[str, Any]]:
    keys = ("premise", "question", "choice1", "choice2", "label")
    return [dict(zip(keys, row, strict=True)) | {"idx": i} for i, row in enumerate(COPA)]


def squad_rows() -> list[dict[str, Any]]:
    keys = ("title", "context", "question", "answers")
    return [dict(zip(keys, row, strict=True)) for row in SQUAD]


def mezo_samples(tasks: Any, task: str, rows: list[dict[str, Any]]) -> list[Any]:
    """``rows`` as MeZO's ``build_sample`` of the task makes its ``Sample``s (the id: the
    row's index, which the draw is compared by)."""
    samples = []
    for i, row in enumerate(rows):
        if task == "sst2":
            sample = tasks.Sample(id=i, data=row, correct_candidate=row["label"], candidates=[0, 1])
        elif task == "copa":
            candidates = [row["choice1"], row["choice2"]]
            sample = tasks.Sample(
                id=i, data=row, candidates=candidates, correct_candidate=candidates[row["label"]]
            )
        else:
            sample = tasks.Sample(id=i, data=row, candidates=None, correct_candidate=row["answers"])
        samples.append(sample)
    return samples


def mezo_dataset(tasks: Any, templates: Any, task: str, train: list, valid: list) -> Any:
    """A MeZO ``Dataset`` of the task holding ``train`` and ``valid`` as its splits."""
    template = {
        "sst2": templates.SST2Template,
        "copa": templates.CopaTemplate,
        "squad": templates.SQuADv2Template,
    }[task]()

    class Rows(tasks.Dataset):
        generation = task == "squad"

        def __init__(self) -> None:
            self.samples = {"train": train, "valid": valid}

        def get_template(self, template_version: int = 0) -> Any:
            return template

    return Rows()


@dataclass(frozen=True)
class Case:
    """One comparison: a task's draw (``shared``: under ``seed``) at one token limit."""

    task: str
    num: int  # demonstrations
    num_eval: int
    sets: str  # per-row or shared
    seed: int | None  # MeZO's --train_set_seed (None: per-row)
    max_length: int


def mezo_run(utils: Any, data: Any, case: Case, tokenizer: Any) -> tuple[list, list]:
    """MeZO's draw (``run.py``'s ``main``: the evaluation rows under 0 without a train-set
    seed) and ``encode_prompt`` of each evaluation row: ([(eval id, demo ids)], encodings)."""
    sets = data.sample_train_sets(num_train=case.num, num_eval=case.num_eval, seed=case.seed)
    evals = data.sample_subset(data_split="valid", seed=case.seed or 0, num=case.num_eval)
    if case.seed is not None:  # one set for every row
        sets = sets * len(evals)
    draws, encoded = [], []
    for demos, sample in zip(sets, evals, strict=True):
        draws.append((sample.id, [d.id for d in demos]))
        ids, lens = utils.encode_prompt(
            data, data.get_template(), demos, sample, tokenizer, case.max_length,
            generation=data.generation, max_new_tokens=MAX_NEW_TOKENS,
        )  # fmt: skip
        encoded.append([(list(i), n) for i, n in zip(ids, lens, strict=True)])
    return draws, encoded


def distzo_run(
    case: Case, files: tuple[str, str], rows: tuple[int, int], tokenizer: Any
) -> tuple[list, list]:
    """distzo's draw and encodings of the same rows: ``load_task_rows`` with
    ``--num-demos``, each evaluation row through ``PromptEncoder``."""
    seed = case.seed or 0
    sampling = Sampling(num_eval=case.num_eval, seed=seed, num_demos=case.num, demo_sets=case.sets)
    loaded = load_task_rows(case.task, files[0], files[1], sampling)
    assert loaded is not None
    chosen = mezo_draw(rows[1], case.num_eval, seed)
    shown = demo_draws(rows[0], len(chosen), case.num, case.sets, seed)
    encoder = PromptEncoder(tokenizer, case.max_length)
    encoded = []
    for example in loaded.eval:
        if case.task == "squad":  # the prompt decoded from: no candidate, MeZO's length 0
            encoded.append([(encoder.encode_prompts([example.prompt], MAX_NEW_TOKENS)[0], 0)])
        else:
            encoded.append([encoder.encode(example.prompt, c) for c in example.continuations])
    return list(zip(chosen, shown, strict=True)), encoded


def with_bos_flag(tokenizer: Any) -> Any:
    """MeZO's ``encode_prompt`` reads ``tokenizer.add_bos_token`` (OPT's tokenizer has it):
    whether a leading special token comes before the text, set where the tokenizer lacks it."""
    if not hasattr(tokenizer, "add_bos_token"):
        plain = tokenizer("a", add_special_tokens=False)["input_ids"]
        tokenizer.add_bos_token = tokenizer("a")["input_ids"][:1] != plain[:1]
    return tokenizer


def load_tokenizer(name: str, bos: bool) -> Any:
    """The tokenizer compared on; ``bos``: made to put its ``bos_token`` before every
    text (``add_bos_token``, which MeZO's cut reads), so that the cut keeping a leading
    special token is compared too. One that will not is refused."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name, **({"add_bos_token": True} if bos else {}))
    if bos and tokenizer("a")["input_ids"][:1] != [tokenizer.bos_token_id]:
        raise SystemExit(f"--bos: {name}'s tokenizer puts no bos_token before a text")
    return with_bos_flag(tokenizer)


def check_task(
    modules: tuple, task: str, splits: tuple[list, list], tokenizer: Any, counts: tuple[int, int],
    work: Path,
) -> bool:  # fmt: skip
    """Every draw and length of one task (``counts``: demonstrations, evaluation rows at
    most); a line each."""
    tasks, templates, utils = modules
    files = (str(work / f"{task}-train.jsonl"), str(work / f"{task}-eval.jsonl"))
    for path, rows in zip(files, splits, strict=True):
        Path(path).write_text("".join(json.dumps(row) + "\n" for row in rows))
    train, valid = (mezo_samples(tasks, task, rows) for rows in splits)
    data = mezo_dataset(tasks, templates, task, train, valid)
    num, num_eval = min(counts[0], len(train)), min(counts[1], len(valid))
    agree = True
    for sets, seed in (("per-row", None), ("shared", SHARED_SEED)):
        for max_length in LENGTHS:
            case = Case(task, num, num_eval, sets, seed, max_length)
            theirs = mezo_run(utils, data, case, tokenizer)
            ours = distzo_run(case, files, (len(train), len(valid)), tokenizer)
            same_draw = [(int(e), list(d)) for e, d in ours[0]] == theirs[0]
            same_ids = ours[1] == theirs[1]
            room = max_length - (MAX_NEW_TOKENS if task == "squad" else 0)
            cut = sum(len(ids) >= room for rows in theirs[1] for ids, _ in rows)
            agree &= same_draw and same_ids
            print(
                f"{task:5} {sets:7} max-length {max_length:4}: draw "
                f"{'same' if same_draw else 'DIFFER'}, ids {'same' if same_ids else 'DIFFER'} "
                f"({num_eval} rows x {num} demos, {cut} sequences at the limit) "
                f"{'AGREE' if same_draw and same_ids else 'DIFFER'}"
            )
    return agree


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mezo", type=Path, required=True, help="a checkout of MeZO")
    parser.add_argument("--tokenizer", required=True, help="a model folder or hub name")
    parser.add_argument("--rows", type=Path, default=SAMPLE / "train.tsv")
    parser.add_argument("--eval-rows", type=Path, default=SAMPLE / "heldout.tsv")
    parser.add_argument("--num-demos", type=int, default=32)
    parser.add_argument("--num-eval", type=int, default=40)
    parser.add_argument(
        "--bos",
        action="store_true",
        help="load the tokenizer with add_bos_token (a leading <s>, as OPT's and Llama's)",
    )
    args = parser.parse_args()
    modules = mezo_modules(args.mezo)
    tokenizer = load_tokenizer(args.tokenizer, args.bos)
    counts = (args.num_demos, args.num_eval)
    agree = True
    with tempfile.TemporaryDirectory() as work:
        for task, splits in (
            ("sst2", (tsv_rows(args.rows), tsv_rows(args.eval_rows))),
            ("copa", (copa_rows()[:6], copa_rows()[6:])),
            ("squad", (squad_rows()[:4], squad_rows()[4:])),
        ):
            agree &= check_task(modules, task, splits, tokenizer, counts, Path(work))
    verdict = "AGREE" if agree else "DIFFER"
    print(f"in-context prompts vs MeZO's sample_train_sets and encode_prompt: {verdict}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
