"""What the entry point imports before it knows the job: ``--help`` and a mistyped flag
answer without the engine, the models and transformers (seconds of imports), and the
package's public names still load on first use."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _loaded_after(code: str) -> set[str]:
    """The top-level packages a fresh interpreter holds after running ``code``."""
    probe = f"{code}\nimport sys\nprint(*{{m.split('.')[0] for m in sys.modules}}, file=sys.stderr)"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    return set(out.stderr.split())  # the help text is stdout's


@pytest.mark.parametrize("flag", ["--help", "--no-such-flag", "--version"])
def test_help_and_a_bad_flag_answer_before_transformers_loads(flag):
    """``--help`` took 5 s, 3 of them importing the trainer's engine and transformers only
    for argparse to print and exit."""
    loaded = _loaded_after(
        f"from distzo.train import main\ntry:\n    main([{flag!r}])\nexcept SystemExit:\n    pass"
    )
    assert "distzo" in loaded
    assert "transformers" not in loaded and "peft" not in loaded


def test_importing_the_package_loads_its_names_on_first_use():
    assert "torch" not in _loaded_after("import distzo")
    import distzo
    from distzo.config.engine_options import ZOConfig
    from distzo.engine import ZOEngine

    assert distzo.ZOConfig is ZOConfig and distzo.ZOEngine is ZOEngine
    assert set(distzo.__all__) <= set(dir(distzo))
    with pytest.raises(AttributeError, match="no attribute 'Trainer'"):
        distzo.Trainer  # noqa: B018 - the attribute access is what is tested


@pytest.mark.parametrize("module", ["distzo.train", "distzo.replay", "distzo.export.training_step"])
def test_version_names_distzo_and_the_libraries_a_bug_report_needs(module):
    """``--version`` answers as ``pip --version`` does: one line, exit 0, the versions of
    distzo and of the libraries its behaviour depends on, read from their metadata."""
    from importlib.metadata import version

    out = subprocess.run(
        [sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stderr == "", out.stderr
    line = out.stdout.rstrip("\n")
    assert "\n" not in line
    assert line.startswith(f"distzo {version('distzo')} (torch {version('torch')}, "), line
    assert f"transformers {version('transformers')}" in line and ", python 3." in line
