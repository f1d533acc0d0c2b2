"""What rank 0 reads to resume a long run, at each restart: the seed log parsed once (the
gap check's parse serving the catch-up, which reads only the records past the checkpoint),
the logs rewritten only where the resume drops something, metrics.jsonl parsed once for
both its truncation and the loss curve. Each of these read or rewrote a million-step
run's files whole (seconds each) before."""

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from distzo.dist import ParallelContext
from distzo.engine import ZOEngine
from distzo.job import jsonl_text, seed_log
from distzo.job.resume import catch_up_from_log
from distzo.job.run_dir import check_log_leads_to_checkpoint
from distzo.job.run_logs import RunLogs, truncate_jsonl

HEADER = {"kind": "header", "run_seed": 0}
OLD = 1_000_000_000  # an mtime (ns) no write leaves


def write_run(run: Path, steps: int, checkpoint: int) -> None:
    """A run directory: a seed log and metrics of ``steps`` steps, a checkpoint folder."""
    (run / "checkpoints" / f"step-{checkpoint}").mkdir(parents=True)
    (run / "checkpoints" / f"step-{checkpoint}" / ".metadata").write_bytes(b"")
    records = [{"step": s, "projected_grads": [0.5 + s], "lr": 0.1} for s in range(steps)]
    lines = [json.dumps(HEADER), *(json.dumps(r) for r in records)]
    (run / "seedlog.jsonl").write_text("".join(line + "\n" for line in lines))
    metrics = [json.dumps({"step": s, "loss": 2.0 + s}) for s in range(steps)]
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in metrics))
    for name in ("seedlog.jsonl", "metrics.jsonl"):
        os.utime(run / name, ns=(OLD, OLD))


def whole_reads(monkeypatch) -> list[str]:
    """The names of the files read whole (``Path.read_text`` or ``read_bytes``) from here on."""
    reads: list[str] = []
    for method in ("read_text", "read_bytes"):
        monkeypatch.setattr(Path, method, counted(getattr(Path, method), reads))
    return reads


def counted(read, reads: list[str]):
    """``read``, each call's file name added to ``reads``."""

    def counting(self, *args, **kwargs):
        reads.append(self.name)
        return read(self, *args, **kwargs)

    return counting


def catch_up(run: Path, at: int) -> list:
    """Rank 0's catch-up from a checkpoint of ``at`` steps: the records it applies."""
    applied: list = []

    def apply(records: list) -> None:
        applied.extend(records)
        engine.step_index = records[-1][0] + 1

    engine = SimpleNamespace(
        step_index=at, config=SimpleNamespace(rounds_on_host=False), catch_up=apply
    )
    catch_up_from_log(cast(ZOEngine, engine), run, {**HEADER}, ParallelContext.single())
    return applied


def test_a_resume_parses_the_seed_log_once_and_rewrites_no_log(tmp_path, monkeypatch):
    write_run(tmp_path, steps=50, checkpoint=40)
    reads = whole_reads(monkeypatch)
    assert check_log_leads_to_checkpoint(tmp_path) == 50
    applied = catch_up(tmp_path, 40)
    assert applied == [(s, (0.5 + s,), 0.1) for s in range(40, 50)]
    logs = RunLogs(tmp_path, tmp_path, 50, HEADER)
    logs.close()
    assert reads.count("seedlog.jsonl") == 1  # before: the gap scan, the catch-up, the cut
    assert reads.count("metrics.jsonl") == 1
    for name in ("seedlog.jsonl", "metrics.jsonl"):
        assert (tmp_path / name).stat().st_mtime_ns == OLD, name  # not rewritten
        assert not (tmp_path / f"{name}.tmp").exists()
    assert list(logs.loss_curve.steps) == list(range(50))
    assert list(logs.loss_curve.losses) == [2.0 + s for s in range(50)]


@pytest.mark.parametrize(
    "damage, refusal",
    [
        (lambda lines: lines.insert(4, "not a record"), r", line 5: not JSON \(damaged\); restore"),
        (
            lambda lines: lines.insert(4, lines[3]),
            r" logs step 2 twice \(lines 4 and 5\), the same",
        ),
    ],
)
def test_a_damaged_seed_log_is_read_once_to_refuse_it(tmp_path, monkeypatch, damage, refusal):
    """The check, the scan for a gap and the refusal's words each read the log whole
    (three reads of a long log on a shared mount, to say what is wrong with it)."""
    write_run(tmp_path, steps=8, checkpoint=6)
    log = tmp_path / "seedlog.jsonl"
    lines = log.read_text().splitlines()
    damage(lines)
    log.write_text("".join(line + "\n" for line in lines))
    reads = whole_reads(monkeypatch)
    with pytest.raises(ValueError, match=f"^--resume: {log}{refusal}"):
        check_log_leads_to_checkpoint(tmp_path)
    assert reads == ["seedlog.jsonl"]


