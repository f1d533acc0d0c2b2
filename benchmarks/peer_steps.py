"""distzo's ZO-SGD, FZOO, momentum and Adam steps against the peers' own code, on the same z.

    python benchmarks/peer_steps.py --mezo ../MeZO --fzoo ../FZOO [--steps 3] [--family llama|qwen3]
    python benchmarks/peer_steps.py --zo2 ../zo2 [--steps 3] [--family qwen3 [--zo2-tied]]
    python benchmarks/peer_steps.py --mezo ../MeZO --peft lora|prefix [--prefix-positions peft]
    python benchmarks/peer_steps.py --zobench ../ZO-LLM [--adam-eps 1e-30] [--zobench-queries 2]
    python benchmarks/peer_steps.py --mezo-medium ../MeZO --weight-decay 0 [--medium-tie]
    python benchmarks/peer_steps.py --mezo-medium ../MeZO --peft lora [--medium-lora-as peft]
    python benchmarks/peer_steps.py --mezo-medium ../MeZO --peft prefix [--prefix-positions peft]

``--mezo``: a checkout of princeton-nlp/MeZO (its ``large_models/trainer.py``) or that file;
``--fzoo``: a checkout of DKmiyan/FZOO (its ``trainer.py``) or that file. Nothing of theirs
is imported or vendored: the peer's ``zo_perturb_parameters``, ``zo_step``, ``zo_update``
and ``zo_forward`` are read from the file with ``ast`` and run as written, as methods of a
minimal trainer (the Hugging Face ``Trainer`` they need is not loaded), on a tiny float64
model built from its config. Their noise draws (``torch.normal``, ``torch.randint`` after
``torch.manual_seed``) return distzo's own z for that step, direction and parameter, so
each step of the peer and of a ``ZOEngine`` on the same weights, batch and loss must
agree: the script prints, per step, both losses, the largest difference of the update
coefficients (MeZO's ``projected_grad``; FZOO's ``projected_grad[j]``, which is distzo's
``c_j / N``) and of the weights after the step, each against the step's own length.

The verdict is relative: a peer step agrees when its loss, coefficients and weights are
within ``--rtol`` of distzo's, measured against the loss, the coefficients' and the step's
largest magnitude, or within float64's rounding of what each is computed from
(``agrees``): the weights within ``ROUNDING_ULPS`` of themselves per step, which a small
``--lr``'s step falls below, and a coefficient within its losses' last place (and their
difference) over the losses' spread, which a small ``--eps`` makes large, and a step
within its coefficient's.

The loss is the next-token cross-entropy in float64 for both (a Hugging Face model's
``.loss`` casts the logits to float32); ``--mezo-medium``'s is MeZO's prompt loss, the
cross-entropy of the label words' logits at the ``<mask>``. Exit 0 when every step of
every peer agrees, 1 otherwise.

Each peer's check is a module of ``benchmarks/peer_checks/``, whose docstring says what of
the peer runs as written and what is stood in: ``mezo_fzoo`` (``--mezo``, ``--fzoo``, and
FZOO's float32 losses, ``--float32-losses``), ``mezo_medium`` (``--mezo-medium PATH``:
MeZO's ``medium_models`` RoBERTa step, its prompt model's loss at the ``<mask>``, beside
the ``Classification`` objective; ``--medium-tie``: its ``tie_emb``), ``mezo_adapters``
(``--mezo PATH --peft lora|prefix``: MeZO's ``lora.py`` and ``prefix.py``),
``mezo_medium_lora`` (``--mezo-medium PATH --peft lora``: MeZO's RoBERTa LoRA, loralib's
layers; ``--medium-lora-as peft``: its head frozen, its merge off), ``mezo_medium_prefix``
(``--mezo-medium PATH --peft prefix``: MeZO's RoBERTa prefix, its ``src/prefix.py``), ``zo2`` and
``zo2_units`` (``--zo2``: ZO2's MeZO-SGD and its offload, on OPT or Qwen3) and
``zobench`` (``--zobench``: ZO-Bench's momentum and Adam), all on ``harness`` (the peer's
methods read from its file, the tiny model, the batches, the z served to its draws,
``agrees``). A new peer gets a module of its own, and its flags here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run as a script, Python puts benchmarks/ first on the path: the checks are imported from
# the repository's root, as the package benchmarks.peer_checks that mypy and the tests see.
REPOSITORY = str(Path(__file__).resolve().parents[1])
if REPOSITORY not in sys.path:
    sys.path.append(REPOSITORY)

from benchmarks.peer_checks.harness import trainer_file  # noqa: E402
from benchmarks.peer_checks.mezo_adapters import compare_mezo_adapter  # noqa: E402
from benchmarks.peer_checks.mezo_fzoo import compare  # noqa: E402
from benchmarks.peer_checks.mezo_medium import compare_mezo_medium, medium_checkout  # noqa: E402
from benchmarks.peer_checks.mezo_medium_lora import (  # noqa: E402
    compare_mezo_medium_lora,
    lora_checkout,
)
from benchmarks.peer_checks.mezo_medium_prefix import (  # noqa: E402
    compare_mezo_medium_prefix,
    prefix_checkout,
)
from benchmarks.peer_checks.zo2 import compare_zo2, zo2_checkout  # noqa: E402
from benchmarks.peer_checks.zobench import compare_zobench  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mezo", type=Path, help="a MeZO checkout or its large_models/trainer.py")
    p.add_argument("--fzoo", type=Path, help="an FZOO checkout or its trainer.py")
    p.add_argument("--zo2", type=Path, help="a ZO2 checkout (liangyuwang/zo2): both its modes")
    p.add_argument(
        "--zobench",
        type=Path,
        help="a ZO-Bench checkout (OPTML-Group/ZO-LLM) or its zo-bench/trainer.py: "
        "momentum and Adam",
    )
    p.add_argument(
        "--mezo-medium",
        type=Path,
        help="a MeZO checkout: its medium_models RoBERTa step (src/trainer.py, src/models.py)",
    )
    p.add_argument(
        "--medium-tie",
        action="store_true",
        help="with --mezo-medium: MeZO's --tie_emb (the head on the word embeddings) beside "
        "distzo's tied RoBERTa; default both untied, MeZO's default",
    )
    p.add_argument("--family", choices=("opt", "llama", "qwen3"), default="opt")
    p.add_argument(
        "--zo2-tied",
        action="store_true",
        help="ZO2's check on a model whose head is its embeddings (small Qwen3s'); "
        "default untied, as the race's",
    )
    p.add_argument(
        "--peft",
        choices=("lora", "prefix"),
        help="with --mezo: MeZO's LoRA or prefix (its lora.py, prefix.py) beside distzo's; "
        "with --mezo-medium: MeZO's RoBERTa LoRA (--apply_lora, loralib's layers) or prefix "
        "(--prefix_tuning, its src/prefix.py)",
    )
    p.add_argument(
        "--medium-lora-as",
        choices=("mezo", "peft"),
        default="mezo",
        help="with --mezo-medium --peft lora: MeZO's run as written (its head trains too, "
        "loralib merges the adapters in eval mode), or its head frozen and the merge off, as "
        "peft's LoRA (to compare all else)",
    )
    p.add_argument(
        "--prefix-positions",
        choices=("mezo", "peft"),
        default="mezo",
        help="with --peft prefix: MeZO's batch positions as without a prefix (OPT's from 0, "
        "RoBERTa's from padding_idx + 1), as its code, or after the prefix, as peft's and "
        "distzo's (to compare all else)",
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--queries", type=int, default=8, help="FZOO's N (its fzoo.sh's 8)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eps", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1, help="MeZO's; FZOO, ZO-Bench: none")
    p.add_argument("--momentum", type=float, default=0.9, help="ZO-Bench's sweeps' momentum")
    p.add_argument("--adam-eps", type=float, default=1e-8, help="Adam's eps (torch's default)")
    p.add_argument(
        "--zobench-queries", type=int, default=1, help="ZO-Bench's q (its zo_step_v1 when > 1)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rtol", type=float, default=1e-9)
    p.add_argument(
        "--float32-losses",
        action="store_true",
        help="keep FZOO's float32 loss vector (its rounding, not its algorithm)",
    )
    args = p.parse_args(argv)
    if args.zo2 and args.family not in ("opt", "qwen3"):
        p.error(f"--zo2 checks --family opt or qwen3 (the race's), not {args.family}")
    if args.peft and not (args.mezo or args.mezo_medium):
        p.error("--peft compares MeZO's adapters: give --mezo PATH, a checkout of MeZO")
    if args.medium_lora_as != "mezo" and not (args.mezo_medium and args.peft == "lora"):
        p.error(
            "--medium-lora-as compares MeZO's RoBERTa LoRA: give --mezo-medium PATH --peft lora"
        )
    if args.peft and args.mezo and args.family != "opt":
        p.error("--peft runs MeZO's adapters on OPT, the family its lora.py adapts: drop --family")
    if args.medium_tie and not args.mezo_medium:
        p.error("--medium-tie ties MeZO's RoBERTa head: give --mezo-medium PATH")
    if not any(getattr(args, peer) for peer in ("mezo", "fzoo", "zo2", "zobench", "mezo_medium")):
        p.error(
            "give --mezo PATH, --fzoo PATH, --zo2 PATH, --zobench PATH, --mezo-medium PATH "
            "or several: the peers' checkouts"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    peers = [(name, getattr(args, name)) for name in ("mezo", "fzoo") if getattr(args, name)]
    sources = [(name, trainer_file(name, path)) for name, path in peers]
    zo2 = None if args.zo2 is None else zo2_checkout(args.zo2, args.family)
    zobench = None if args.zobench is None else trainer_file("zobench", args.zobench)
    if args.mezo_medium is not None:  # its files, refused before any peer runs
        medium_checkout(args.mezo_medium)
        if args.peft == "lora":
            lora_checkout(args.mezo_medium)
        elif args.peft == "prefix":
            prefix_checkout(args.mezo_medium)
    if args.peft and args.mezo:  # MeZO's adapter files are read from its checkout
        results = [compare_mezo_adapter(args.mezo, sources[0][1], args)]
        results += [compare(name, source, args) for name, source in sources[1:]]
    else:
        results = [compare(name, source, args) for name, source in sources]
    if zo2 is not None:
        results += [compare_zo2(zo2, offload, args) for offload in (False, True)]
    if zobench is not None:
        results.append(compare_zobench(zobench, args))
    if args.mezo_medium is not None and args.peft == "lora":
        results.append(compare_mezo_medium_lora(args.mezo_medium, args))
    elif args.mezo_medium is not None and args.peft == "prefix":
        results.append(compare_mezo_medium_prefix(args.mezo_medium, args))
    elif args.mezo_medium is not None:
        results.append(compare_mezo_medium(args.mezo_medium, args))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
