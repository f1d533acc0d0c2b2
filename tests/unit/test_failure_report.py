"""A rank's failure as torchrun reports it: the error file's format, which errors mean "a
peer died", and the quiet exit of a rank stopped by a peer (torchrun's side: the
integration test tests/integration/test_root_cause.py)."""

from __future__ import annotations

import errno
import logging
import signal
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from distzo.dist.failure_report import (
    ERROR_FILE,
    ERRORS,
    _first_sentence,
    await_torchrun,
    is_peer_failure,
    report_peer_failure,
)

GLOO_PEER_GONE = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:19655. This is typically caused by a remote worker crashing."
)


def test_a_recorded_line_is_what_torchruns_summary_shows(tmp_path, monkeypatch):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE, str(error_file))
    ERRORS.record_message("error: --batch-size must be >= 1, got 0")
    assert not (tmp_path / "error.json.tmp").exists()
    failure = ProcessFailure(local_rank=0, pid=123, exitcode=2, error_file=str(error_file))
    assert abs(failure.timestamp - time.time()) < 5
    summary = str(ChildFailedError("distzo.train", {0: failure}))
    assert "traceback : error: --batch-size must be >= 1, got 0\n" in summary


def test_an_error_file_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """torchrun parses the file for its summary: a half-written one (a full disk) would be
    read as the rank's error instead of nothing."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE, str(error_file))

    def disk_fills(data, out) -> None:
        out.write('{"message": {"mess')
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("distzo.dist.failure_report.json.dump", disk_fills)
    with pytest.raises(OSError, match="No space left"):
        ERRORS.record_message("error: anything")
    assert not error_file.exists()


def test_without_torchrun_nothing_is_recorded(tmp_path, monkeypatch):
    monkeypatch.delenv(ERROR_FILE, raising=False)
    monkeypatch.chdir(tmp_path)
    ERRORS.record_message("error: anything")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "err, peer",
    [
        (RuntimeError(GLOO_PEER_GONE), True),
        (RuntimeError("[pair.cc:589] Read error [127.0.0.1]:1: Connection reset by peer"), True),
        (RuntimeError("Timed out waiting 600000ms for recv operation to complete"), True),
        (dist.DistBackendError("NCCL communicator was aborted on rank 1"), True),
        (dist.DistNetworkError("failed to recv, got 0 bytes"), True),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
        (ValueError("Connection closed by peer"), False),  # not a backend's error type
        (KeyError("weight"), False),
    ],
)
def test_which_errors_mean_a_peer_failed(err, peer):
    assert is_peer_failure(err) is peer


def test_a_rank_stopped_by_a_peer_says_one_line_and_records_nothing_while_torchrun_acts(
    tmp_path, monkeypatch, caplog
):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE, str(error_file))
    recorded_before_the_wait = []
    monkeypatch.setattr(
        "distzo.dist.failure_report.time.sleep",
        lambda s: recorded_before_the_wait.append((s, error_file.exists())),
    )
    with caplog.at_level(logging.ERROR, logger="distzo.train"):
        code = report_peer_failure(RuntimeError(GLOO_PEER_GONE), rank=0, step=3, grace_s=7.0)
    assert code == 1
    # it waited for torchrun's SIGTERM with nothing recorded (the peer is the root cause) ...
    assert recorded_before_the_wait == [(7.0, False)]
    # ... and, none having come, records its own line
    [line] = [r.getMessage() for r in caplog.records]
    assert line == (
        "rank 0 stopped in step 3: another rank failed or went silent (Connection closed by "
        "peer [127.0.0.1]:19655); that rank's error, above and in torchrun's summary, is the "
        "cause"
    )
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    assert failure.message["message"] == line


def test_without_torchrun_a_rank_stopped_by_a_peer_does_not_wait(monkeypatch, caplog):
    monkeypatch.delenv(ERROR_FILE, raising=False)
    monkeypatch.setattr("distzo.dist.failure_report.time.sleep", pytest.fail)
    with caplog.at_level(logging.ERROR, logger="distzo.train"):
        assert report_peer_failure(dist.DistBackendError("aborted"), 1, 0, grace_s=7.0) == 1
    # ranks started by hand: no torchrun summary to point at
    [line] = [r.getMessage() for r in caplog.records]
    assert line.endswith("that rank's error, in its own output, is the cause")


def test_a_quiet_rank_leaves_the_line_to_its_nodes_first_rank(monkeypatch, tmp_path, capsys):
    """Once a rank other than 0 exited at once on bad input every rank shares, and torchrun
    could end rank 0 before rank 0 printed it: the run stopped with no error line at all."""
    from distzo.dist import LaunchEnv
    from distzo.train import _failed

    monkeypatch.setenv(ERROR_FILE, str(tmp_path / "error.json"))
    waits: list[float] = []
    monkeypatch.setattr("distzo.dist.failure_report.time.sleep", waits.append)
    quiet = LaunchEnv(rank=1, world_size=2, local_rank=1, local_world_size=2, launched=True)
    assert _failed(quiet, "--dp 3 x --pert 2 = 6 does not match the 2 launched ranks") == 2
    assert waits == [10.0] and capsys.readouterr().err == ""
    speaker = LaunchEnv(rank=0, world_size=2, launched=True)
    assert _failed(speaker, "the same line") == 2
    assert waits == [10.0] and capsys.readouterr().err.startswith("error: the same line")
    # node 1's first rank: its torchrun never learns that rank 0 exited, so it says the line
    # to its node's log and exits, rather than waiting 10 s in vain
    node1 = LaunchEnv(rank=1, world_size=2, node_rank=1, launched=True)
    assert _failed(node1, "another model on node 1") == 2
    assert waits == [10.0] and capsys.readouterr().err == "error: another model on node 1\n"
    monkeypatch.delenv(ERROR_FILE)  # ranks started by hand: each says it, none waits
    assert _failed(quiet, "said by rank 1 too") == 2
    assert waits == [10.0] and "said by rank 1 too" in capsys.readouterr().err


def test_a_backends_long_error_is_cut_to_its_gist():
    # gloo's and NCCL's errors run to many lines and kilobytes; the line names the cause
    err = RuntimeError("[gloo/transport.cc:12] Connection closed by peer " + "x" * 500)
    message = _first_sentence(err)
    assert message.startswith("Connection closed by peer x") and len(message) == 160


def test_a_backend_error_without_a_message_is_named_by_its_type():
    assert _first_sentence(dist.DistBackendError("")) == "DistBackendError"
    assert _first_sentence(RuntimeError(" \n")) == "RuntimeError"


def test_the_wait_for_torchrun_lets_its_sigterm_end_the_process(tmp_path, monkeypatch):
    """A handler left in place (a callback's, a fork server's) would note torchrun's SIGTERM
    and keep waiting; the rank would then record its own line as if no peer had failed."""
    monkeypatch.setenv(ERROR_FILE, str(tmp_path / "error.json"))
    handlers: list[object] = []
    monkeypatch.setattr(
        "distzo.dist.failure_report.time.sleep",
        lambda s: handlers.append(signal.getsignal(signal.SIGTERM)),
    )
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        await_torchrun(0.5)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert handlers == [signal.SIG_DFL]


class FailingTrainer:
    """A ``Trainer`` stand-in for ``main``'s failure paths: ``train`` raises ``raised``
    (after a SIGTERM of its own where ``signalled``); ``close`` is counted."""

    raised: BaseException = ValueError("unset")
    signalled = False
    last: FailingTrainer  # the one main built last

    def __init__(self, config, env, callbacks) -> None:
        self.closed, self.step, self.run_dir = 0, 3, "the run"
        # what main sets for --export-best (the run's lock kept past its end)
        self.held = SimpleNamespace(lock_past_end=False)
        FailingTrainer.last = self

    def train(self, signals) -> None:
        if self.signalled:
            import signal

            signals.defer()  # in the steps: StopSignals only notes a signal
            signal.raise_signal(signal.SIGTERM)
        raise self.raised

    def close(self) -> None:
        self.closed += 1


def failing_main(monkeypatch, raised: BaseException, world: int = 1, signalled: bool = False):
    """``train.main([])`` of a ``world``-rank job whose training raises ``raised``."""
    from types import SimpleNamespace

    from distzo import train
    from distzo.dist import LaunchEnv
    from distzo.job import trainer

    env = LaunchEnv(rank=0, world_size=world, launched=world > 1)
    monkeypatch.setattr(train, "LaunchEnv", SimpleNamespace(from_environ=lambda: env))
    monkeypatch.setattr(trainer, "Trainer", FailingTrainer)
    monkeypatch.setattr(FailingTrainer, "raised", raised)
    monkeypatch.setattr(FailingTrainer, "signalled", signalled)
    monkeypatch.delenv(ERROR_FILE, raising=False)
    return train.main([])


def test_a_failed_training_closes_its_run_and_exits_by_the_kind_of_failure(monkeypatch, capsys):
    import errno

    full = OSError(errno.ENOSPC, "No space left on device")
    assert failing_main(monkeypatch, full) == 1  # a failure, not bad input
    assert FailingTrainer.last.closed == 1
    assert capsys.readouterr().err.startswith("error: ")
    assert failing_main(monkeypatch, ValueError("--lr is refused")) == 2
    assert FailingTrainer.last.closed == 1
    assert capsys.readouterr().err == "error: --lr is refused\n"


def test_a_backend_error_of_a_lone_rank_is_its_own_not_a_peers(monkeypatch):
    # no peer to blame: the traceback, after the run is closed
    with pytest.raises(dist.DistBackendError, match="aborted"):
        failing_main(monkeypatch, dist.DistBackendError("aborted"))
    assert FailingTrainer.last.closed == 1


@pytest.mark.parametrize("signalled, grace", [(False, 10.0), (True, 0.0)])
def test_a_rank_stopped_by_a_signal_reports_a_peers_failure_without_waiting(
    monkeypatch, signalled, grace
):
    """torchrun's SIGTERM to the survivors of a dead peer: no grace for the peer's report,
    which would be killed by torchrun mid-wait."""
    from distzo import train

    graces: list[float] = []
    monkeypatch.setattr(
        train, "report_peer_failure", lambda err, rank, step, g: graces.append(g) or 1
    )
    assert failing_main(monkeypatch, dist.DistBackendError("aborted"), 2, signalled) == 1
    assert graces == [grace] and train.PEER_REPORT_GRACE_S == 10.0


def test_only_rank_0_logs_below_warnings(monkeypatch):
    from distzo.dist import LaunchEnv
    from distzo.train import configure_logging

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # basicConfig configures a bare root only
    monkeypatch.setattr(root, "level", root.level)
    configure_logging(LaunchEnv(rank=1, world_size=2, launched=True))
    assert root.level == logging.WARNING
    monkeypatch.setattr(root, "handlers", [])
    configure_logging(LaunchEnv(rank=0, world_size=2, launched=True))
    assert root.level == logging.INFO


@pytest.mark.parametrize("before_training", [False, True])
def test_a_preemption_is_said_as_a_warning_not_an_error(monkeypatch, caplog, before_training):
    """A stop that was asked for: logged at WARNING (log scanners alert on ERROR), with the
    preemption's exit code and the run closed only where no step ran."""
    from distzo.job.preemption import EXIT_PREEMPTED, Preempted

    stopped = Preempted(5, "SIGTERM", before_training=before_training)
    with caplog.at_level(logging.INFO, logger="distzo.train"):
        assert failing_main(monkeypatch, stopped) == EXIT_PREEMPTED
    [record] = [r for r in caplog.records if r.name == "distzo.train"]
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("preempted: stopped ")
    assert FailingTrainer.last.closed == int(before_training)
