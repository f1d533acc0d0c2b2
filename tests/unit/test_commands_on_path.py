"""The commands the tests run by name (doc blocks, launch and SLURM scripts) are those of the
interpreter running the tests (``tests/conftest.py`` puts its folder first on PATH)."""

import shutil
import sys
from pathlib import Path

import pytest

from tests.helpers.launch import child_env


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs a virtualenv's bin folder")
@pytest.mark.parametrize("name", ["python", "torchrun", "distzo-train"])
def test_a_command_run_by_name_is_this_interpreters(name):
    found = shutil.which(name, path=child_env()["PATH"])
    assert found and Path(found).parent == Path(sys.executable).parent, found
