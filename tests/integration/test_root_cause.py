"""Under torchrun, the rank that failed is the root cause of torchrun's summary, with its
own error; the ranks stopped because it died print one line each and no traceback."""

from __future__ import annotations

import pytest

from tests.helpers.launch import torchrun

FLAGS = ["--max-steps", "10", "--log-every", "1", "--dp", "2"]


@pytest.mark.parametrize("failing, peer", [(1, 0), (0, 1)])
def test_the_failed_rank_is_the_root_cause_and_its_peer_stays_quiet(tmp_path, failing, peer):
    proc = torchrun(
        2, FLAGS + ["--output-dir", str(tmp_path / "run")], env={"DISTZO_FAIL_AT": f"{failing}:3"}
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
