"""Ending the peers of a benchmark run: all together, so that a run cut at its time limit
still has the seconds to write its partial report."""

from __future__ import annotations

import sys
import time

from distzo.bench.peer_process import PeerProcess, kill_all

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
