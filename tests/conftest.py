import fcntl
import os
import sys
from pathlib import Path

import pytest
import torch

# Tiny models gain nothing from intra-op threads, and on a loaded 2-core machine two
# threads per process thrash (measured 40x slower); one keeps the suite fast and steady.
torch.set_num_threads(1)

# The doc blocks, launch and SLURM scripts the tests run call `python`, `torchrun` and
# `distzo-train` by name: they must be this interpreter's. A virtualenv's python run
# without activating it (`venv312/bin/python -m pytest`) ran whichever came first on PATH:
# another install's distzo, or a python without torch.
_BIN = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = os.pathsep.join(filter(None, [_BIN, os.environ.get("PATH")]))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_save_left_writing():
    """Fail a test that leaves an asynchronous save's writer thread writing (one abandoned by
    a second Ctrl-C): a later test's in-process ``main()`` that returned while it wrote ended
    the whole pytest process at once (``_exit_at_once``) with its own code, 0, so every later
    test, failures included, went unreported. A test that abandons a save waits for it."""
    yield
    checkpoint = sys.modules.get("distzo.job.checkpoint")
    if checkpoint is not None and checkpoint.saves_being_written():
        pytest.fail("this test left a save being written; wait for it (saves_being_written)")


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M (``DISTZO_SMOLLM2_GGUF``) as a Hugging Face directory, converted once per
    test run: reading the GGUF takes about 30 s, and three tests need the model. xdist's
    workers share one copy (their base folders have one parent); the first converts while
    the others wait on a lock, and the conversion itself is written whole or not at all."""
    gguf = os.environ.get("DISTZO_SMOLLM2_GGUF")
    if not gguf or not Path(gguf).is_file():
        pytest.skip("set DISTZO_SMOLLM2_GGUF (see tests/unit/test_real_checkpoint.py)")
    pytest.importorskip("gguf")
    from distzo.models.gguf import gguf_to_hf

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    with open(root / "smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return gguf_to_hf(gguf, root / "smollm2-hf")