def test_another_ranks_log_check_opens_the_seed_log_twice(tmp_path, monkeypatch):
    """A rank other than 0 reads the log's header line and its tail, each once: every
    open is a request to a shared mount, from each rank of each node (before: the header
    line twice, for the header and again for its first step)."""
    write_run(tmp_path, steps=50, checkpoint=40)
    opened: list[str] = []

    def counting_open(file, *args, **kwargs):
        opened.append(Path(file).name)
        return open(file, *args, **kwargs)

    monkeypatch.setattr(seed_log, "open", counting_open, raising=False)
    assert check_log_leads_to_checkpoint(tmp_path, every_record=False) == 50
    assert opened == ["seedlog.jsonl"] * 2


def test_metrics_are_parsed_once_for_the_cut_and_the_loss_curve(tmp_path, monkeypatch):
    write_run(tmp_path, steps=20, checkpoint=10)
    parses = []
    loads = jsonl_text.json_text.loads
    monkeypatch.setattr(jsonl_text.json_text, "loads", lambda line: parses.append(1) or loads(line))
    logs = RunLogs(tmp_path, tmp_path, 12, HEADER)  # resumed after 12 steps: 8 dropped
    logs.close()
    assert len(parses) == 20 + 21  # metrics.jsonl once (before: twice), the seed log once
    assert list(logs.loss_curve.steps) == list(range(12))
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 12
    assert seed_log.last_logged_step(tmp_path / "seedlog.jsonl") == 11


@pytest.mark.parametrize(
    ("tail", "kept"),
    [
        ('{"step": 2', '{"step": 0}\n'),  # a torn last line
        ('{"step": 1}\r\n', '{"step": 0}\n{"step": 1}\n'),  # another line end
        ('{"step": 1}\n{"step": 2}\n', '{"step": 0}\n{"step": 1}\n'),  # past the resume
        ('{"step": 1}', '{"step": 0}\n{"step": 1}\n'),  # no newline: the next write joins it
    ],
)
def test_a_cut_that_changes_the_file_still_rewrites_it(tmp_path, tail, kept):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(('{"step": 0}\n' + tail).encode())
    truncate_jsonl(path, keep_below=2)
    assert path.read_bytes() == kept.encode()


def test_a_seed_log_changed_after_its_check_is_read_whole_again(tmp_path, monkeypatch):
    """The check vouches for the file's state: a write since (another step logged) sends
    the catch-up and the cut back to reading it whole."""
    write_run(tmp_path, steps=30, checkpoint=20)
    assert check_log_leads_to_checkpoint(tmp_path) == 30
    with open(tmp_path / "seedlog.jsonl", "a") as log:
        log.write(json.dumps({"step": 30, "projected_grads": [1.0], "lr": 0.1}) + "\n")
    reads = whole_reads(monkeypatch)
    assert catch_up(tmp_path, 20)[-1] == (30, (1.0,), 0.1)
    RunLogs(tmp_path, tmp_path, 25, HEADER).close()
    assert reads.count("seedlog.jsonl") == 2  # the catch-up, the cut of steps 25..30
    assert seed_log.last_logged_step(tmp_path / "seedlog.jsonl") == 24


def test_a_record_whose_step_is_not_a_plain_number_keeps_the_scans_words(tmp_path):
    """A step of 3.0 passes the checked read but not the gap scan: the scan's refusal."""
    write_run(tmp_path, steps=6, checkpoint=4)
    log = tmp_path / "seedlog.jsonl"
    log.write_text(log.read_text().replace('{"step": 3,', '{"step": 3.0,'))
    assert seed_log.checked_log(log).end is None
    with pytest.raises(ValueError, match="jumps from step 2 to step 4"):
        check_log_leads_to_checkpoint(tmp_path)


def test_a_header_that_holds_a_step_is_refused_as_the_scan_refuses_it(tmp_path):
    """A header with a ``step`` field is a step record to the scan and to the log's tail
    read (a header alone "ended" at its step): the checked read sends it to the scan."""
    write_run(tmp_path, steps=6, checkpoint=4)
    log = tmp_path / "seedlog.jsonl"
    log.write_text(log.read_text().replace('"run_seed": 0}', '"run_seed": 0, "step": 9}', 1))
    assert seed_log.checked_log(log).end is None
    with pytest.raises(ValueError, match="jumps from its header to step 9"):
        check_log_leads_to_checkpoint(tmp_path)


