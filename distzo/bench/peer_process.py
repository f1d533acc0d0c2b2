"""The harness side of the peer protocol (``distzo.bench.peer_protocol``): one peer's
process, its requests and replies, and its end.

Each peer runs in a process session of its own, so that killing it kills what it
started (torchrun's ranks) and a Ctrl-C at the terminal reaches the harness alone, which
then ends every peer. A peer whose harness vanished reads EOF on stdin and exits.
"""

from __future__ import annotations

import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any

READY_KEYS = {"ready": bool, "system": str, "parameters": int, "build_s": (int, float)}
REPLY_KEYS = {
    "step_s": list,
    "loss": (int, float),
    "peak_rss_bytes": int,
    "peak_device_bytes": (int, type(None)),
    "device_used_bytes": (int, type(None)),
    "process_device_bytes": (int, type(None)),
}


class PeerError(Exception):
    """A peer failed, died or broke the protocol: one line naming it."""


def _meaningful(line: str) -> bool:
    """Not a rule of ``=`` or ``-`` (torchrun frames its error report with them)."""
    return any(c.isalnum() for c in line)


class PeerProcess:
    """One peer: launched at once, then driven by ``ready`` and ``request``."""

    def __init__(
        self, name: str, command: list[str], env: dict[str, str] | None, echo: bool = True
    ) -> None:
        self.name, self.command = name, command
        try:
            self.proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                # A byte that is not UTF-8 (a library's message, a path) must not end a
                # reader thread: the replies would never come, or a full stderr pipe
                # would block the peer.
                encoding="utf-8",
                errors="replace",
                bufsize=1,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            raise PeerError(f"peer {name}: cannot start {command[0]}: {exc}") from None
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr_tail: deque[str] = deque(maxlen=50)
        self.readers = [
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=self._read_stderr, args=(echo,), daemon=True),
        ]
        for reader in self.readers:
            reader.start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _read_stderr(self, echo: bool) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr_tail.append(line.rstrip())
            if echo:
                sys.stderr.write(f"[{self.name}] {line}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def last_stderr_line(self) -> str:
        """The peer's last meaningful stderr line, once its stderr is drained."""
        if self.proc.poll() is not None:
            self.readers[1].join(timeout=5)
        lines = [line for line in self.stderr_tail if _meaningful(line)]
        return lines[-1] if lines else "(nothing on stderr)"

    def _fail(self, what: str) -> PeerError:
        """The one line for a broken peer: kill it first, so its stderr is complete."""
        self.kill()
        return PeerError(
            f"peer {self.name} {what}; its last stderr line: {self.last_stderr_line()}"
        )

    def _receive(self, keys: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """The next protocol line; ``queue.Empty`` if none came within ``timeout`` s."""
        line = self.lines.get(timeout=timeout)
        if line is None:
            try:
                code = self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                code = None
            raise self._fail(f"closed its stdout (exit code {code}) before answering")
        try:
            message = json.loads(line)
        except ValueError:
            message = None
        if isinstance(message, dict) and isinstance(message.get("error"), str):
            raise self._fail(f"failed: {message['error']}")
        if not (
            isinstance(message, dict)
            and all(isinstance(message.get(k), t) for k, t in keys.items())
        ):
            raise self._fail(f"printed a non-protocol line: {line.strip()[:200]!r}")
        return message

    def ready(self, timeout: float | None = None) -> dict[str, Any] | None:
        """Wait for the ready line (the build may take minutes): None if it did not come
        within ``timeout`` seconds (then ask again)."""
        try:
            message = self._receive(READY_KEYS, timeout)
        except queue.Empty:
            return None
        if message["system"] != self.name or not message["ready"]:
            raise self._fail(f"announced {message['system']!r}, not itself, as ready")
        return message

    def _send(self, request: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._fail("stopped reading its requests") from None

    def request(self, steps: int) -> dict[str, Any]:
        """Ask for ``steps`` steps and wait for their reply."""
        self._send({"steps": steps})
        reply = self._receive(REPLY_KEYS)
        samples = reply["step_s"]
        if len(samples) != steps or not all(
            isinstance(s, (int, float)) and math.isfinite(s) and s >= 0 for s in samples
        ):
            raise self._fail(f"answered {steps} steps with step_s {samples!r:.200}")
        return reply

    def phases(self) -> dict[str, float]:
        """Ask where a step's time goes (``distzo.bench.phases``) and wait for the reply."""
        self._send({"phases": True})
        phases = self._receive({"phases": dict})["phases"]
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in phases.values()):
            raise self._fail(f"answered phases {phases!r:.200}")
        return phases

    def close(self, grace_s: float = 60.0) -> None:
        """EOF on its stdin, then its exit (killed past ``grace_s``)."""
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:  # a broken pipe: the peer is gone
                pass
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """End the peer and whatever is left in its session (torchrun's ranks)."""
        kill_all([self])

    def _signal_session(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):  # the session is empty
            pass

    def _close_stdin(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:  # a broken pipe: the peer is gone
                pass


def kill_all(peers: list[PeerProcess], term_s: float = 5.0, kill_s: float = 10.0) -> None:
    """End every peer and its session (torchrun's ranks) together: SIGTERM to all, one
    shared wait, SIGKILL to those left. Ending N peers so takes at most ``term_s + kill_s``,
    not N times that: a run cut by ``timeout --kill-after`` must still write its report."""
    for sig, wait_s in ((signal.SIGTERM, term_s), (signal.SIGKILL, kill_s)):
        running = [peer for peer in peers if peer.proc.poll() is None]
        if not running:
            break
        for peer in running:
            peer._signal_session(sig)
        deadline = time.monotonic() + wait_s
        for peer in running:
            try:
                peer.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for peer in peers:
        peer._signal_session(signal.SIGKILL)  # what its leader left behind, if anything
        peer._close_stdin()
