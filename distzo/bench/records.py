"""The benchmark report: JSON for machines (schema below), Markdown for people.

Schema (version 1), checked by ``validate_report``::

    {
      "schema_version": 1,
      "benchmark": "bandwidth" | "throughput" | "learning" | "memory" | "peers",
      "created": ISO-8601 time,
      "commit": git hash ("-dirty" after it: the tree differed from it) or "unknown",
      "device": "NVIDIA H100 80GB HBM3" | "cpu (N threads)", "torch": version,
      "world_size": int, "command": the command line,
      "measurements": [
        {"name": str, "params": {str: str|int|float|bool|null},
         "repeats": int, "median_s": float, "min_s": float, "max_s": float, "spread": float,
         "metrics": {str: float},          # e.g. gb_per_s, gparams_per_s, tokens_per_s
         "samples_s": [float]}             # optional: the repeats' times, in the order run
      ],
      "derived": {str: float},            # ratios computed in the same run
      "notes": [str]                      # optional: what the run left out or did otherwise
    }
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from distzo.bench.timing import Timer

SCHEMA_VERSION = 1
BENCHMARKS = ("bandwidth", "throughput", "learning", "memory", "peers")
_SCALAR = (str, int, float, bool, type(None))


@dataclass
class Measurement:
    name: str
    params: dict[str, Any]
    repeats: int
    median_s: float
    min_s: float
    max_s: float
    spread: float
    metrics: dict[str, float] = field(default_factory=dict)
    # every repeat's time in the order run: the distribution the median and spread summarise
    samples_s: list[float] = field(default_factory=list)

    @classmethod
    def from_timer(
        cls, name: str, params: dict[str, Any], timer: Timer, metrics: dict[str, float]
    ) -> Measurement:
        return cls(
            name,
            params,
            len(timer.samples),
            timer.median,
            min(timer.samples),
            max(timer.samples),
            timer.spread,
            metrics,
            list(timer.samples),
        )


ROOT = Path(__file__).resolve().parents[2]


def _git(root: Path, *args: str) -> str | None:
    """``git args`` in ``root``: its output, stripped; None where git fails or is missing."""
    try:
        proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def git_commit(root: Path = ROOT) -> str:
    """HEAD's short hash, with ``-dirty`` where the tree that ran is not HEAD's (changes
    to tracked files, or files git does not ignore): a copied working tree that kept an
    older HEAD must not pass its figures off as that commit's; "unknown" outside git, and
    where ``root`` is not the work tree's top (an installed copy in a virtualenv kept inside
    a checkout: the checkout's HEAD is not the code that ran)."""
    top = _git(root, "rev-parse", "--show-toplevel")
    head = _git(root, "rev-parse", "--short", "HEAD")
    if not head or top is None or Path(top).resolve() != root.resolve():
        return "unknown"
    return head + ("-dirty" if _git(root, "status", "--porcelain") else "")


@dataclass
class BenchReport:
    benchmark: str
    device: str
    world_size: int
    measurements: list[Measurement] = field(default_factory=list)
    derived: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "benchmark": self.benchmark,
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "commit": git_commit(),
            "device": self.device,
            "torch": torch.__version__,
            "world_size": self.world_size,
            "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
            "measurements": [asdict(m) for m in self.measurements],
            "derived": self.derived,
            **({"notes": self.notes} if self.notes else {}),
        }

    def write(self, json_path: Path, columns: list[str], appendix: str = "") -> dict[str, Any]:
        """Write the JSON (atomically) and a Markdown table beside it (``appendix``, e.g. the
        method, after it); return the JSON."""
        data = self.to_json()
        validate_report(data)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(json_path)
        json_path.with_suffix(".md").write_text(
            markdown_table(data, columns) + (f"\n{appendix.strip()}\n" if appendix else "")
        )
        return data


def markdown_table(data: dict[str, Any], columns: list[str]) -> str:
    """One row per measurement: name, the chosen params/metrics, median time and spread."""
    head = ["name", *columns, "median ms", "spread"]
    lines = [
        f"{data['benchmark']} on {data['device']} (world {data['world_size']}, "
        f"torch {data['torch']}, commit {data['commit']}, {data['created']})",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for m in data["measurements"]:
        cells = [m["name"]]
        for c in columns:
            value = m["metrics"].get(c, m["params"].get(c, ""))
            cells.append(f"{value:.3g}" if isinstance(value, float) else str(value))
        cells += [f"{m['median_s'] * 1e3:.3f}", f"{m['spread']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    if data["derived"]:
        lines += ["", "| derived | value |", "|---|---|"]
        lines += [f"| {k} | {v:.4g} |" for k, v in data["derived"].items()]
    if data.get("notes"):
        lines += ["", *(f"* {note}" for note in data["notes"])]
    return "\n".join(lines) + "\n"


def validate_report(data: dict[str, Any]) -> None:
    """Raise ValueError naming the first field that breaks the documented schema."""

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ValueError(f"benchmark report: {what}")

    need(isinstance(data, dict), "the report must be an object")
    need(data.get("schema_version") == SCHEMA_VERSION, f"schema_version must be {SCHEMA_VERSION}")
    need(data.get("benchmark") in BENCHMARKS, f"benchmark must be one of {BENCHMARKS}")
    for key in ("created", "commit", "device", "torch", "command"):
        need(
            isinstance(data.get(key), str) and data[key] != "", f"{key} must be a non-empty string"
        )
    need(
        isinstance(data.get("world_size"), int) and data["world_size"] >= 1,
        "world_size must be an int >= 1",
    )
    need(
        isinstance(data.get("measurements"), list) and data["measurements"],
        "measurements must be a non-empty list",
    )
    for i, m in enumerate(data["measurements"]):
        need(
            isinstance(m.get("name"), str) and m["name"], f"measurements[{i}].name must be a string"
        )
        need(isinstance(m.get("params"), dict), f"measurements[{i}].params must be an object")
        need(
            all(isinstance(v, _SCALAR) for v in m["params"].values()),
            f"measurements[{i}].params must be scalars",
        )
        need(
            isinstance(m.get("repeats"), int) and m["repeats"] >= 1,
            f"measurements[{i}].repeats must be >= 1",
        )
        for key in ("median_s", "min_s", "max_s", "spread"):
            need(
                isinstance(m.get(key), (int, float)) and m[key] >= 0,
                f"measurements[{i}].{key} must be >= 0",
            )
        need(m["min_s"] <= m["median_s"] <= m["max_s"], f"measurements[{i}]: min <= median <= max")
        need(isinstance(m.get("metrics"), dict), f"measurements[{i}].metrics must be an object")
        need(
            all(isinstance(v, (int, float)) for v in m["metrics"].values()),
            f"measurements[{i}].metrics must be numbers",
        )
        samples = m.get("samples_s", [])
        need(
            isinstance(samples, list)
            and all(isinstance(v, (int, float)) and v >= 0 for v in samples)
            and len(samples) in (0, m["repeats"]),
            f"measurements[{i}].samples_s must be one time >= 0 per repeat",
        )
    need(isinstance(data.get("derived"), dict), "derived must be an object")
    need(
        all(isinstance(v, (int, float)) for v in data["derived"].values()),
        "derived values must be numbers",
    )
    notes = data.get("notes", [])
    need(
        isinstance(notes, list) and all(isinstance(n, str) for n in notes),
        "notes, where present, must be a list of strings",
    )
