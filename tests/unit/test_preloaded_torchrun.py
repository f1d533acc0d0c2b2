"""The tests' preloaded launcher (``tests.helpers.preloaded_torchrun``) starts its forked
ranks as torchrun starts fresh ones, as far as the ranks can tell, run fresh or by the fork
server (``tests.helpers.fork_server``)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import fork_server
from tests.helpers.launch import child_env, free_port, torchrun_command

REPORT = "tests.helpers.signal_dispositions"
FRESH = [
    f"rank {rank}: SIGTERM=SIG_DFL SIGINT=default_int_handler SIGHUP=SIG_DFL SIGQUIT=SIG_DFL"
    for rank in (0, 1)
]
# runs the rest of its command line with SIGHUP ignored, as nohup does, and SIGINT, as a
# shell does for a job it starts in the background
IGNORING_HUP_AND_INT = [
    sys.executable,
    "-c",
    "import os, signal, sys\n"
    "for sig in (signal.SIGHUP, signal.SIGINT): signal.signal(sig, signal.SIG_IGN)\n"
    "os.execv(sys.argv[1], sys.argv[1:])",
]


def rank_lines(preload: bool, served: bool = False, ignoring: bool = False) -> list[str]:
    command = torchrun_command(2, [], free_port(), module=REPORT, preload=preload)
    if ignoring:
        command = IGNORING_HUP_AND_INT + command
    if served:
        proc = fork_server.run(command, child_env(), 120, standard=child_env())
        assert proc is not None, "the fork server did not take the launch"
    else:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))


def test_forked_ranks_start_with_a_fresh_interpreters_signal_handling():
    # The agent handles SIGTERM, SIGINT, SIGHUP and SIGQUIT itself before it starts the ranks;
    # a forked rank that kept those handlers would die of a SIGTERM by an exception instead.
    assert rank_lines(preload=False) == FRESH
    assert rank_lines(preload=True) == FRESH
    assert rank_lines(preload=True, served=True) == FRESH


def test_forked_ranks_of_a_launcher_that_ignores_sighup_and_sigint_catch_them_as_fresh_ones():
    # The agent catches SIGHUP and SIGINT, so exec gives a fresh rank their defaults even
    # under nohup or in the background; a forked rank must not go back to ignoring them.
    assert rank_lines(preload=False, ignoring=True) == FRESH
    assert rank_lines(preload=True, ignoring=True) == FRESH
