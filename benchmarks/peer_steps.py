"""distzo's ZO-SGD, FZOO, momentum and Adam steps against the peers' own code, on the same z.

    python benchmarks/peer_steps.py --mezo ../MeZO --fzoo ../FZOO [--steps 3] [--family llama|qwen3]
    python benchmarks/peer_steps.py --zo2 ../zo2 [--steps 3] [--family qwen3 [--zo2-tied]]
    python benchmarks/peer_steps.py --mezo ../MeZO --peft lora|prefix [--prefix-positions peft]
    python benchmarks/peer_steps.py --zobench ../ZO-LLM [--adam-eps 1e-30] [--zobench-queries 2]

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

FZOO gathers its perturbed losses in float32 (``torch.tensor(loss1s,
dtype=torch.float32)``): the stand-in ``torch.tensor`` keeps them in float64 like the rest,
so that a difference is the algorithm's; ``--float32-losses`` keeps its rounding (on the
tiny OPT at eps 1e-3 it moves the coefficients by about 0.5 %: float32's 2^-24 of a
loss near 4 against differences of order 1e-4). The loss is the next-token
cross-entropy in float64 for both (a Hugging Face model's ``.loss`` casts the logits to
float32). Exit 0 when every step of every peer agrees, 1 otherwise.

``--mezo PATH --peft lora|prefix``: MeZO's adapters as its ``run.py`` applies them, by its
own ``large_models/lora.py`` (``LoRA``: r 8, alpha 16) and ``prefix.py`` (``PrefixTuning``:
5 tokens, no reparameterisation, init by real activations), compiled from the checkout,
on one tiny float64 OPT; distzo's ``--peft`` on another from the same base. It prints the
adapters' and logits' differences at init (LoRA's random ``A`` is drawn apart, both within
Kaiming's bound, then both start from distzo's; the prefix's tokens are distzo's, served
to MeZO's ``torch.randint``), then MeZO's steps beside the engine's, z served by
parameter name (a block's ``key_values`` is MeZO's ``prefix_keys`` and ``prefix_values``).
MeZO's prefix code is written for transformers 4.28's OPT attention; it runs as written,
with 4.28's interface stood in: its cache indexed as a tuple, its ``past_key_value``
handed to the attention as a cache, an attention given a 4-D additive mask and a softmax
in float64. MeZO's batch keeps positions 0.. beside the prefix, peft's and distzo's start
after it (docs/peft.md): ``--prefix-positions peft`` shifts MeZO's by the prefix to compare
all the rest.

``--zo2``: a checkout of liangyuwang/zo2, the peer of ``benchmarks/peers.py``'s race. Its
classes ``BaseOptimizer``, ``MeZOSGDConfig``, ``MeZOSGD`` (its ``zo2=False`` step) and
``MeZO2SGD`` (its ``zo2=True`` offload) are compiled from its files, built by their own
constructors and run as written, in this interpreter (their package, which needs
transformers 4.51, is never imported), on an untied tiny float64 OPT (``--family qwen3``:
a Qwen3; ``--zo2-tied``: its head tied to the embeddings, as small Qwen3s) in eval mode,
as the race's models and ZO2's ``zo_train()``. What ZO2's model classes add is stood in:
the loss (the next-token cross-entropy of the head's logits) and, for the offload, the walk
through its units (OPT's: embeddings, ``project_in``, each layer, the final norm with weight
decay 0, ``project_out``, the head; Qwen3's read off ZO2's
``zo2/model/huggingface/qwen3/mezo_sgd/zo2.py``: each module with parameters that its
training forwards hand ``task_compute_module``, with the ``weight_decay`` each call
passes): the model's own forward runs on the batch twice over, and at each unit ZO2's
``module_dual_forward`` takes the two halves as its two passes. A step that differs names
the tensors whose weights differ most.
Its ``torch.normal`` draws follow a stand-in generator whose state (``torch.cuda``'s
get/set_rng_state) is the seed and the count drawn, so the offload's replay of the
previous step's z for its update is ZO2's own. Each ZO2 step is compared with a resident
and an offloaded ``ZOEngine``; the offload applies a step's update in the next step's
pass, so its weights are compared with distzo's one step earlier.

``--zobench``: a checkout of OPTML-Group/ZO-LLM (ZO-Bench, its ``zo-bench/trainer.py``) or
that file. Its ``zo_step`` (``zo_step_v1`` with ``--zobench-queries`` above 1, as its
training loop picks) hands ``g z`` to a torch optimizer as ``p.grad``; the statement of its
``_inner_training_loop`` that builds that optimizer (``SGD(lr, momentum)`` for ``zo_sgd``,
``Adam(lr)`` for ``zo_adam``) is compiled from the file and run as written, with its
sweeps' settings (momentum 0.9, weight decay 0, constant lr). Three runs: ``zo_sgd`` beside
distzo's momentum stored and recomputed (a window longer than the run), ``zo_adam``
beside distzo's Adam. ``--adam-eps`` sets both sides' eps (torch's default 1e-8): torch's
Adam adds it to ``sqrt(v / (1 - beta2^t))``, distzo's to ``sqrt(v)``, which the check
reports as a difference; at 1e-30 only the algorithm is left.
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
        help="with --mezo: MeZO's LoRA or prefix (its lora.py, prefix.py) beside distzo's",
    )
    p.add_argument(
        "--prefix-positions",
        choices=("mezo", "peft"),
        default="mezo",
        help="with --peft prefix: MeZO's batch positions from 0, as its code, or from the "
        "prefix's length, as peft's and distzo's (to compare all else)",
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
    if args.peft and not args.mezo:
        p.error("--peft compares MeZO's adapters: give --mezo PATH, a checkout of MeZO")
    if args.peft and args.family != "opt":
        p.error("--peft runs MeZO's adapters on OPT, the family its lora.py adapts: drop --family")
    if not any(getattr(args, peer) for peer in ("mezo", "fzoo", "zo2", "zobench")):
        p.error(
            "give --mezo PATH, --fzoo PATH, --zo2 PATH, --zobench PATH or several: the "
            "peers' checkouts"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    peers = [(name, getattr(args, name)) for name in ("mezo", "fzoo") if getattr(args, name)]
    sources = [(name, trainer_file(name, path)) for name, path in peers]
    zo2 = None if args.zo2 is None else zo2_checkout(args.zo2, args.family)
    zobench = None if args.zobench is None else trainer_file("zobench", args.zobench)
    if args.peft and args.mezo:  # MeZO's adapter files are read from its checkout
        results = [compare_mezo_adapter(args.mezo, sources[0][1], args)]
        results += [compare(name, source, args) for name, source in sources[1:]]
    else:
        results = [compare(name, source, args) for name, source in sources]
    if zo2 is not None:
        results += [compare_zo2(zo2, offload, args) for offload in (False, True)]
    if zobench is not None:
        results.append(compare_zobench(zobench, args))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
