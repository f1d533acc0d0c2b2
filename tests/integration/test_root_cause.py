"""Under torchrun, the rank that failed is the root cause of torchrun's summary, with its
own error; the ranks stopped because it died print one line each and no traceback."""

from __future__ import annotations

import shutil
import time

import pytest

from tests.helpers.launch import torchrun

FLAGS = ["--max-steps", "10", "--log-every", "1", "--dp", "2"]


@pytest.mark.parametrize("failing, peer", [(1, 0), (0, 1)])
def test_the_failed_rank_is_the_root_cause_and_its_peer_stays_quiet(tmp_path, failing, peer):
    proc = torchrun(
        2,
        FLAGS + ["--output-dir", str(tmp_path / "run")],
        env={"DISTZO_FAIL_AT": f"{failing}:3"},
        preload=False,
    )
    assert proc.returncode != 0
    stderr = proc.stderr
    root_cause = stderr.split("Root Cause (first observed failure):", 1)[1]
    assert f"rank      : {failing} (local_rank: {failing})" in root_cause, stderr[-3000:]
    assert "RuntimeError: failure injected by DISTZO_FAIL_AT at step 3" in root_cause
    assert f"[rank{failing}]: Traceback" in stderr  # the failure itself keeps its traceback
    assert f"[rank{peer}]: Traceback" not in stderr
    peer_lines = [line for line in stderr.splitlines() if f"[rank{peer}] ERROR" in line]
    assert len(peer_lines) == 1, stderr[-3000:]
    assert f"rank {peer} stopped in step 3: another rank failed or went silent" in peer_lines[0]


def test_a_check_one_rank_fails_after_the_groups_exist_ends_every_rank_with_it(tmp_path):
    # Only rank 0 reads the seed log when a run resumes: a log of another run (its header
    # altered) is refused there, and the three ranks exit together with that line.
    out = tmp_path / "run"
    flags = ["--dp", "3", "--batch-size", "6", "--save-steps", "2", "--output-dir", str(out)]
    assert torchrun(3, flags + ["--max-steps", "4"]).returncode == 0
    log = out / "seedlog.jsonl"
    header, rest = log.read_text().split("\n", 1)
    log.write_text(header.replace('"noise_chunk": 4194304', '"noise_chunk": 4194305') + "\n" + rest)
    shutil.rmtree(out / "checkpoints" / "step-4")  # resume at step 2: the log is read
    started = time.monotonic()
    proc = torchrun(3, flags + ["--max-steps", "6", "--resume"], preload=False)
    assert proc.returncode != 0 and time.monotonic() - started < 60
    said = "error: rank 0: " + str(log) + " is the log of another run (noise_chunk 4194305"
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(said), proc.stderr[-3000:]  # rank 0's
    assert proc.stderr.count("traceback : " + said) == 3  # every rank ended with that line
    assert "another rank failed" not in proc.stderr  # no rank waited for a peer to die
    assert "Traceback" not in proc.stderr.split("Root Cause", 1)[1]
