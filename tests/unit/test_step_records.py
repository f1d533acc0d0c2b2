"""Every reader of the run's JSON-lines logs takes the same lines for steps
(``jsonl_text.record_step``) and decodes them alike (``line_record``): a resume, a replay,
a catch-up and the logs' cut never disagree on one file."""

import json
import math
from pathlib import Path

import pytest

from distzo.job import seed_log
from distzo.job.run_dir import check_log_leads_to_checkpoint
from distzo.job.run_end import recorded_evals
from distzo.job.run_logs import RunLogs
from tests.unit.test_resume_reads import HEADER, write_run


def _with_step_1_as(run: Path, spelled: str) -> Path:
    """The run's seed log with step 1's record naming its step ``spelled``."""
    log = run / "seedlog.jsonl"
    log.write_text(log.read_text().replace('{"step": 1,', '{"step": ' + spelled + ",", 1))
    return log


@pytest.mark.parametrize("spelled", ["true", "1.0", "-1"])
def test_a_step_that_is_no_whole_number_is_refused_by_the_resume_and_the_replay(tmp_path, spelled):
    """``true`` and ``1.0`` equal 1 in Python: the replay's read took either as step 1 and
    the resume's check ``true`` (then the resume's cut dropped the line, leaving a gap its
    next resume refused); the check refused ``1.0`` as a gap that the replay did not see.
    No run writes a step below 0: ``-1`` is no step either."""
    write_run(tmp_path, steps=6, checkpoint=4)
    log = _with_step_1_as(tmp_path, spelled)
    with pytest.raises(ValueError, match="jumps from step 0 to step 2"):
        check_log_leads_to_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="line 3: expected the record of step 1"):
        seed_log.read_seed_log(log)


def test_a_resume_goes_on_past_a_metrics_line_that_is_not_utf8(tmp_path):
    """A damaged line of metrics.jsonl is no record, which the cut drops: its bytes not
    being text ended the resume in a ``UnicodeDecodeError`` traceback."""
    write_run(tmp_path, steps=6, checkpoint=6)
    metrics = tmp_path / "metrics.jsonl"
    lines = metrics.read_bytes().split(b"\n")
    lines[2] = b'{"step": 2, "loss": 4.0, "note": "\xff"}'
    metrics.write_bytes(b"\n".join(lines))
    logs = RunLogs(tmp_path, tmp_path, 6, HEADER)
    logs.close()
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [
        0,
        1,
        3,
        4,
        5,
    ]
    assert list(logs.loss_curve.steps) == [0, 1, 3, 4, 5]


def test_an_evaluation_whose_step_is_false_is_no_evaluation_of_step_0(tmp_path):
    """A scoring run's requeue reports the step-0 evaluations its eval.jsonl holds: a
    ``false`` step (equal to 0 in Python) was taken for one, and its figures reported."""
    log = tmp_path / "eval.jsonl"
    log.write_text(json.dumps({"step": False, "eval_loss": 9.0}) + "\n")
    assert recorded_evals(log, 0, ("eval",)) is None
    log.write_text(json.dumps({"step": 0, "eval_loss": 2.0}) + "\n")
    assert recorded_evals(log, 0, ("eval",)) == {"eval": {"eval_loss": 2.0}}


