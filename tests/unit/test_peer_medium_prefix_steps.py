"""benchmarks/peer_steps.py --mezo-medium PATH --peft prefix on stand-ins of MeZO's medium
files (tests/helpers/stand_in_zo_peers/): MeZO's RoBERTa prefix as its prefix.py applies
it, beside distzo's ``--peft prefix``; with the batch's positions as peft counts them the
two agree at init and over steps, as written the positions differ by design, and a
one-line difference in its prefix or trainer code is reported."""

from pathlib import Path

import pytest

from benchmarks.peer_checks import mezo_medium, mezo_medium_prefix
from tests.helpers.scripts import benchmark_script
from tests.helpers.stand_in_checkout import write_checkout

STAND_INS = Path(__file__).resolve().parents[1] / "helpers" / "stand_in_zo_peers"
FILES = {
    mezo_medium.TRAINER: STAND_INS / "mezo_medium_trainer.py",
    mezo_medium.MODELS: STAND_INS / "mezo_medium_models.py",
    mezo_medium_prefix.PREFIX: STAND_INS / "mezo_medium_prefix.py",
}


@pytest.fixture(scope="module")
def peer_steps():
    with benchmark_script("peer_steps") as module:
        yield module


def checkout(root: Path, relative: str = "", old: str = "", new: str = "") -> Path:
    """A MeZO checkout of the stand-ins, ``relative``'s ``old`` replaced by ``new``."""
    return write_checkout(root, FILES, relative, old, new)


def run(peer_steps, capsys, root: Path, *argv: str) -> tuple[int, str]:
    argv = ("--mezo-medium", str(root), "--peft", "prefix", "--steps", "2", *argv)
    code = peer_steps.main(list(argv))
    return code, capsys.readouterr().out


def test_mezos_prefix_at_peft_positions_agrees(peer_steps, capsys, tmp_path):
    code, out = run(peer_steps, capsys, checkout(tmp_path), "--prefix-positions", "peft")
    assert code == 0, out
    assert "positions peft's): roberta, 4 tensors trained; distzo 4" in out
    assert "at init: d(prefix) 0.000e+00, d(logits) 0.000e+00" in out
    assert "mezo medium prefix: agrees with distzo" in out


def test_mezos_positions_are_reported_as_the_difference(peer_steps, capsys, tmp_path):
    """MeZO's hook adds the prefix inside the attention: its batch's positions start as
    without one, peft's and distzo's after it. The same prefix, other logits."""
    code, out = run(peer_steps, capsys, checkout(tmp_path))
    assert code == 1, out
    init = next(x for x in out.splitlines() if x.startswith("at init"))
    assert init.startswith("at init: d(prefix) 0.000e+00, d(logits) ")
    assert float(init.rsplit(" ", 1)[1]) > 1e-3, init
    assert "mezo medium prefix: DIFFERS from distzo" in out


@pytest.mark.parametrize(
    "relative, old, new",
    [
        (  # keys and values handed over swapped
            mezo_medium_prefix.PREFIX,
            "(per_head(self.prefix_keys), per_head(self.prefix_values))",
            "(per_head(self.prefix_values), per_head(self.prefix_keys))",
        ),
        (  # the prefix hidden from the batch instead of seen
            mezo_medium_prefix.PREFIX,
            "attend = torch.zeros(",
            "attend = -1e9 + torch.zeros(",
        ),
        (  # every layer starts from the first layer's activations
            mezo_medium_prefix.PREFIX,
            "own = [real[layer][i]",
            "own = [real[0][i]",
        ),
        (mezo_medium.TRAINER, "(2 * self.args.zero_order_eps)", "self.args.zero_order_eps"),
    ],
)
def test_a_one_line_difference_in_mezos_prefix_code_is_reported(
    peer_steps, capsys, tmp_path, relative, old, new
):
    root = checkout(tmp_path, relative, old, new)
    code, out = run(peer_steps, capsys, root, "--prefix-positions", "peft")
    assert code == 1, out
    assert "mezo medium prefix: DIFFERS from distzo" in out


def test_a_checkout_without_prefix_py_is_one_line(peer_steps, tmp_path):
    root = checkout(tmp_path)
    (root / mezo_medium_prefix.PREFIX).unlink()
    with pytest.raises(SystemExit) as refused:
        peer_steps.main(["--mezo-medium", str(root), "--peft", "prefix"])
    assert str(refused.value) == (
        f"--mezo-medium {root} --peft prefix: no {mezo_medium_prefix.PREFIX} there; "
        "give a checkout of MeZO"
    )
