"""A group's read-only Hugging Face cache whose copy of a model is not the hub's ``main``
now: the download the hub's answer asks for cannot be written there. The error named only
the folder huggingface_hub could not make; it names the cache and the two ways out."""

import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import transformers.utils.hub
from transformers import LlamaConfig

from distzo.models import hub
from distzo.models.config_file import read_config
from tests.helpers.models import LLAMA
from tests.helpers.read_only import read_only

OLD, NEW = "a" * 40, "b" * 40  # the cache's main, the hub's main now
CONFIG = json.dumps(LlamaConfig(**LLAMA).to_dict()).encode()


class Hub(BaseHTTPRequestHandler):
    """tiny/llama at NEW: its model info, its file listing and its config.json."""

    def log_message(self, *args: object) -> None:
        pass

    def answer(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None):
        self.send_response(code)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        oid = hashlib.sha1(CONFIG).hexdigest()
        if path == "/":
            return self.answer(200)
        if path.startswith("/api/models/tiny/llama/tree/"):
            listing = [{"type": "file", "path": "config.json", "size": len(CONFIG), "oid": oid}]
            return self.answer(200, json.dumps(listing).encode())
        if path.startswith("/api/models/tiny/llama"):
            info = {"id": "tiny/llama", "sha": NEW, "siblings": [{"rfilename": "config.json"}]}
            return self.answer(200, json.dumps(info).encode())
        if path.endswith("/config.json"):
            return self.answer(200, CONFIG, {"X-Repo-Commit": NEW, "ETag": f'"{oid}"'})
        return self.answer(404, headers={"X-Error-Code": "EntryNotFound"})


@pytest.fixture
def moved_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """huggingface_hub pointed at a local hub of the kind above, its cache (in tmp_path)
    holding tiny/llama at OLD, read-only."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--tiny--llama"
    LlamaConfig(**LLAMA).save_pretrained(repo / "snapshots" / OLD)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(OLD)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    url = constants.HUGGINGFACE_CO_URL_TEMPLATE.replace(constants.ENDPOINT, endpoint, 1)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url)  # a file's address
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    # transformers keeps one HfApi, of the endpoint it was made under: a later test's
    # stand-in hub would see its revision lookups sent to this one's port
    monkeypatch.setattr(transformers.utils.hub, "_hf_api", None)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub, "SILENT_SINCE", {})
    try:
        with read_only(cache, monkeypatch):
            yield cache
    finally:
        server.shutdown()
        server.server_close()


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
