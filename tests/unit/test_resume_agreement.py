"""A resumed run loads the checkpoint rank 0 chose on every rank (``agreed_checkpoint``),
seen from rank 1 of two; the launch where one node lists late: tests/integration/
test_checkpoint.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from distzo.job.resume import agreed_checkpoint


class RankOne:
    """Rank 1's view of a host group of two: rank 0 broadcast ``chosen`` and passed its
    own check of it."""

    distributed = True

    def __init__(self, chosen: str | None) -> None:
        self.chosen = chosen

    def broadcast_object(self, value: object) -> object:
        return self.chosen

    def all_gather_object(self, mine: object) -> list[object]:
        return [None, mine]


def checkpoint(run_dir: Path, steps: int) -> None:
    """A complete checkpoint ``step-<steps>`` of one small tensor."""
    path = run_dir / "checkpoints" / f"step-{steps}"
    path.mkdir(parents=True)
    dcp.save({"meta/step": torch.tensor([steps])}, checkpoint_id=str(path), no_dist=True)


def test_rank_0s_older_checkpoint_is_taken_over_a_newer_one_this_node_lists(tmp_path):
    checkpoint(tmp_path, 4)
    checkpoint(tmp_path, 8)  # rank 0's node does not show it yet
    assert agreed_checkpoint(tmp_path, RankOne("step-4"), 1) == tmp_path / "checkpoints" / "step-4"
    assert agreed_checkpoint(tmp_path, RankOne(None), 1) is None  # rank 0 saw none: the log


def test_a_checkpoint_this_node_does_not_show_is_one_line_before_any_read(tmp_path):
    checkpoint(tmp_path, 4)
    with pytest.raises(ValueError) as refused:
        agreed_checkpoint(tmp_path, RankOne("step-8"), 1)
    assert str(refused.value) == (
        "rank 1: --resume: rank 0 resumes from checkpoint step-8, complete on its node, but on "
        f"this rank's node {tmp_path / 'checkpoints' / 'step-8'} does not exist: a shared file "
        "system that has not caught up (NFS); launch again once every node shows it whole"
    )
    (tmp_path / "checkpoints" / "step-8").mkdir()  # listed, its metadata not there yet
    with pytest.raises(ValueError, match=r"step-8/\.metadata is missing"):
        agreed_checkpoint(tmp_path, RankOne("step-8"), 1)