@pytest.mark.parametrize(
    "damaged",
    [
        {"step": 1, "projected_grads": [], "lr": 0.1},  # no query's g
        {"step": 1, "projected_grads": [1e300], "lr": 1e300},  # lr x g overflows
        {"step": 1, "projected_grads": [0.5], "lr": float("nan")},
        {"step": 1, "projected_grads": ["0.5"], "lr": 0.1},  # a g that is no number
    ],
)
def test_a_step_record_whose_update_is_no_finite_one_is_refused(tmp_path, damaged):
    """A run never logs such a step (it drops a step whose g is not finite): replayed, the
    line would make every weight NaN, so it is a damaged line, named by its number. The
    resume's check, which saw no gap, let it by: the catch-up refused it, after the model
    was built and the checkpoint loaded, in a replay's ``--log`` words."""
    write_run(tmp_path, steps=4, checkpoint=4)
    log = tmp_path / "seedlog.jsonl"
    lines = log.read_text().splitlines()
    lines[2] = json.dumps(damaged)
    log.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(ValueError, match="line 3: expected the record of step 1"):
        seed_log.read_seed_log(log)
    assert seed_log.checked_log(log).end is None
    with pytest.raises(ValueError) as refused:
        check_log_leads_to_checkpoint(tmp_path)
    assert str(refused.value) == (
        f"--resume: {log}, line 3: expected the record of step 1 (damaged); restore it, move "
        f"it aside to resume from {tmp_path}/checkpoints/step-4 (4 steps) alone (a replay then "
        "cannot rebuild the run), or start afresh with --overwrite or another --output-dir"
    )


def test_a_seed_log_that_begins_with_a_step_record_has_no_header(tmp_path):
    """A log whose header line was lost begins with step 0's record: no header to resume by."""
    write_run(tmp_path, steps=4, checkpoint=4)
    log = tmp_path / "seedlog.jsonl"
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines()[1:]))
    assert seed_log.logged_header(log) is None
    with pytest.raises(ValueError, match="does not begin with a seed log's header"):
        check_log_leads_to_checkpoint(tmp_path)


def _with_step_2_again(run: Path, record: str | None = None) -> Path:
    """The run's seed log with step 2 logged a second time, after its first record: the
    same line again, or ``record``."""
    log = run / "seedlog.jsonl"
    lines = log.read_text().splitlines()
    again = lines[3] if record is None else record
    log.write_text("".join(line + "\n" for line in [*lines[:4], again, *lines[4:]]))
    return log


def test_one_runs_step_logged_twice_is_named_with_the_repeat_to_delete(tmp_path):
    """Two jobs of one run writing its log at once (a requeue started before the old job
    ended, where the directory cannot be locked) write each step's record twice, the same
    to the bit. The resume refused it with "the two are not one run; start afresh", which
    was false (the log is the run's) and would have thrown the run away; the replay named
    no fix at all."""
    write_run(tmp_path, steps=5, checkpoint=4)
    log = _with_step_2_again(tmp_path)
    twice = (
        "logs step 2 twice (lines 4 and 5), the same record both times: two jobs of this run "
        "wrote it at once (a requeue that started before the old job ended, in a directory "
        "that cannot be locked); delete line 5 and any later repeat of a step"
    )
    with pytest.raises(ValueError) as refused:
        check_log_leads_to_checkpoint(tmp_path)
    assert str(refused.value) == f"--resume: {log} {twice}, then resume again"
    with pytest.raises(ValueError) as replayed:
        seed_log.read_seed_log(log)
    assert str(replayed.value) == f"--log {log}: {twice}"
    # the fix it names is the fix: with line 5 deleted, the resume goes on after step 4
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join(lines[:4] + lines[5:]))
    assert check_log_leads_to_checkpoint(tmp_path) == 5


def test_a_step_logged_twice_by_two_runs_is_refused_as_two_runs(tmp_path):
    """The same step with another g (another run's, in the same directory): the two
    records are of two runs, and neither the resume nor the replay can tell which is this
    run's. Only the lowest bit of g differs."""
    write_run(tmp_path, steps=5, checkpoint=4)
    other = {"step": 2, "projected_grads": [math.nextafter(2.5, 3.0)], "lr": 0.1}  # was 2.5
    log = _with_step_2_again(tmp_path, json.dumps(other))
    twice = "logs step 2 twice (lines 4 and 5), two different records: two runs wrote it"
    with pytest.raises(ValueError) as refused:
        check_log_leads_to_checkpoint(tmp_path)
    assert str(refused.value) == (
        f"--resume: {log} {twice}, so it does not go on from {tmp_path}/checkpoints/step-4 "
        "(4 steps); start afresh with --overwrite or another --output-dir"
    )
    with pytest.raises(ValueError) as replayed:
        seed_log.read_seed_log(log)
    assert str(replayed.value) == f"--log {log}: {twice}"


