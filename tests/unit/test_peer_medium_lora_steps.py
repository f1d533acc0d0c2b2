"""benchmarks/peer_steps.py --mezo-medium PATH --peft lora on stand-ins of MeZO's medium
files and of loralib (tests/helpers/stand_in_zo_peers/): MeZO's LoRA layers as its
modeling_roberta.py builds them and run.py's rule of what trains, beside distzo's
``--peft lora``; as written they differ by design (the head trains, loralib merges in
eval mode), with the head frozen and the merge off they agree, and a one-line difference
in either file is reported."""

import sys
import types
from pathlib import Path

import pytest

from benchmarks.peer_checks import mezo_medium, mezo_medium_lora
from tests.helpers.scripts import benchmark_script
from tests.helpers.stand_in_checkout import write_checkout

STAND_INS = Path(__file__).resolve().parents[1] / "helpers" / "stand_in_zo_peers"
FILES = {
    mezo_medium.TRAINER: STAND_INS / "mezo_medium_trainer.py",
    mezo_medium.MODELS: STAND_INS / "mezo_medium_models.py",
    mezo_medium_lora.MODELING: STAND_INS / "mezo_medium_modeling_roberta.py",
    mezo_medium_lora.RUN: STAND_INS / "mezo_medium_run.py",
}
HEAD = (
    "lm_head.bias, lm_head.dense.weight, lm_head.dense.bias, lm_head.layer_norm.weight, "
    "lm_head.layer_norm.bias, lm_head.decoder.weight"
)


@pytest.fixture(scope="module")
def peer_steps():
    with benchmark_script("peer_steps") as module:
        yield module


def stand_in_loralib(old: str = "", new: str = ""):
    """The loralib stand-in as a module, ``old`` in its source replaced by ``new``."""
    source = (STAND_INS / "loralib_stand_in.py").read_text()
    assert old in source
    module = types.ModuleType("loralib")
    exec(compile(source.replace(old, new), "loralib_stand_in.py", "exec"), module.__dict__)
    return module


@pytest.fixture
def loralib(monkeypatch):
    monkeypatch.setitem(sys.modules, "loralib", stand_in_loralib())


def checkout(root: Path, relative: str = "", old: str = "", new: str = "") -> Path:
    """A MeZO checkout of the stand-ins, ``relative``'s ``old`` replaced by ``new``."""
    return write_checkout(root, FILES, relative, old, new)


def run(peer_steps, capsys, root: Path, *argv: str) -> tuple[int, str]:
    argv = (
        "--mezo-medium",
        str(root),
        "--peft",
        "lora",
        "--steps",
        "2",
        "--weight-decay",
        "0",
        *argv,
    )
    code = peer_steps.main(list(argv))
    return code, capsys.readouterr().out


def test_mezos_lora_with_the_head_frozen_and_unmerged_agrees(peer_steps, capsys, tmp_path, loralib):
    code, out = run(peer_steps, capsys, checkout(tmp_path), "--medium-lora-as", "peft")
    assert code == 0, out
    assert "8 tensors trained, 8 LoRA's on query, value; distzo 8" in out
    assert "mezo medium lora: agrees with distzo" in out


def test_mezos_lora_as_written_trains_its_head_and_never_moves_its_loss(
    peer_steps, capsys, tmp_path, loralib
):
    """loralib merges B A into the weight in eval mode, where MeZO's forward runs: moving
    the adapters changes nothing, while unmerged the same move changes the loss."""
    code, out = run(peer_steps, capsys, checkout(tmp_path))
    assert code == 1, out
    moved = next(x for x in out.splitlines() if x.startswith("MeZO's loss, its adapters"))
    as_run, unmerged = (float(x.split()[0]) for x in moved.split("d(loss) ")[1].split(", "))
    assert as_run == 0.0 and unmerged > 1e-7, moved
    assert f"MeZO trains 6 tensors distzo's --peft lora does not: {HEAD}" in out
    assert "mezo medium lora: DIFFERS from distzo" in out


@pytest.mark.parametrize(
    "relative, old, new",
    [
        (mezo_medium_lora.MODELING, "self.value = lora.Linear(", "self.key = lora.Linear("),
        (mezo_medium.TRAINER, "(2 * self.args.zero_order_eps)", "self.args.zero_order_eps"),
    ],
)
def test_a_one_line_difference_in_mezos_lora_code_is_reported(
    peer_steps, capsys, tmp_path, loralib, relative, old, new
):
    root = checkout(tmp_path, relative, old, new)
    code, out = run(peer_steps, capsys, root, "--medium-lora-as", "peft")
    assert code == 1, out
    assert "mezo medium lora: DIFFERS from distzo" in out


def test_another_lora_scaling_is_reported(peer_steps, capsys, tmp_path, monkeypatch):
    scaled = stand_in_loralib("self.lora_alpha / self.r", "self.lora_alpha")
    monkeypatch.setitem(sys.modules, "loralib", scaled)
    code, out = run(peer_steps, capsys, checkout(tmp_path), "--medium-lora-as", "peft")
    assert code == 1, out
    assert "mezo medium lora: DIFFERS from distzo" in out


def test_without_loralib_the_check_says_what_to_install(peer_steps, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "loralib", None)  # an import of it fails
    with pytest.raises(SystemExit) as refused:
        peer_steps.main(["--mezo-medium", str(checkout(tmp_path)), "--peft", "lora"])
    assert str(refused.value) == (
        "--mezo-medium --peft lora runs MeZO's LoRA layers, loralib's Linear (its "
        "modeling_roberta.py imports loralib): pip install loralib"
    )


def test_a_checkout_without_modeling_roberta_is_one_line(peer_steps, tmp_path):
    root = checkout(tmp_path)
    (root / mezo_medium_lora.MODELING).unlink()
    with pytest.raises(SystemExit) as refused:
        peer_steps.main(["--mezo-medium", str(root), "--peft", "lora"])
    assert str(refused.value) == (
        f"--mezo-medium {root} --peft lora: no {mezo_medium_lora.MODELING} there; "
        "give a checkout of MeZO"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--medium-lora-as", "peft"], "--medium-lora-as compares MeZO's RoBERTa LoRA: give"),
    ],
)
def test_medium_lora_flags_out_of_place_are_refused(peer_steps, capsys, argv, message):
    with pytest.raises(SystemExit):
        peer_steps.main(["--mezo-medium", "x", *argv])
    assert message in capsys.readouterr().err
