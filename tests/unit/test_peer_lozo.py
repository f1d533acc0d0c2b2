"""benchmarks/peer_lozo.py against a stand-in for LOZO's trainer file: a peer that follows
the paper takes distzo's LOZO steps to rounding, and one whose update skips V's draws (as
LOZO's own file does) moves off its measured direction on exactly the steps that redraw V."""

from pathlib import Path

import pytest

from tests.helpers.scripts import benchmark_script

STAND_IN = Path(__file__).parents[1] / "helpers" / "stand_in_lozo"
UPDATE_DRAWS_V = "self.draw_v = True  # the update meets the perturbation's U"


@pytest.fixture(scope="module")
def peer_lozo():
    with benchmark_script("peer_lozo") as module:
        yield module


def compare(peer_lozo, path, *options):
    args = ["--lozo", str(path), "--steps", "3", "--interval", "2", "--rank", "2", *options]
    return peer_lozo.compare(peer_lozo.parse_args(args))["steps"]


def test_a_peer_that_follows_the_paper_takes_distzos_steps(peer_lozo):
    """Same U, V and z: the same projected gradients and weights after every step, a V
    window included, weight decay on the matrices only."""
    steps = compare(peer_lozo, STAND_IN, "--weight-decay", "0.1")
    assert [s["redraws_v"] for s in steps] == [True, False, True]
    for s in steps:
        assert s["peer_z_vs_distzo_z"] < 1e-9  # (theta + eps z - theta) / eps
        assert s["g_diff"] < 1e-11 and s["weights_diff"] < 1e-12, s


def test_an_update_that_skips_v_moves_off_its_measured_direction_on_redraw_steps(
    peer_lozo, tmp_path
):
    source = (STAND_IN / "large_models" / "LOZOtrainer.py").read_text()
    assert UPDATE_DRAWS_V in source
    skipping = tmp_path / "LOZOtrainer.py"
    skipping.write_text(source.replace(UPDATE_DRAWS_V, "self.draw_v = False"))
    for s in compare(peer_lozo, skipping):
        assert s["g_diff"] < 1e-11 and s["distzo_moved_along_measured"] > 0.999
        if s["redraws_v"]:
            assert s["weights_diff"] > 1e-4 and abs(s["peer_moved_along_measured"]) < 0.5, s
        else:
            assert s["weights_diff"] < 1e-12 and s["peer_moved_along_measured"] > 0.999, s


def test_a_path_without_lozos_file_or_methods_is_one_line(peer_lozo, tmp_path):
    with pytest.raises(SystemExit, match="no large_models/LOZOtrainer.py there"):
        peer_lozo.peer_file(str(tmp_path))
    other = tmp_path / "other.py"
    other.write_text("class Trainer:\n    def lowrank_zo_step(self):\n        pass\n")
    with pytest.raises(SystemExit, match="has no method lowrank_zo_perturb_parameters, "):
        peer_lozo.compare(peer_lozo.parse_args(["--lozo", str(other)]))


def test_the_peer_alone_draws_with_torch_and_moves_along_what_it_measured(peer_lozo):
    report = peer_lozo.own_draws(
        peer_lozo.parse_args(["--lozo", str(STAND_IN), "--steps", "3", "--interval", "2"])
    )
    assert [round(s["peer_moved_along_measured"], 6) for s in report["steps"]] == [1.0] * 3
    assert report["peer_commit"] is None  # the stand-in lies in no LOZO clone
