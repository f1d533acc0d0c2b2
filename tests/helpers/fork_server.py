"""A process that has imported the entry points once and forks a child for each
``python -m MODULE ARGS`` a test runs: the child runs MODULE as ``__main__`` (as ``python -m``
does) with the test's environment, working directory and captured output, as a fresh
interpreter would, without the seconds of imports a fresh interpreter spends.

Why: the suite runs about a hundred single-process trainings, replays and launchers
(``tests.helpers.launch``), each of which spent about 5 s of CPU importing torch and
transformers on a two-core CI machine before a second of work.

``run(command, env, timeout, standard)`` serves a command of the form ``[sys.executable, "-m",
MODULE, *ARGS]`` or ``[sys.executable, SCRIPT.py, *ARGS]`` (a benchmark script) when nothing
about it could tell a forked child from a fresh interpreter, and returns ``None`` otherwise
(the caller then runs a fresh one): another interpreter, a server busy with another command
of this process. (A served script could import a module the server imported that a fresh
one could not find, ``tests`` say; the benchmark scripts import only installed packages.)
``DISTZO_TEST_FORK_SERVER=0`` turns it off.

The server's environment is the caller's standard one; a command whose environment differs
from it in anything but the variables the product reads at run time (an import may have read
it: ``HF_HUB_CACHE``, which huggingface_hub reads at import, say) is served by a second
server started with that environment, which serves the test's next commands of that
environment too (a hub test's train, resume and replays: one start of imports, not one per
command), and ends when a standard command comes.

The server (``python -m tests.helpers.fork_server``) reads one JSON request per line on stdin
and answers on stdout with the child's pid, then its wait status. The child is the leader of a
new process group, so that a timeout kills it and whatever it started (a launch's ranks). When
the server's stdin closes (the test process ended, by a Ctrl-C say), it kills a child still
running and exits.

A command past its timeout is first asked for its stacks: the child (and every process it
forks, a launch's agent and ranks) dumps every thread's Python stack to its stderr on
``DUMP_SIGNAL`` (``faulthandler``), and the ``TimeoutExpired`` raised says the end of that
stderr. A CI run once lost a 4-rank launch to its 180 s timeout with nothing to tell what
any rank was doing. This is the one way a child differs from a fresh interpreter: SIGUSR2
dumps the stacks instead of ending it.
"""

from __future__ import annotations

import atexit
import builtins
import faulthandler
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from distzo.job.preemption import Handler

# What the server imports before it forks: every entry point a test runs as a child.
PRELOAD = (
    "distzo.train",
    "distzo.replay",
    "tests.helpers.faulty_train",
    "tests.helpers.preloaded_torchrun",
)
# Variables that may differ between the server and a request: the product reads them when it
# runs, not when it is imported (pytest's name of the test; the injected failures).
RUN_TIME_VARIABLES = ("PYTEST_CURRENT_TEST",)
RUN_TIME_PREFIXES = ("DISTZO_",)
SWITCH = "DISTZO_TEST_FORK_SERVER"
POLL_S = 0.02
SETUP_FAILED = 70  # EX_SOFTWARE: the child failed before it could run the command
# Past its timeout, a command's processes dump their stacks on this signal (no one else here
# uses it: distzo stops on SIGUSR1, torchrun's agent handles SIGTERM, SIGINT, SIGHUP, SIGQUIT),
# and get this long to write them before they are killed.
DUMP_SIGNAL = signal.SIGUSR2
DUMP_WAIT_S = 2.0
# How much of the stderr the TimeoutExpired's message says (an agent and 4 ranks: ~25 KB)
REPORTED_CHARS = 40_000
REPO = Path(__file__).resolve().parents[2]


# The server side.


def serve() -> None:
    # what exec gave this interpreter, and gives a fresh one the test process starts:
    # default_int_handler, or SIG_IGN where the test run ignores SIGINT (a background job)
    fresh_sigint = signal.getsignal(signal.SIGINT)
    requests, replies = _Lines(os.dup(0)), os.dup(1)  # the protocol's own descriptors
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    for module in PRELOAD:
        importlib.import_module(module)
    # A Ctrl-C to the test run reaches the test process, whose exit closes the requests'
    # pipe: the server then kills its child, as it must live to do.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    reply = os.fdopen(replies, "w", buffering=1)
    reply.write("ready\n")
    while line := requests.readline():
        request = json.loads(line)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            _child(request, (requests.fd, replies, devnull), fresh_sigint)
        reply.write(json.dumps({"pid": pid}) + "\n")
        status = _wait(pid, requests)
        if status is None:  # the test process is gone
            return
        reply.write(json.dumps({"status": status}) + "\n")


