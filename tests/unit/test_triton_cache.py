"""Triton's kernel cache where the home folder cannot hold it: a GPU run compiled its first
kernel into ``~/.triton/cache`` and, with a read-only home, failed at its first step with
``Read-only file system``. The kernels go to a private folder instead, with a warning."""

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from distzo.zo import triton_noise  # noqa: E402
from distzo.zo.triton_cache import cache_problem  # noqa: E402


@pytest.fixture
def triton_home(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Triton compiling (no interpreter) with its own cache settings; Triton's cache knob and
    ``TRITON_CACHE_DIR``, which setting the knob exports, as they were after the test."""
    from triton import knobs

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    saved_env, saved_knob = os.environ.pop("TRITON_CACHE_DIR", None), knobs.cache.__dict__.copy()
    triton_noise._kernels.cache_clear()
    try:
        yield
    finally:
        triton_noise._kernels.cache_clear()
        knobs.cache.__dict__.clear()
        knobs.cache.__dict__.update(saved_knob)
        os.environ.pop("TRITON_CACHE_DIR", None)
        if saved_env is not None:
            os.environ["TRITON_CACHE_DIR"] = saved_env


def compile_into_cache() -> Path:
    """What Triton does with a kernel it compiled: its cache manager's folder made, the
    binary put there (the call that raised)."""
    from triton.runtime.cache import get_cache_manager

    return Path(get_cache_manager("0123abcd" * 8).put(b"\x7fELF", "kernel.cubin"))


def test_a_home_that_cannot_hold_the_cache_compiles_into_a_private_folder(
    triton_home, tmp_path, monkeypatch, caplog
):
    home = tmp_path / "home"
    # a home where no folder can be made: as a read-only one, and for root too (root writes
    # through mode bits, not through a file)
    home.write_text("")
    monkeypatch.setenv("TRITON_HOME", str(home))
    with caplog.at_level(logging.WARNING, logger="distzo.zo.triton_cache"):
        triton_noise._kernels()  # a run's first launch
        cached = compile_into_cache()
    assert cached.is_file() and not cached.is_relative_to(home)
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"Triton's kernel cache {home / '.triton' / 'cache'} cannot be ")
    assert str(cached.parents[1]) in warning and "set TRITON_CACHE_DIR" in warning


def test_a_writable_cache_is_left_where_it_is(triton_home, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="distzo.zo.triton_cache"):
        triton_noise._kernels()
        cached = compile_into_cache()
    assert cached.is_relative_to(tmp_path / ".triton" / "cache") and not caplog.records


def test_an_unexpanded_home_is_no_cache_folder():
    """A container's user with no home and no ``HOME``: ``~`` stays ``~``, and Triton would
    make a folder named ``~`` wherever the job started."""
    assert cache_problem("~/.triton/cache") == "no home folder to hold it"