def test_a_line_added_after_the_check_is_cut_though_the_log_ends_where_it_did(tmp_path):
    """The check vouches for the file's state, not its name: a damaged line appended
    since (the log still ends at the resume's step) is dropped by the cut, not kept under
    the records the resume appends."""
    write_run(tmp_path, steps=30, checkpoint=30)
    assert check_log_leads_to_checkpoint(tmp_path) == 30
    log = tmp_path / "seedlog.jsonl"
    with open(log, "a") as stream:
        stream.write("damaged\n")
    RunLogs(tmp_path, tmp_path, 30, HEADER).close()
    assert log.read_text().splitlines()[-1] == json.dumps(
        {"step": 29, "projected_grads": [29.5], "lr": 0.1}
    )


def test_a_resume_before_the_logs_end_cuts_a_checked_seed_log(tmp_path):
    """A low-bit transfer trains the steps past its checkpoint again instead of catching
    up: the seed log checked whole still loses them, or they would be logged twice."""
    write_run(tmp_path, steps=30, checkpoint=20)
    assert check_log_leads_to_checkpoint(tmp_path) == 30
    RunLogs(tmp_path, tmp_path, 20, HEADER).close()
    assert seed_log.last_logged_step(tmp_path / "seedlog.jsonl") == 19


def test_a_checked_seed_log_loses_its_torn_last_line_on_a_resume(tmp_path):
    """A crash tore the last record: the read drops it, so the cut must too, or the next
    record would be appended to its half."""
    write_run(tmp_path, steps=30, checkpoint=30)
    log = tmp_path / "seedlog.jsonl"
    with open(log, "a") as stream:
        stream.write('{"step": 30, "projected_gra')
    assert check_log_leads_to_checkpoint(tmp_path) == 30
    RunLogs(tmp_path, tmp_path, 30, HEADER).close()
    assert log.read_text().endswith('"lr": 0.1}\n')


@pytest.mark.parametrize("end", ["\r\n", "\r"])
def test_a_seed_log_of_other_line_ends_reads_as_read_text_reads_it(tmp_path, end):
    """A seed log saved by an editor with Windows ("\\r\\n") or old Mac ("\\r") line ends
    reads with universal newlines, as ``read_text`` reads it (the replay's read)."""
    write_run(tmp_path, steps=5, checkpoint=5)
    log = tmp_path / "seedlog.jsonl"
    plain = seed_log.read_seed_log(log)
    log.write_bytes(log.read_bytes().replace(b"\n", end.encode()))
    assert seed_log.read_seed_log(log) == plain


@pytest.mark.parametrize("end", [b"\r\n", b"\r"])
def test_a_resume_rewrites_a_seed_log_of_other_line_ends_with_its_own(tmp_path, end):
    """Though the resume drops no record, the log is rewritten with the "\\n" its new
    records are appended with: the check that may skip the rewrite vouches only for a
    log a rewrite would leave as it is. Old Mac line ends ("\\r"), which the full read
    took, were refused: the tail read found no line, "ends at its header"."""
    write_run(tmp_path, steps=30, checkpoint=30)
    log = tmp_path / "seedlog.jsonl"
    log.write_bytes(log.read_bytes().replace(b"\n", end))
    assert check_log_leads_to_checkpoint(tmp_path) == 30
    RunLogs(tmp_path, tmp_path, 30, HEADER).close()
    text = log.read_bytes().decode()
    assert "\r" not in text and text.count("\n") == 31


@pytest.mark.parametrize("cut", [20, 30])
def test_a_resume_keeps_a_record_whose_string_holds_a_line_separator(tmp_path, cut):
    """A header written with its text as is (``ensure_ascii=False``: another tool's, a
    hand edit) may hold U+2028 in a string, which the read keeps within its line: the
    cut split lines there too (``str.splitlines``) and dropped both halves, the header
    with them, leaving a seed log no resume reads."""
    write_run(tmp_path, steps=30, checkpoint=cut)
    log = tmp_path / "seedlog.jsonl"
    header = {**HEADER, "note": "a\u2028b\x85c"}
    lines = log.read_text().split("\n")
    log.write_text("\n".join([json.dumps(header, ensure_ascii=False), *lines[1:]]))
    assert check_log_leads_to_checkpoint(tmp_path) == 30
    RunLogs(tmp_path, tmp_path, cut, HEADER).close()
    read, steps = seed_log.read_seed_log(log)
    assert read == header and [record["step"] for record in steps] == list(range(cut))


