"""What setup.cfg declares about the distribution holds in the repository it is built from."""

from __future__ import annotations

import configparser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _setup_cfg() -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    return parser


def _metadata() -> configparser.SectionProxy:
    return _setup_cfg()["metadata"]


def _floor(package: str) -> Version:
    """The lowest version of ``package`` that install_requires accepts."""
    lines = _setup_cfg()["options"]["install_requires"].splitlines()
    [requirement] = [r for r in map(Requirement, filter(None, lines)) if r.name == package]
    [floor] = [s.version for s in requirement.specifier if s.operator == ">="]
    return Version(floor)


def test_the_declared_licence_ships_its_text():
    """setup.cfg said Apache-2.0 while the repository, and so the wheel and the sdist, held
    no licence text at all (0 files), which the licence requires with every copy."""
    metadata = _metadata()
    assert metadata["license"] == "Apache-2.0"
    files = metadata.get("license_files", "").split()
    assert files, "setup.cfg names no license_files: the wheel and the sdist carry no text"
    for name in files:
        text = (ROOT / name).read_text()
        assert "Apache License" in text and "Version 2.0, January 2004" in text, name


def test_the_version_has_one_source():
    """setup.cfg and distzo.__version__ each spelled 0.1.0, and nothing kept them alike: the
    distribution's version is read from the package."""
    from importlib.metadata import version

    import distzo

    assert _metadata()["version"] == "attr: distzo.__version__"
    assert version("distzo") == distzo.__version__


def test_the_accelerate_floor_is_one_transformers_counts_as_installed():
    """transformers takes an accelerate older than its ACCELERATE_MIN_VERSION (1.1.0 from
    5.20 on) for none: at our floor then, 1.0, loading a GGUF file failed with
    "accelerate is required when loading a GGUF file"."""
    from transformers.utils.import_utils import ACCELERATE_MIN_VERSION

    assert _floor("accelerate") >= Version(ACCELERATE_MIN_VERSION)
