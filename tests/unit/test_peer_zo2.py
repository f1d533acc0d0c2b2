"""The ZO2 peer's parts that need no ZO2: its shapes are distzo's, and bad input is one
protocol line (the harness prints it) before anything is built."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from distzo.models.shapes import OPT_SHAPES

PEER = Path(__file__).resolve().parents[2] / "benchmarks" / "peer_zo2.py"


def load_peer():
    spec = importlib.util.spec_from_file_location("peer_zo2", PEER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_zo2_peer_builds_the_shapes_distzo_builds():
    assert load_peer().OPT_SHAPES == OPT_SHAPES


def test_hidden_override_sets_ffn_and_heads_as_the_harness_does():
    peer = load_peer()
    args = peer.parse_args(["--zo2", "x", "--system", "zo2-mezo", "--shape", "opt-125m"])
    assert peer.shape_dims(args) == (768, 12, 12, 3072)
    args = peer.parse_args(
        ["--zo2", "x", "--system", "zo2-mezo", "--shape", "opt-125m", "--layers", "4",
         "--hidden", "256"]
    )  # fmt: skip
    assert peer.shape_dims(args) == (256, 4, 4, 1024)


def run_peer(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(PEER), *argv], capture_output=True, text=True, timeout=120
    )


def test_a_missing_checkout_is_one_error_line(tmp_path):
    out = run_peer(
        "--zo2", str(tmp_path / "nope"), "--system", "zo2-mezo", "--shape", "opt-125m",
        "--device", "cpu", "--dtype", "fp32",
    )  # fmt: skip
    assert out.returncode == 1
    (line,) = out.stdout.splitlines()
    assert "not a ZO2 checkout" in json.loads(line)["error"]


def test_offload_on_cpu_is_refused_in_one_line(tmp_path):
    out = run_peer(
        "--zo2", str(tmp_path), "--system", "zo2-offload", "--shape", "opt-125m",
        "--device", "cpu",
    )  # fmt: skip
    assert out.returncode == 1
    assert "needs CUDA" in json.loads(out.stdout)["error"]


def test_a_print_of_zo2s_goes_to_stderr_not_into_the_protocol(tmp_path):
    # a stand-in checkout whose import prints, as ZO2's offload set-up does
    package = tmp_path / "zo2"
    (package / "config").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "config" / "__init__.py").write_text("")
    (package / "config" / "mezo_sgd.py").write_text(
        "print('Upload head and tail to cuda.')\nraise RuntimeError('stand-in stops here')\n"
    )
    out = run_peer(
        "--zo2", str(tmp_path), "--system", "zo2-mezo", "--shape", "opt-125m",
        "--device", "cpu", "--dtype", "fp32",
    )  # fmt: skip
    assert out.returncode == 1
    (line,) = out.stdout.splitlines()  # the error line only
    assert "stand-in stops here" in json.loads(line)["error"]
    assert "Upload head and tail to cuda." in out.stderr