def test_a_resume_that_drops_nothing_removes_a_temporary_file_a_crash_left(tmp_path):
    write_run(tmp_path, steps=10, checkpoint=10)
    stale = tmp_path / "metrics.jsonl.tmp"
    stale.write_text('{"step": 0, "loss": 5.0}\n')  # a crash between the write and the rename
    RunLogs(tmp_path, tmp_path, 10, HEADER).close()
    assert not stale.exists()
    assert (tmp_path / "metrics.jsonl").stat().st_mtime_ns == OLD


def test_the_loss_curve_of_a_resume_holds_the_training_losses_alone(tmp_path):
    """The evaluations' records hold a loss too: not the training curve's."""
    write_run(tmp_path, steps=10, checkpoint=10)
    (tmp_path / "eval.jsonl").write_text(json.dumps({"step": 10, "loss": 99.0}) + "\n")
    logs = RunLogs(tmp_path, tmp_path, 10, HEADER)
    logs.close()
    assert list(logs.loss_curve.losses) == [2.0 + s for s in range(10)]


def went_on_from(run: Path, first: int, steps: list[int], checkpoint: int | None) -> Path:
    """The seed log of a run that went on from a copied checkpoint of ``first`` steps (its
    header's ``first_step``), holding ``steps``; a checkpoint folder of ``checkpoint``."""
    if checkpoint is not None:
        (run / "checkpoints" / f"step-{checkpoint}").mkdir(parents=True)
        (run / "checkpoints" / f"step-{checkpoint}" / ".metadata").write_bytes(b"")
    records = [{"step": s, "projected_grads": [0.5], "lr": 0.1} for s in steps]
    lines = [json.dumps({**HEADER, "first_step": first}), *map(json.dumps, records)]
    (run / "seedlog.jsonl").write_text("".join(line + "\n" for line in lines))
    return run / "seedlog.jsonl"


def test_a_gap_in_a_log_that_went_on_from_a_checkpoint_is_named_by_its_steps(tmp_path):
    """Counted from the header's first step, not from 0: from 0, the log's first record
    (step 4) read as the gap, "from its header"."""
    log = went_on_from(tmp_path, 4, [4, 5, 7], checkpoint=4)
    with pytest.raises(ValueError, match=f"^--resume: {log} jumps from step 5 to step 7, so"):
        check_log_leads_to_checkpoint(tmp_path)


def test_a_log_of_its_header_alone_goes_on_from_the_checkpoint_it_began_at(tmp_path):
    """A resume of a copied checkpoint that stopped before its first step was logged: its
    log ends where it begins, at the checkpoint, not at step 0 (which would be refused)."""
    went_on_from(tmp_path, 4, [], checkpoint=4)
    assert check_log_leads_to_checkpoint(tmp_path) == 4


@pytest.mark.parametrize("first", [1, 4])
def test_a_log_that_went_on_from_a_checkpoint_no_longer_there_is_refused(tmp_path, first):
    log = went_on_from(tmp_path, first, [first, first + 1], checkpoint=None)
    with pytest.raises(ValueError, match=f"^--resume: {log} begins at step {first} \\(its run"):
        check_log_leads_to_checkpoint(tmp_path)


def test_a_log_replaced_by_one_of_its_size_and_mtime_is_not_vouched_for(tmp_path):
    """What ``checked_log`` found is kept for the file's state: a log replaced by
    another of the same size and mtime (a copy that kept the times, ``cp -p``, rsync) is
    another file, whose records must be read again, not served from the first's check."""
    write_run(tmp_path, steps=4, checkpoint=4)
    log = tmp_path / "seedlog.jsonl"
    assert seed_log.checked_log(log).end == 4
    assert seed_log.in_order_end(log) == 4
    size = log.stat().st_size
    other = tmp_path / "other.jsonl"
    other.write_bytes(log.read_bytes().replace(b'"step": 2', b'"step": 7'))  # same size
    os.utime(other, ns=(OLD, OLD))
    os.replace(other, log)
    assert (log.stat().st_size, log.stat().st_mtime_ns) == (size, OLD)
    assert seed_log.in_order_end(log) is None
    assert seed_log.records_from(log, 2) is None
