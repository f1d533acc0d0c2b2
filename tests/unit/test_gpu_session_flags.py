"""Every command gpu_session.sh would run on a lent GPU, checked against its script's parser
here, on the CPU: a renamed or re-typed flag otherwise surfaces only after a 15-minute
lease's start-up minutes (the dry run prints the commands; nothing ran them)."""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import child_env
from tests.helpers.scripts import BENCHMARKS, benchmark_script

ROOT = BENCHMARKS.parent
SESSION = BENCHMARKS / "gpu_session.sh"
DRY_RUN_LINE = re.compile(r"^\+ (python3 .*?)  \(at most \d+ s; dry run\)$")


def session_stages() -> list[str]:
    """Every name the script's stage check takes (the lists `peers`, `all1`.. `brief` too)."""
    check = SESSION.read_text().split('for stage in "${STAGES[@]}"; do', 1)[1].split("esac", 1)[0]
    names = re.findall(r"^\s+([a-z0-9.|-]+)\) RUN\+=", check, re.MULTILINE)
    return [name for pattern in names for name in pattern.split("|")]


def dry_run_commands(out: Path) -> list[list[str]]:
    """The python commands of a dry run of every stage, with README's PEERS_ARGS."""
    env = {"OUT": str(out), "DRY_RUN": "1", "PEERS_ARGS": "--distzo-perturb-scope module"}
    proc = subprocess.run(
        ["bash", str(SESSION), *session_stages()],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=child_env(env),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("+ ")]
    matches = [DRY_RUN_LINE.match(line) for line in lines]
    assert all(matches), [line for line, m in zip(lines, matches) if not m]
    return [shlex.split(m.group(1)) for m in matches if m]


def with_zo2(commands: list[list[str]], checkout: Path) -> list[list[str]]:
    """Each peers.py command again with the ZO2 peer's flags the script adds where
    .peers/zo2 was carried (pointed at a stand-in checkout: the dry run here has none)."""
    flags = re.search(r"ZO2_ARGS=\((--zo2 [^)]*)\)", SESSION.read_text())
    assert flags, "gpu_session.sh no longer sets ZO2_ARGS=(--zo2 ...)"
    marker = checkout / "zo2" / "optimizer" / "mezo_sgd" / "zo2.py"
    marker.parent.mkdir(parents=True)
    marker.touch()
    zo2 = [str(checkout) if f == ".peers/zo2" else f for f in shlex.split(flags.group(1))]
    peers = [argv for argv in commands if argv[1] == "benchmarks/peers.py"]
    assert peers and all(argv[-2] == "--out" for argv in peers)
    return [argv[:-2] + zo2 + argv[-2:] for argv in peers]  # before --out, as peers_at puts them


def refusal(check, *args) -> str | None:
    """The parser's one-line refusal (argparse's error, a SystemExit's text), else None."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            check(*args)
    except SystemExit as exc:
        return (stderr.getvalue().strip().splitlines() or [str(exc.code)])[-1]
    return None


def benchmark_refusal(script: str, argv: list[str]) -> str | None:
    """The script's parser on ``argv``, each flag spelled in full, then the checks that
    run before any work and need no GPU: throughput's settled defaults, noise's ops, the
    peers' systems. CUDA is claimed present: the lease's machine has it."""
    with benchmark_script(script) as module:
        parser = module.build_parser()
        parser.allow_abbrev = False  # a flag cut short breaks once a longer sibling is added
        found = refusal(parser.parse_args, argv)
        if found is not None or not hasattr(module, "parse_args"):
            return found
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.cuda, "is_available", lambda: True)
            if script == "peers":
                return refusal(lambda: module.choose_systems(module.parse_args(argv)))
            return refusal(module.parse_args, argv)


def defined_tests(path: Path) -> set[str]:
    """The test functions a file defines, read without importing it (as -k would see them)."""
    return {
        node.name
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test")
    }


def pytest_refusal(pytestconfig: pytest.Config, argv: list[str]) -> str | None:
    """pytest's own parser on the options; the files it names exist, its -k word names a
    test there and its -m marker is registered and marks a test."""
    # this session's parser: pytest's options and every installed plugin's (xdist's -n)
    options, unknown = pytestconfig._parser.parse_known_and_unknown_args(argv)
    if unknown:
        return f"pytest does not take {' '.join(unknown)}"
    files = [ROOT / name.split("::")[0] for name in options.file_or_dir]
    if missing := [str(f) for f in files if not f.is_file()]:
        return f"no test file {', '.join(missing)}"
    if options.keyword:
        if not re.fullmatch(r"\w+", options.keyword):
            return f"-k {options.keyword!r}: teach this test the expression"
        if not any(options.keyword.lower() in n.lower() for f in files for n in defined_tests(f)):
            return f"-k {options.keyword} names no test of {', '.join(map(str, files))}"
    if options.markexpr:
        registered = [line.split(":")[0] for line in pytestconfig.getini("markers")]
        if options.markexpr not in registered:
            return f"-m {options.markexpr}: no such marker registered"
        marked = files or list((ROOT / "tests").rglob("test_*.py"))
        if not any(f"mark.{options.markexpr}" in f.read_text() for f in marked):
            return f"-m {options.markexpr} marks no test"
    return None


def test_every_gpu_session_command_is_accepted_by_its_script(tmp_path, pytestconfig):
    commands = dry_run_commands(tmp_path / "out")
    commands += with_zo2(commands, tmp_path / "zo2")
    scripts = {argv[1] for argv in commands if argv[1].startswith("benchmarks/")}
    assert {"benchmarks/noise.py", "benchmarks/throughput.py", "benchmarks/peers.py"} <= scripts
    assert any(argv[1:3] == ["-m", "pytest"] for argv in commands)
    refused = []
    for argv in commands:
        if argv[1:3] == ["-m", "pytest"]:
            found = pytest_refusal(pytestconfig, argv[3:])
        else:
            match = re.fullmatch(r"benchmarks/(\w+)\.py", argv[1])
            assert match, f"not a benchmark script: {shlex.join(argv)}"
            found = benchmark_refusal(match.group(1), argv[2:])
        if found is not None:
            refused.append(f"{shlex.join(argv)}\n    -> {found}")
    assert not refused, "gpu_session.sh runs commands their scripts refuse:\n" + "\n".join(refused)
