"""benchmarks/peer_steps.py --mezo PATH --peft lora|prefix on stand-ins of MeZO's lora.py and
prefix.py (tests/helpers/stand_in_zo_peers/): MeZO's adapter applied by its own code beside
distzo's, then MeZO's steps beside the engine's; a one-line difference is reported."""

import shutil
from pathlib import Path

import pytest

from benchmarks.peer_checks import mezo_adapters
from tests.helpers.scripts import benchmark_script

STAND_INS = Path(__file__).resolve().parents[1] / "helpers" / "stand_in_zo_peers"
CHECKOUT_FILES = {"trainer.py": "mezo_trainer.py", "lora.py": "mezo_lora.py"}
CHECKOUT_FILES["prefix.py"] = "mezo_prefix.py"


@pytest.fixture(scope="module")
def peer_steps():
    with benchmark_script("peer_steps") as module:
        yield module


def mezo_checkout(root: Path, file: str = "", old: str = "", new: str = "") -> Path:
    """A MeZO checkout of the stand-ins, ``old`` replaced by ``new`` in ``file``."""
    folder = root / "mezo" / "large_models"
    folder.mkdir(parents=True)
    for name, stand_in in CHECKOUT_FILES.items():
        shutil.copy(STAND_INS / stand_in, folder / name)
    if file:
        source = (folder / file).read_text()
        assert old in source
        (folder / file).write_text(source.replace(old, new))
    return root / "mezo"


def run(peer_steps, capsys, checkout: Path, *argv: str) -> tuple[int, str]:
    code = peer_steps.main(["--mezo", str(checkout), "--steps", "2", *argv])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("peft", ["lora", "prefix"])
def test_mezos_adapter_agrees_with_distzos_at_init_and_over_steps(
    peer_steps, capsys, tmp_path, peft
):
    argv = ["--peft", peft, "--prefix-positions", "peft"]
    code, out = run(peer_steps, capsys, mezo_checkout(tmp_path), *argv)
    assert code == 0, out
    assert "at init: d(adapter) 0.000e+00, d(logits) 0.000e+00" in out
    assert f"mezo {peft}: agrees with distzo" in out


def test_mezos_prefix_positions_are_reported_as_the_difference(peer_steps, capsys, tmp_path):
    """MeZO's batch keeps positions 0.. beside its prefix; peft's and distzo's start after
    it (docs/peft.md): the same prefix, other logits."""
    code, out = run(peer_steps, capsys, mezo_checkout(tmp_path), "--peft", "prefix")
    assert code == 1 and "mezo prefix: DIFFERS from distzo" in out, out
    assert "positions mezo's" in out and "d(adapter) 0.000e+00" in out


@pytest.mark.parametrize(
    "file, old, new, peft",
    [
        ("lora.py", "self.scaling = lora_alpha / r", "self.scaling = lora_alpha", "lora"),
        ("lora.py", 'for name in ("q_proj", "v_proj")', 'for name in ("q_proj",)', "lora"),
        ("prefix.py", "for i in (0, 1)]", "for i in (1, 0)]", "prefix"),  # keys <-> values
        ("prefix.py", "dtype=mask.dtype)", "dtype=mask.dtype) - 1e9", "prefix"),  # not attended
        # every row masked as the first, which has no pads: only a padded row tells
        (
            "prefix.py",
            'mask = kwargs["attention_mask"]',
            'mask = kwargs["attention_mask"][:1]',
            "prefix",
        ),
    ],
)
def test_a_one_line_difference_in_mezos_adapter_is_reported(
    peer_steps, capsys, tmp_path, file, old, new, peft
):
    checkout = mezo_checkout(tmp_path, file, old, new)
    code, out = run(peer_steps, capsys, checkout, "--peft", peft, "--prefix-positions", "peft")
    assert code == 1 and f"mezo {peft}: DIFFERS from distzo" in out, out


def test_a_checkout_without_mezos_adapter_file_is_one_line(peer_steps, tmp_path):
    checkout = mezo_checkout(tmp_path)
    (checkout / "large_models" / "prefix.py").unlink()
    with pytest.raises(SystemExit) as refused:
        peer_steps.main(["--mezo", str(checkout), "--peft", "prefix"])
    assert str(refused.value) == (
        f"--mezo {checkout}: no large_models/prefix.py there; give a checkout of MeZO"
    )


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--fzoo", "x", "--peft", "lora"], "--peft compares MeZO's adapters: give --mezo PATH"),
        (["--mezo", "x", "--peft", "prefix", "--family", "llama"], "--peft runs MeZO's adapters"),
    ],
)
def test_peft_without_mezos_opt_is_refused_in_one_line(peer_steps, capsys, argv, line):
    with pytest.raises(SystemExit):
        peer_steps.parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert line in err[-1], err


def test_the_legacy_cache_indexing_leaves_transformers_own_in_place(monkeypatch):
    """The stand-in for transformers 4.28's tuple indexing is taken away after MeZO's init;
    a ``DynamicCache`` with an indexing of its own keeps it."""
    from transformers import DynamicCache

    def own(cache, layer):
        return "own"

    monkeypatch.setattr(DynamicCache, "__getitem__", own, raising=False)
    with mezo_adapters.legacy_cache_indexing():
        assert DynamicCache.__dict__["__getitem__"] is not own
    assert DynamicCache.__dict__["__getitem__"] is own