def test_a_torn_last_line_is_no_step_to_the_resume_as_to_the_replay(tmp_path):
    """A last line without its newline is torn (the replay drops it): though it is a whole
    record, of a step logged again, the resume's scan of a log damaged elsewhere must
    skip it too, and name the damaged line the replay refuses, not the torn one."""
    write_run(tmp_path, steps=4, checkpoint=4)
    log = tmp_path / "seedlog.jsonl"
    lines = log.read_text().splitlines()
    lines[2] = json.dumps({"step": 1, "projected_grads": ["0.5"], "lr": 0.1})
    log.write_text("".join(line + "\n" for line in lines) + lines[-1])  # step 3 again, torn
    with pytest.raises(ValueError) as refused:
        check_log_leads_to_checkpoint(tmp_path)
    assert str(refused.value) == (
        f"--resume: {log}, line 3: expected the record of step 1 (damaged); restore it, move "
        f"it aside to resume from {tmp_path}/checkpoints/step-4 (4 steps) alone (a replay then "
        "cannot rebuild the run), or start afresh with --overwrite or another --output-dir"
    )
    with pytest.raises(ValueError) as replayed:
        seed_log.read_seed_log(log)
    assert str(replayed.value) == f"--log {log}, line 3: expected the record of step 1"


def _log_from_step_4(run: Path, again: dict) -> Path:
    """A run that went on from a checkpoint of 4 steps: its seed log begins at step 4
    (``first_step``), holds steps 4 and 5, then ``again``, then 6 and 7."""
    write_run(run, steps=0, checkpoint=6)
    records = [{"step": s, "projected_grads": [0.5 + s], "lr": 0.1} for s in (4, 5)]
    records += [again, *({"step": s, "projected_grads": [0.5 + s], "lr": 0.1} for s in (6, 7))]
    lines = [json.dumps({**HEADER, "first_step": 4}), *map(json.dumps, records)]
    log = run / "seedlog.jsonl"
    log.write_text("".join(line + "\n" for line in lines))
    return log


def test_a_log_that_begins_past_step_0_counts_its_repeats_from_its_first_step(tmp_path):
    """Its first step logged again is a repeat at line 2, named as one (not a line that
    should hold step 6); a step before its first has no record in it to be a repeat of
    (not step 1 compared with a record counted back from the log's end)."""
    first = {"step": 4, "projected_grads": [4.5], "lr": 0.1}
    log = _log_from_step_4(tmp_path / "a", first)
    twice = (
        "logs step 4 twice (lines 2 and 4), the same record both times: two jobs of this run "
        "wrote it at once (a requeue that started before the old job ended, in a directory "
        "that cannot be locked); delete line 4 and any later repeat of a step"
    )
    with pytest.raises(ValueError) as refused:
        check_log_leads_to_checkpoint(tmp_path / "a")
    assert str(refused.value) == f"--resume: {log} {twice}, then resume again"
    with pytest.raises(ValueError) as replayed:
        seed_log.read_seed_log(log)
    assert str(replayed.value) == f"--log {log}: {twice}"
    log = _log_from_step_4(tmp_path / "b", {**first, "step": 1})
    with pytest.raises(ValueError) as refused:
        check_log_leads_to_checkpoint(tmp_path / "b")
    assert str(refused.value).startswith(f"--resume: {log} jumps from step 5 to step 1, ")
    with pytest.raises(ValueError) as replayed:
        seed_log.read_seed_log(log)
    assert str(replayed.value) == f"--log {log}, line 4: expected the record of step 6"
