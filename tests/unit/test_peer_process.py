"""Ending the peers of a benchmark run: all together, so that a run cut at its time limit
still has the seconds to write its partial report."""

from __future__ import annotations

import sys
import time

import pytest

from distzo.bench.peer_process import PeerError, PeerProcess, kill_all

# A peer that ignores SIGTERM (one stuck in a CUDA call, say) and tells when it is ready.
STUBBORN = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('up', flush=True)\n"
    "time.sleep(60)\n"
)


def _stubborn_peers(count: int) -> list[PeerProcess]:
    peers = [
        PeerProcess(f"peer{i}", [sys.executable, "-c", STUBBORN], None, echo=False)
        for i in range(count)
    ]
    for peer in peers:
        assert peer.lines.get(timeout=30) == "up\n"
    return peers


def test_peers_that_ignore_sigterm_end_together_within_one_wait():
    """Once each was waited on in turn, 5 s of SIGTERM apiece: six stuck peers took 30 s
    and more, past `timeout --kill-after=20`, which then killed the harness before its
    partial report was written."""
    peers = _stubborn_peers(4)
    began = time.monotonic()
    kill_all(peers, term_s=2.0, kill_s=10.0)
    took = time.monotonic() - began
    assert all(peer.proc.poll() is not None for peer in peers)
    # one shared SIGTERM wait (2 s), then SIGKILL, which ends them at once: not 4 x 2 s
    assert took < 6.0, took


def test_kill_ends_one_peer_and_is_safe_twice():
    (peer,) = _stubborn_peers(1)
    peer.kill()
    assert peer.proc.poll() is not None
    peer.kill()  # already gone: nothing to do, no error


# A peer that writes a byte that is not UTF-8 on ``stream`` (then 200 kB and a last line
# on stderr), then its ready line.
_NOT_UTF8 = """
import json, sys
stream = getattr(sys, sys.argv[1]).buffer
stream.write(b"caf\\xe9\\n"); stream.flush()
sys.stderr.buffer.write(b"x" * 200000 + b"\\nlast\\n"); sys.stderr.flush()
ready = {"ready": True, "system": "p", "parameters": 1, "build_s": 0.1}
print(json.dumps(ready), flush=True)
sys.stdin.readline()
"""


def test_bytes_that_are_not_utf8_neither_stop_stderr_nor_hide_the_ready_line():
    """A reader thread died at a byte that is not UTF-8: on stderr the pipe was no longer
    read, so a peer that went on writing blocked and its ready line never came; on stdout
    no line came after it, and the harness waited for ever."""
    peer = PeerProcess("p", [sys.executable, "-c", _NOT_UTF8, "stderr"], None, echo=False)
    try:
        assert peer.ready(timeout=20) is not None
        peer.close(grace_s=20)
        assert peer.last_stderr_line() == "last"
    finally:
        peer.kill()
    peer = PeerProcess("p", [sys.executable, "-c", _NOT_UTF8, "stdout"], None, echo=False)
    try:
        with pytest.raises(PeerError, match="printed a non-protocol line: 'caf\ufffd'"):
            peer.ready(timeout=20)
    finally:
        peer.kill()
