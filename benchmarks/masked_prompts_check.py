"""distzo's masked-LM prompts against MeZO's own ``tokenize_multipart_input``.

    python benchmarks/masked_prompts_check.py --mezo path/to/MeZO [--print-ids]

MeZO's function is read from its checkout (``medium_models/src/dataset.py``) with ``ast``
and run as written, on the tiny RoBERTa tokenizer of the tests (each template word and
label word one token), for every task of ``MASKED_PROMPTS``: a short row, and a long one
that the sentence limits and the row's limit cut. Both must give the same ids and mask
position, or both refuse the row (its <mask> cut off). ``--print-ids``: the ids, for
``tests/unit/test_masked_prompts.py``'s known encodings.
"""

from __future__ import annotations

import argparse
import ast
import logging
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distzo.data.masked_prompts import MASKED_PROMPTS, MaskedPromptEncoder  # noqa: E402
from distzo.data.templates import MaskedExample  # noqa: E402
from tests.helpers.masked_prompts import roberta_tokenizer  # noqa: E402

SHORT = ("A cat is an animal.", "The plot is dull and slow")
LONG = ("a gripping, funny film. " * 30, "What city hosts the games? " * 12)


def mezo_function(checkout: Path) -> Any:
    """``tokenize_multipart_input``, compiled from MeZO's own source."""
    source = checkout / "medium_models" / "src" / "dataset.py"
    tree = ast.parse(source.read_text(), filename=str(source))
    (node,) = [
        n
        for n in tree.body
        if isinstance(n, ast.FunctionDef) and n.name == "tokenize_multipart_input"
    ]
    namespace: dict[str, Any] = {"logger": logging.getLogger("mezo"), "pd": None}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(source), "exec"), namespace)
    return namespace["tokenize_multipart_input"]


def mezo_ids(function: Any, tokenizer: Any, task: str, sentences: tuple[str, ...]) -> Any:
    prompt = MASKED_PROMPTS[task]
    try:
        out = function(
            list(sentences[: len(prompt.columns)]),
            prompt.max_length,
            tokenizer,
            prompt=True,
            template=prompt.template,
            first_sent_limit=prompt.first_limit,
            other_sent_limit=prompt.other_limit,
        )
    except AssertionError:
        return "refused"
    return out["input_ids"], out["mask_pos"][0]


def distzo_ids(tokenizer: Any, task: str, sentences: tuple[str, ...]) -> Any:
    prompt = MASKED_PROMPTS[task]
    encoder = MaskedPromptEncoder(tokenizer, task, prompt.max_length)
    try:
        (encoding,) = encoder.choices_many([MaskedExample(sentences[: len(prompt.columns)], 0)])
    except ValueError:
        return "refused"
    return list(encoding.rows[0]), encoding.scored[0][1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mezo", type=Path, required=True, help="a checkout of MeZO")
    parser.add_argument("--print-ids", action="store_true")
    args = parser.parse_args()
    function = mezo_function(args.mezo)
    tokenizer = roberta_tokenizer()
    tokenizer.model_type = "roberta"  # MeZO's run.py sets it; its function reads it
    agree = True
    for task in MASKED_PROMPTS:
        for name, sentences in (("short", SHORT), ("long", LONG)):
            theirs = mezo_ids(function, tokenizer, task, sentences)
            ours = distzo_ids(tokenizer, task, sentences)
            same = theirs == ours
            agree &= same
            shown = theirs if args.print_ids else ""
            print(f"{task:5} {name:5} {'same' if same else 'DIFFER'} {shown}")
    print(f"masked prompts vs MeZO's tokenize_multipart_input: {'AGREE' if agree else 'DIFFER'}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
