"""A local stand-in for the Hugging Face hub holding one model, tiny/llama, and one dataset,
org/tiny (a ``train.jsonl`` of ``ROWS`` and a ``validation.jsonl`` at its main,
``COMMIT``; a ``train.jsonl`` of ``OLD_ROWS`` at an earlier commit, ``OLD_COMMIT``, which
its tag ``v1`` names; both splits of other rows at a later commit, ``NEW_COMMIT``, which
``REFS`` may move main to), that records every request it answers: huggingface_hub,
transformers and datasets pointed at it, caches of the test's own."""

import contextlib
import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import transformers.utils.hub
from transformers import LlamaConfig

from distzo.models import hub_reads
from tests.helpers.models import LLAMA

COMMIT = "b" * 40  # the hub's main
CONFIG = json.dumps(LlamaConfig(**LLAMA).to_dict()).encode()
ROWS = [{"sentence": f"row {i}", "label": i % 2} for i in range(4)]
VALIDATION_ROWS = [{"sentence": f"held-out row {i}", "label": i % 2} for i in range(2)]
OLD_COMMIT = "a" * 40  # an earlier commit of org/tiny, whose rows differ
OLD_ROWS = [{"sentence": f"old row {i}", "label": 1 - i % 2} for i in range(3)]
NEW_COMMIT = "c" * 40  # a later commit of org/tiny, no ref names it until a test moves main
NEW_ROWS = [{"sentence": f"new row {i}", "label": i % 2} for i in range(5)]


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


FILES = {  # org/tiny's files, by commit: its main a train and a validation split
    COMMIT: {"train.jsonl": jsonl(ROWS), "validation.jsonl": jsonl(VALIDATION_ROWS)},
    OLD_COMMIT: {"train.jsonl": jsonl(OLD_ROWS)},
    NEW_COMMIT: {"train.jsonl": jsonl(NEW_ROWS), "validation.jsonl": jsonl(VALIDATION_ROWS)},
}
# org/tiny's branches and tags, by name: a test moves main (monkeypatch.setitem)
REFS = {"main": COMMIT, "v1": OLD_COMMIT}


def named_commit(path: str) -> str | None:
    """The commit of org/tiny an API or file path names (a ref: its commit in ``REFS``)."""
    parts = path.split("/")
    named = next((parts[i + 1] for i, p in enumerate(parts[:-1]) if p in REVISION_AT), "main")
    return REFS.get(named, named if named in FILES else None)


REVISION_AT = ("revision", "tree", "resolve")  # what a path's revision follows


class Hub(BaseHTTPRequestHandler):
    """tiny/llama at COMMIT: its model info, its file listing and its config.json; each
    request's method and path appended to the server's ``requests``."""

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

    def dataset_api(self, path: str) -> None:
        """org/tiny's info, and its tree's listing: its files at the commit named."""
        commit = named_commit(path)
        if commit is None:
            return self.answer(404, headers={"X-Error-Code": "RevisionNotFound"})
        files = FILES[commit]
        entries = [
            {"type": "file", "path": name, "size": len(body), "oid": hashlib.sha1(body).hexdigest()}
            for name, body in files.items()
        ]
        if "/tree/" in path:
            return self.answer(200, json.dumps(entries).encode())
        siblings = [{"rfilename": name} for name in files]
        info = {"id": "org/tiny", "sha": commit, "siblings": siblings}
        return self.answer(200, json.dumps(info).encode())

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        self.server.requests.append(f"{self.command} {path}")  # type: ignore[attr-defined]
        oid = hashlib.sha1(CONFIG).hexdigest()
        if path == "/":
            return self.answer(200)
        if path.startswith("/api/models/tiny/llama/tree/"):
            listing = [{"type": "file", "path": "config.json", "size": len(CONFIG), "oid": oid}]
            return self.answer(200, json.dumps(listing).encode())
        if path.startswith("/api/models/tiny/llama"):
            info = {"id": "tiny/llama", "sha": COMMIT, "siblings": [{"rfilename": "config.json"}]}
            return self.answer(200, json.dumps(info).encode())
        if path.startswith("/tiny/llama/") and path.endswith("/config.json"):
            return self.answer(200, CONFIG, {"X-Repo-Commit": COMMIT, "ETag": f'"{oid}"'})
        if path.startswith("/api/datasets/org/tiny"):
            return self.dataset_api(path)
        commit = named_commit(path)
        name = path.rsplit("/", 1)[-1]
        if path.startswith("/datasets/org/tiny/resolve/") and name.endswith(".jsonl"):
            if commit is None:
                return self.answer(404, headers={"X-Error-Code": "RevisionNotFound"})
            if name in FILES[commit]:
                body, tag = FILES[commit][name], hashlib.sha1(FILES[commit][name]).hexdigest()
                return self.answer(200, body, {"X-Repo-Commit": commit, "ETag": f'"{tag}"'})
        return self.answer(404, headers={"X-Error-Code": "EntryNotFound"})


@contextlib.contextmanager
def stand_in_hub(monkeypatch: pytest.MonkeyPatch, cache: Path) -> Iterator[list[str]]:
    """huggingface_hub and datasets pointed at a ``Hub`` with their caches in ``cache``;
    yields the list of requests the hub answered, as they come."""
    import datasets.config
    from huggingface_hub import constants

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    server.requests = []  # type: ignore[attr-defined]
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
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", endpoint)
    url = datasets.config.HUB_DATASETS_URL.replace(datasets.config.HF_ENDPOINT, endpoint, 1)
    monkeypatch.setattr(datasets.config, "HUB_DATASETS_URL", url)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache / "datasets")
    monkeypatch.setattr(hub_reads, "SILENT_SINCE", {})
    try:
        yield server.requests  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()
