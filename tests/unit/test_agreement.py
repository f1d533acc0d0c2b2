"""``agreed``: every rank learns every rank's verdict on a rank-local check and raises the
same error (the integration test: tests/integration/test_root_cause.py, on 3 ranks)."""

from __future__ import annotations

import errno

import pytest

from distzo.dist.agreement import agreed, gathered


class Peers:
    """A host group of three ranks seen from one: the others' verdicts are given."""

    distributed = True

    def __init__(self, *others) -> None:
        self.others = others

    def all_gather_object(self, mine):
        return [mine, *self.others]


def refuse(message: str):
    def check():
        raise ValueError(message)

    return check


def test_a_verdict_of_one_rank_is_raised_on_every_rank_naming_it():
    refused = ("ValueError", "the log is another run's", None, None)
    assert agreed(Peers(None, None), lambda: 42) == 42
    with pytest.raises(ValueError, match=r"^rank 1: the log is another run's$"):
        agreed(Peers(refused, None), lambda: 42)  # this rank (0) passed, rank 1 refused


def test_a_verdict_every_rank_shares_is_said_as_is():
    refused = ("ValueError", "too big", None, None)
    with pytest.raises(ValueError, match=r"^too big$"):
        agreed(Peers(refused, refused), refuse("too big"))


def test_a_failed_write_stays_a_failed_write():
    def write():
        raise OSError(errno.ENOSPC, "No space left on device", "/runs/a/config.toml")

    with pytest.raises(OSError) as raised:
        agreed(Peers(None, None), write)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == "/runs/a/config.toml"
    assert "rank 0: No space left on device" in str(raised.value)


def test_gathered_gives_every_ranks_result_or_the_first_failing_ranks_error():
    assert gathered(Peers((2, None), (3, None)), lambda: 1) == [1, 2, 3]
    failing = Peers((None, "row 9: bad"), (None, "row 20: bad"))
    with pytest.raises(ValueError, match=r"^row 9: bad$"):
        gathered(failing, lambda: 1)
