"""benchmarks/peer_lozo.py against a stand-in for LOZO's trainer file: a peer that follows
the paper takes distzo's LOZO steps to rounding, and one whose update skips V's draws (as
LOZO's own file does) moves off its measured direction on exactly the steps that redraw V."""

from pathlib import Path

import pytest
import torch

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


def stand_in_with(tmp_path, old: str, new: str):
    """The stand-in's trainer file with ``old`` replaced by ``new``."""
    source = (STAND_IN / "large_models" / "LOZOtrainer.py").read_text()
    assert old in source
    changed = tmp_path / "LOZOtrainer.py"
    changed.write_text(source.replace(old, new))
    return changed


def test_a_difference_in_the_vectors_alone_is_in_the_weights_difference(peer_lozo, tmp_path):
    """The largest difference of any tensor: a peer that decays the 1-D tensors too (the
    matrices' weights agree) differs by lr * wd of a norm's scale of 1."""
    decays_all = stand_in_with(tmp_path, "            if p.ndim >= 2:\n", "            if True:\n")
    for s in compare(peer_lozo, decays_all, "--weight-decay", "0.1"):
        assert s["g_diff"] < 1e-11 and s["weights_diff"] > 1e-4, s


def test_a_peer_counting_steps_otherwise_is_one_line(peer_lozo, tmp_path):
    # its step picks when V is redrawn (every step at interval 1, where nothing else
    # would tell): one step ahead, its V windows would not be distzo's
    ahead = stand_in_with(tmp_path, "self.step, self.v = -1, {}", "self.step, self.v = 0, {}")
    with pytest.raises(RuntimeError, match="^the peer counts step 1 where distzo takes 0$"):
        compare(peer_lozo, ahead, "--interval", "1")


def test_a_draw_past_the_steps_stream_is_one_line(peer_lozo):
    streamed = peer_lozo.StreamTorch({0: torch.arange(8.0)})
    streamed.manual_seed(0)
    assert torch.equal(streamed.randn(2, 3), torch.arange(6.0).view(2, 3))
    with pytest.raises(RuntimeError, match="^the peer drew past the stream built for its step$"):
        streamed.randn(3)


@pytest.mark.parametrize("option", ["--steps", "--interval", "--rank"])
def test_a_count_below_1_is_refused(peer_lozo, capsys, option):
    with pytest.raises(SystemExit):
        peer_lozo.parse_args(["--lozo", ".", option, "0"])
    assert "--steps, --interval and --rank must be >= 1" in capsys.readouterr().err


MOMENTUM_STAND_IN = STAND_IN / "medium_models" / "src" / "LOZOtrainer.py"


def momentum_steps(peer_lozo, path, *options):
    """LOZO-M over 4 steps, V redrawn at steps 0 and 2, weight decay 0.1."""
    return compare(peer_lozo, path, "--momentum", "--steps", "4", "--weight-decay", "0.1", *options)


def test_a_lozo_m_peer_that_follows_the_formulas_takes_distzos_steps(peer_lozo):
    """Each side keeps its own factors: the weights after each step agree through a redraw
    (the projection onto the new V) and from the first step (N = g U)."""
    steps = momentum_steps(peer_lozo, STAND_IN)
    assert [s["redraws_v"] for s in steps] == [True, False, True, False]
    for s in steps:
        assert s["g_diff"] < 1e-11 and s["weights_diff"] < 1e-12, s


@pytest.mark.parametrize(
    "old, new, first_off",
    [
        # the first step from a zero N, (1 - beta1) g U: off from step 0 on
        ("self.exp_avg_m[name] = g * u", "self.exp_avg_m[name] = (1 - beta1) * g * u", 0),
        # a redraw that keeps N as it is, unprojected: off from the redraw at step 2 on
        ("m = m @ (self.v_old[name].t() @ v) / v.shape[0]", "m = m", 2),
    ],
)
def test_a_lozo_m_peer_off_the_formulas_differs_from_where_it_is_off(
    peer_lozo, tmp_path, old, new, first_off
):
    source = MOMENTUM_STAND_IN.read_text()
    assert old in source
    changed = tmp_path / "LOZOtrainer.py"
    changed.write_text(source.replace(old, new))
    for s in momentum_steps(peer_lozo, changed):
        assert (s["weights_diff"] > 1e-6) == (s["step"] >= first_off), s


def test_a_lozo_m_update_served_the_perturbations_stream_moves_off_on_a_redraw(peer_lozo):
    """``--update-draws as-written``: the update rewinds to where the perturbation drew V
    first, as LOZO's generator does, and its momentum carries the wrong U on."""
    steps = momentum_steps(peer_lozo, STAND_IN, "--update-draws", "as-written")
    assert all(s["g_diff"] < 1e-11 and s["weights_diff"] > 1e-6 for s in steps), steps


@pytest.mark.parametrize(
    "options, message",
    [
        (["--peer-draws"], "--peer-draws measures the plain update's direction"),
        (["--interval", "1"], "--momentum needs --interval >= 2"),
    ],
)
def test_lozo_m_options_it_cannot_compare_are_refused(peer_lozo, capsys, options, message):
    with pytest.raises(SystemExit):
        peer_lozo.parse_args(["--lozo", ".", "--momentum", *options])
    assert message in capsys.readouterr().err


def test_a_clone_without_the_roberta_trainer_is_one_line(peer_lozo, tmp_path):
    with pytest.raises(SystemExit, match="no medium_models/src/LOZOtrainer.py there"):
        peer_lozo.peer_file(str(tmp_path), momentum=True)
