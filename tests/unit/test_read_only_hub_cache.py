"""A group's read-only Hugging Face cache whose copy of a model is not the hub's ``main``
now: the download the hub's answer asks for cannot be written there. The error named only
the folder huggingface_hub could not make; it names the cache and the two ways out."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import LlamaConfig

from distzo.models import hub
from distzo.models.config_file import read_config
from tests.helpers.models import LLAMA
from tests.helpers.read_only import read_only
from tests.helpers.stand_in_hub import stand_in_hub

OLD = "a" * 40  # the cache's main (the hub's is newer)


@pytest.fixture
def moved_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """huggingface_hub pointed at a stand-in hub, its cache (in tmp_path) holding
    tiny/llama at OLD, read-only."""
    cache = tmp_path / "hub"
    repo = cache / "models--tiny--llama"
    LlamaConfig(**LLAMA).save_pretrained(repo / "snapshots" / OLD)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(OLD)
    with stand_in_hub(monkeypatch, cache), read_only(cache, monkeypatch):
        yield cache


WAYS_OUT = (
    "and does not hold tiny/llama at the hub's main now: HF_HUB_OFFLINE=1 reads the copy it "
    "holds, or set HF_HUB_CACHE to a folder you may write"
)


def test_a_snapshot_the_cache_cannot_take_names_the_cache_and_the_ways_out(moved_hub):
    with pytest.raises(ValueError) as raised:
        hub.snapshot("tiny/llama", True)
    assert str(raised.value) == (
        f"cannot download --model 'tiny/llama': the Hugging Face cache {moved_hub} cannot "
        f"be written (Permission denied) {WAYS_OUT}"
    )


def test_a_config_the_cache_cannot_take_names_the_cache_and_the_ways_out(moved_hub):
    with pytest.raises(ValueError) as raised:
        read_config("tiny/llama")
    assert str(raised.value) == (
        f"cannot load --model 'tiny/llama': the Hugging Face cache {moved_hub} cannot be "
        f"written (Permission denied) {WAYS_OUT}"
    )
