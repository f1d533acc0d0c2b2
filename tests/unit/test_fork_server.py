"""The fork server's children (tests.helpers.fork_server) stand for fresh interpreters: what a
program sees and what its caller gets back are the same, a timeout kills the child as
``subprocess.run`` does, and a command it cannot stand for runs fresh."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import fork_server
from tests.helpers.launch import child_env

REPORT = [sys.executable, "-m", "tests.helpers.interpreter_report"]


def served(command: list[str], env: dict[str, str], timeout: float = 60):
    proc = fork_server.run(command, env, timeout, child_env())
    assert proc is not None, "the fork server did not take the command"
    return proc


def fresh(command: list[str], env: dict[str, str]):
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("args", [["3"], ["0"], []])
def test_a_served_command_sees_and_returns_what_a_fresh_interpreter_does(args):
    env = child_env({"DISTZO_REPORT_VARIABLE": "set for this command"})
    expected, got = fresh(REPORT + args, env), served(REPORT + args, env)
    assert (got.returncode, got.stdout, got.stderr) == (
        expected.returncode,
        expected.stdout,
        expected.stderr,
    )
    seen = json.loads(got.stdout.splitlines()[0])
    assert seen["variable"] == "set for this command" and not seen["imported as itself"]
    assert seen["descriptors"][:3] == [0, 1, 2]
    assert got.stdout.splitlines()[1:] == ["thread finished", "exit handler ran"]
    assert got.stderr == "to stderr\n"  # universal newlines, as text=True gives


# A script of the kind benchmarks/ holds: what it sees of the interpreter, and its exit code
SCRIPT = """import json, os, sys
seen = {"name": __name__, "file": __file__, "argv": sys.argv, "path0": sys.path[0]}
print(json.dumps({**seen, "cwd": os.getcwd()}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def test_a_served_script_sees_and_returns_what_a_fresh_interpreter_does(tmp_path):
    script = tmp_path / "bench" / "report.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    command = [sys.executable, os.path.relpath(script), "3"]  # relative, as tests give them
    expected, got = fresh(command, child_env()), served(command, child_env())
    assert (got.returncode, got.stdout, got.stderr) == (
        expected.returncode,
        expected.stdout,
        expected.stderr,
    )
    seen = json.loads(got.stdout)
    assert seen["name"] == "__main__" and os.path.normpath(seen["file"]) == str(script)
    assert got.returncode == 3
    assert seen["path0"] == str(script.parent) and seen["argv"] == command[1:]
    # a file that is not there, or not a Python file, runs fresh (and fails as it would)
    for path in (tmp_path / "missing.py", script.with_suffix(".txt")):
        assert fork_server.run([sys.executable, str(path)], child_env(), 60, child_env()) is None


def test_a_served_command_past_its_timeout_is_killed_with_what_it_printed():
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        served(REPORT + ["--hang"], child_env(), timeout=5)
    assert '"name": "__main__"' in timed_out.value.stdout
    # what it was doing when it was stopped: its stack, in the message pytest shows
    said = str(timed_out.value)
    assert "timed out after 5 seconds" in said
    assert "(most recent call first)" in said
    assert 'interpreter_report.py", line' in said and "in <module>" in said
    # the server is free again, and serves the next command
    assert served(REPORT + ["4"], child_env()).returncode == 4


def test_what_an_import_may_have_read_is_served_by_a_server_started_with_it(tmp_path):
    """A variable an import reads (huggingface_hub's cache) is the command's in a served
    child as in a fresh one: a second server started with it serves it, and the next
    commands of that environment; a standard command ends it and finds its own server."""
    standard = child_env()
    assert served(REPORT, standard).returncode == 0
    first = fork_server._server
    hub = child_env({"HF_HUB_CACHE": str(tmp_path / "hub")})
    got = served(REPORT + ["--hub-cache"], hub)
    assert json.loads(got.stdout.splitlines()[0])["hub cache"] == str(tmp_path / "hub")
    other = fork_server._other
    assert other is not None and other is not first
    assert served(REPORT + ["7"], hub).returncode == 7 and fork_server._other is other
    assert served(REPORT, standard).returncode == 0
    assert fork_server._server is first and fork_server._other is None
    assert other.process.poll() is not None  # ended, not left running
    assert fork_server.run(REPORT, child_env({fork_server.SWITCH: "0"}), 60, standard) is None
    python3 = ["python3", "-m", "tests.helpers.interpreter_report"]
    assert fork_server.run(python3, standard, 60, standard) is None


def test_a_timeout_of_long_stderr_reports_its_end_where_the_stacks_are():
    """The stacks a timed-out command's processes dump come last: a stderr past the
    reported length is cut from its beginning, not its end."""
    err = "x" * fork_server.REPORTED_CHARS + "the stacks\n"
    message = str(fork_server.Timeout(["cmd"], 5, "", err))
    assert message.endswith(err[-fork_server.REPORTED_CHARS :])
    assert "the stacks" in message and message.count("x") < fork_server.REPORTED_CHARS