def _wait(pid: int, requests: _Lines) -> int | None:
    """The child's wait status; ``None`` (the child killed) if the requests' pipe closes."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if requests.readline(POLL_S) == b"":
            _kill_group(pid)
            os.waitpid(pid, 0)
            return None


class _Lines:
    """Lines from a pipe, read without a buffer that ``select`` cannot see into."""

    def __init__(self, fd: int) -> None:
        self.fd, self.pending = fd, b""

    def readline(self, timeout: float | None = None) -> bytes | None:
        """The next line, ``b""`` at the end of the pipe, ``None`` if none came in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.pending:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.fd], [], [], wait)[0]:
                return None
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return b""
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line + b"\n"


def _child(request: dict, inherited: tuple[int, ...], sigint: Handler) -> None:
    """Run the request as a fresh ``python -m`` (or ``python SCRIPT``) would, then leave
    without returning."""
    code = SETUP_FAILED
    try:
        signal.signal(signal.SIGINT, sigint)
        os.setpgid(0, 0)
        for fd in inherited:
            os.close(fd)
        code = _run_command(request)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _run_command(request: dict) -> int:
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    # to the captured stderr (fd 2), inherited by every process the command forks
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True)
    script = request.get("script")
    try:
        if script is not None:
            _run_script(script, request["args"])
        else:
            sys.path[0] = os.getcwd()  # as ``python -m`` puts it
            sys.argv = [request["module"], *request["args"]]
            # A fresh ``python -m MODULE`` has no module of that name (it runs as __main__)
            sys.modules.pop(request["module"], None)
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        code = _exit_code(exit_.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        _die_of(signal.SIGINT)  # as an interpreter does after an uncaught Ctrl-C
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _finalize()
    return code


def _run_script(script: str, args: list[str]) -> None:
    """``script`` as ``python SCRIPT ARGS`` runs it: its folder first on the path, argv[0]
    as given, and a new ``__main__`` whose ``__file__`` is the path joined to the working
    directory (``runpy.run_path`` would set both to the one path it is given)."""
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    sys.argv = [script, *args]
    main = types.ModuleType("__main__")
    main.__file__ = os.path.join(os.getcwd(), script)
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    with open(main.__file__, "rb") as source:
        code = compile(source.read(), main.__file__, "exec")
    exec(code, main.__dict__)


def _exit_code(code: object) -> int:
    """``sys.exit(code)``'s exit status, as the interpreter turns it into one."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _die_of(sig: signal.Signals) -> NoReturn:
    _finalize()
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)  # the signal is delivered before kill returns: not reached


def _finalize() -> None:
    """What an interpreter does at exit: wait for its non-daemon threads, run the exit
    handlers, flush its output."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# The test process's side.


class _Server:
    """One server per test process, started with the standard environment of its commands."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self.busy = threading.Lock()
        self.folder = tempfile.TemporaryDirectory(prefix="fork-server-")
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__],
            cwd=REPO,  # where ``-m`` finds ``tests``, whatever folder the test is in
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=self.env,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self.requests, self.replies = self.process.stdin, _Lines(self.process.stdout.fileno())
        if self.replies.readline() != b"ready\n":
            raise RuntimeError(f"the fork server did not start (exit {self.process.wait()})")

    def run(self, command: Sequence[str], env: Mapping[str, str], timeout: float):
        """``command``: ``[sys.executable, "-m", MODULE, *ARGS]`` or ``[sys.executable,
        SCRIPT, *ARGS]``."""
        stdout, stderr = (Path(self.folder.name) / name for name in ("stdout", "stderr"))
        if command[1] == "-m":
            request: dict = dict(module=command[2], args=list(command[3:]))
        else:
            request = dict(script=command[1], args=list(command[2:]))
        request.update(env=dict(env), cwd=os.getcwd(), stdout=str(stdout), stderr=str(stderr))
        self.requests.write(json.dumps(request).encode() + b"\n")
        self.requests.flush()
        pid = json.loads(self._reply())["pid"]
        reply = self.replies.readline(timeout)
        timed_out = reply is None
        if timed_out:  # as subprocess.run does: kill it (its stacks dumped first)
            reply = self._dump_stacks(pid)
            if reply is None:
                _kill_group(pid)
        status = json.loads(reply or self._reply())["status"]
        outputs = [_read_text(path) for path in (stdout, stderr)]
        command = list(command)
        if timed_out:
            raise Timeout(command, timeout, *outputs)
        code = os.waitstatus_to_exitcode(status)
        return subprocess.CompletedProcess(command, code, *outputs)

    def _dump_stacks(self, pid: int) -> bytes | None:
        """Ask every process of the command's group for its stacks, and give them
        ``DUMP_WAIT_S`` to write them; the command's status if it ended meanwhile."""
        try:
            os.killpg(pid, DUMP_SIGNAL)
        except ProcessLookupError:
            pass
        return self.replies.readline(DUMP_WAIT_S)

    def _reply(self) -> bytes:
        reply = self.replies.readline()
        if not reply:
            raise RuntimeError(f"the fork server died (exit {self.process.wait()})")
        return reply

    def close(self) -> None:
        self.requests.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.folder.cleanup()


class Timeout(subprocess.TimeoutExpired):
    """A served command past its timeout, whose message ends with the end of its stderr:
    the stacks its processes dumped, which pytest shows where it shows the failure."""

    def __str__(self) -> str:
        err = self.stderr if isinstance(self.stderr, str) else ""
        tail = err[-REPORTED_CHARS:]
        return f"{super().__str__()}; the end of its stderr, the stacks of its processes:\n{tail}"


def _import_time(env: Mapping[str, str]) -> dict[str, str]:
    """The part of an environment that an import may have read."""
    return {
        k: v
        for k, v in env.items()
        if k not in RUN_TIME_VARIABLES and not k.startswith(RUN_TIME_PREFIXES)
    }


def _read_text(path: Path) -> str:
    """A captured output as ``subprocess.run(..., text=True)`` returns it (universal newlines)."""
    text = path.read_bytes().decode()
    return text.replace("\r\n", "\n").replace("\r", "\n")


_server: _Server | None = None  # the standard environment's
_other: _Server | None = None  # the last command's, where its import-time one was another


def run(
    command: Sequence[str], env: Mapping[str, str], timeout: float, standard: Mapping[str, str]
) -> subprocess.CompletedProcess | None:
    """``command`` (``[sys.executable, "-m", MODULE, *ARGS]``, or ``[sys.executable, SCRIPT,
    *ARGS]`` for a file ending in .py) run by a child of a fork server, or ``None`` where it
    cannot stand for a fresh interpreter. The server runs with the ``standard`` environment
    of the caller's commands (a new server if that changed); an ``env`` that differs from it
    in more than run-time variables is served by a server started with ``env``'s."""
    global _server, _other
    if env.get(SWITCH) == "0" or not _servable(command):
        return None
    if _server is not None and not _serves(_server, standard):
        stop()
    if _import_time(env) == _import_time(standard):
        _stop_other()
        if _server is None:
            _server = _start(standard)
        server = _server
    else:
        if _other is not None and not _serves(_other, env):
            _stop_other()
        if _other is None:
            _other = _start(_import_time(env))
        server = _other
    if not server.busy.acquire(blocking=False):  # another thread's command is running
        return None
    try:
        return server.run(command, env, timeout)
    finally:
        server.busy.release()


def _start(env: Mapping[str, str]) -> _Server:
    atexit.unregister(stop)  # once, whichever servers start
    atexit.register(stop)
    return _Server(env)


def _serves(server: _Server, env: Mapping[str, str]) -> bool:
    """Whether ``server`` is alive and can stand for a fresh interpreter given ``env``."""
    return server.process.poll() is None and _import_time(server.env) == _import_time(env)


def _servable(command: Sequence[str]) -> bool:
    """``python -m MODULE ...``, or ``python SCRIPT.py ...`` for a script that exists, of this
    interpreter."""
    if len(command) < 2 or command[0] != sys.executable:
        return False
    if command[1] == "-m":
        return len(command) >= 3
    return command[1].endswith(".py") and os.path.isfile(command[1])


def stop() -> None:
    """End this process's servers (the next command starts a new one)."""
    global _server
    _stop_other()
    if _server is not None:
        _server.close()
        _server = None


def _stop_other() -> None:
    global _other
    if _other is not None:
        _other.close()
        _other = None


if __name__ == "__main__":
    serve()
