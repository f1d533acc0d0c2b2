"""benchmarks/peer_steps.py --mezo-medium on stand-ins of MeZO's medium_models files
(tests/helpers/stand_in_zo_peers/mezo_medium_*.py): it runs the trainer's ZO branch of
``train()`` and the prompt model's forward as written beside the engine's Classification
step on a RoBERTa, and tells agreement from a one-line difference in either file."""

import shutil
from pathlib import Path

import pytest

from benchmarks.peer_checks import mezo_medium
from tests.helpers.scripts import benchmark_script
from tests.helpers.stand_in_checkout import write_checkout

STAND_INS = Path(__file__).resolve().parents[1] / "helpers" / "stand_in_zo_peers"
FILES = {
    mezo_medium.TRAINER: STAND_INS / "mezo_medium_trainer.py",
    mezo_medium.MODELS: STAND_INS / "mezo_medium_models.py",
}


@pytest.fixture(scope="module")
def peer_steps():
    with benchmark_script("peer_steps") as module:
        yield module


def checkout(root: Path, relative: str = "", old: str = "", new: str = "") -> Path:
    """A MeZO checkout of the stand-ins, ``relative``'s ``old`` replaced by ``new``."""
    return write_checkout(root, FILES, relative, old, new)


def run(peer_steps, capsys, root: Path, *argv: str) -> tuple[int, str]:
    code = peer_steps.main(["--mezo-medium", str(root), "--steps", "2", *argv])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("tie", [(), ("--medium-tie",)])
def test_a_faithful_medium_trainer_agrees_to_rounding(peer_steps, capsys, tmp_path, tie):
    code, out = run(peer_steps, capsys, checkout(tmp_path), "--weight-decay", "0", *tie)
    assert code == 0, out
    assert "mezo medium: agrees with distzo" in out
    # tied: the head's decoder is the embeddings' matrix, one tensor fewer to draw for
    assert ("42 tensors, tied" if tie else "43 tensors, untied") in out


@pytest.mark.parametrize(
    "relative, old, new",
    [
        (mezo_medium.TRAINER, "(2 * self.args.zero_order_eps)", "self.args.zero_order_eps"),
        (mezo_medium.TRAINER, "random_seed, -2)", "random_seed, -1)"),  # L- at theta
        (mezo_medium.MODELS, "mask_pos.squeeze()]", "mask_pos.squeeze() - 1]"),  # causal's
        (mezo_medium.MODELS, "model.label_word_list]", "model.label_word_list.flip(0)]"),
    ],
)
def test_a_one_line_difference_in_mezos_medium_code_is_reported(
    peer_steps, capsys, tmp_path, relative, old, new
):
    root = checkout(tmp_path, relative, old, new)
    code, out = run(peer_steps, capsys, root, "--weight-decay", "0")
    assert code == 1, out
    assert "mezo medium: DIFFERS from distzo" in out


def test_mezos_decay_of_biases_and_layernorms_is_reported_apart(peer_steps, capsys, tmp_path):
    """MeZO's medium update decays every tensor, distzo only matrices: at weight decay
    0.1 the first step parts the biases and LayerNorms, the rest within rounding (from the
    next, the losses see the difference)."""
    root = checkout(tmp_path)
    code, out = run(peer_steps, capsys, root, "--weight-decay", "0.1", "--steps", "1")
    assert code == 1 and "mezo medium: DIFFERS from distzo" in out
    line = next(x for x in out.splitlines() if x.startswith("d(theta) in the 26 tensors"))
    exempt, rest = (float(part.rsplit(" ", 1)[1]) for part in line.split(";"))
    assert exempt > 1e-5 and rest < 1e-12, line


def test_a_checkout_without_the_medium_files_is_one_line(peer_steps, tmp_path):
    (tmp_path / mezo_medium.TRAINER).parent.mkdir(parents=True)
    shutil.copy(FILES[mezo_medium.TRAINER], tmp_path / mezo_medium.TRAINER)
    with pytest.raises(SystemExit) as refused:
        peer_steps.main(["--mezo-medium", str(tmp_path)])
    assert str(refused.value) == (
        f"--mezo-medium {tmp_path}: no {mezo_medium.MODELS} there; give a checkout of MeZO"
    )


def test_a_trainer_without_the_zo_branch_is_one_line(peer_steps, tmp_path):
    root = checkout(tmp_path, mezo_medium.TRAINER, "if self.args.zero_order_optim:", "if True:")
    with pytest.raises(SystemExit) as refused:
        peer_steps.main(["--mezo-medium", str(root), "--weight-decay", "0"])
    assert str(refused.value) == (
        f"{root / mezo_medium.TRAINER}: train() has no single "
        "`if self.args.zero_order_optim:` branch"
    )


def test_medium_tie_needs_the_medium_check(peer_steps, capsys):
    with pytest.raises(SystemExit):
        peer_steps.main(["--mezo", "x", "--medium-tie"])
    assert "--medium-tie ties MeZO's RoBERTa head: give --mezo-medium PATH" in (
        capsys.readouterr().err
    )


def test_a_head_mezo_leaves_untied_is_reported_under_medium_tie(peer_steps, capsys, tmp_path):
    """z is served by name, so an untied head would take the embeddings' z and move alike:
    the count of tensors drawn for tells the models apart."""
    tie = "self._tie_or_clone_weights(self.lm_head.decoder, self.roberta.get_input_embeddings())"
    root = checkout(tmp_path, mezo_medium.MODELS, tie, "pass")
    code, out = run(peer_steps, capsys, root, "--weight-decay", "0", "--medium-tie")
    assert code == 1, out
    assert "MeZO draws z for 43 tensors, distzo for 42: another model" in out
    assert "mezo medium: DIFFERS from distzo" in out
