"""A compute node whose route to the hub accepts connections and never answers (a proxy, a
firewall): huggingface_hub waits for an API answer without a time limit, so a hub
``--model`` hung the run, silently, before its first line. The hub gets one bounded try,
then the Hugging Face cache is read (a model's snapshot, an ``hf:`` dataset)."""

import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from distzo.models import hub, hub_reads
from tests.helpers.launch import child_env
from tests.helpers.models import LLAMA

PROBE = """
from distzo.data.loaders import load_rows
from distzo.models.config_file import read_config
from distzo.models.hub import snapshot
print(read_config("tiny/llama").num_hidden_layers, snapshot("tiny/llama", True).name)
try:
    load_rows("hf:org/none:train")  # datasets waits on the hub without a limit too
except ValueError as err:
    print(err)
"""


def silent_server() -> tuple[socket.socket, list[socket.socket]]:
    """A listening socket whose connections are accepted and never answered."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(server.accept()[0])
            except OSError:  # closed
                return

    threading.Thread(target=accept, daemon=True).start()
    return server, accepted


def test_a_hub_that_never_answers_is_read_from_the_cache(tmp_path: Path):
    commit = "c" * 40
    repo = tmp_path / "hub" / "models--tiny--llama"
    LlamaForCausalLM(LlamaConfig(**{**LLAMA, "num_hidden_layers": 2})).save_pretrained(
        repo / "snapshots" / commit
    )
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    server, accepted = silent_server()
    env = child_env(
        {
            "HF_HUB_CACHE": str(tmp_path / "hub"),
            "HF_HUB_OFFLINE": "0",
            "HF_ENDPOINT": f"http://127.0.0.1:{server.getsockname()[1]}",
            "HF_HUB_ETAG_TIMEOUT": "1",
        }
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, env=env
        )
    finally:
        server.close()
        for connection in accepted:
            connection.close()
    assert proc.returncode == 0, proc.stderr[-2000:]
    config, data = proc.stdout.splitlines()
    assert config.split() == ["2", commit]
    assert data.startswith("hf:org/none:train: cannot load from the hub (") and data.endswith(
        "; use a local file"
    )
    warnings = [line for line in proc.stderr.splitlines() if "did not answer within 1 s" in line]
    assert len(warnings) == 1, proc.stderr[-2000:]  # asked once, not again for the rest


class Session:
    """huggingface_hub's HTTP session as a hub that answers, or one that never does."""

    def __init__(self, answers: bool) -> None:
        self.answers = answers
        self.asked: list[str] = []
        self.event_hooks: dict[str, list] = {"request": [], "response": []}  # bounded_reads'

    def head(self, url: str, timeout: float) -> None:
        self.asked.append(url)
        if not self.answers:
            raise TimeoutError("timed out")


def patch_hub(monkeypatch: pytest.MonkeyPatch, answers: bool, offline: bool) -> Session:
    import huggingface_hub
    from huggingface_hub import constants

    session = Session(answers)
    monkeypatch.setattr(huggingface_hub, "get_session", lambda: session)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(hub_reads, "SILENT_SINCE", {})
    return session


def test_the_hub_is_asked_once_and_only_where_it_may_answer(monkeypatch, caplog):
    """Offline: no request at all (no wait, no warning); a hub that answers is read from; one
    that did not is not asked again within ``SILENT_HUB_S``."""
    session = patch_hub(monkeypatch, answers=True, offline=True)
    assert not hub_reads.hub_answers() and session.asked == []
    session = patch_hub(monkeypatch, answers=True, offline=False)
    assert hub_reads.hub_answers() and hub_reads.hub_answers() and len(session.asked) == 2
    assert hub_reads.SILENT_SINCE == {} and "did not answer" not in caplog.text
    session = patch_hub(monkeypatch, answers=False, offline=False)
    assert not hub_reads.hub_answers() and not hub_reads.hub_answers() and len(session.asked) == 1


def test_offline_while_silent_restores_both_libraries_flags(monkeypatch):
    """huggingface_hub and datasets each keep their own copy of ``HF_HUB_OFFLINE``: both are
    offline in the block and back as they were after it, so a hub that answers later (after
    ``SILENT_HUB_S``) is asked again."""
    import datasets.config
    from huggingface_hub import constants

    patch_hub(monkeypatch, answers=False, offline=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    with hub_reads.offline_unless_answered():
        assert constants.HF_HUB_OFFLINE and datasets.config.HF_HUB_OFFLINE
    assert not constants.HF_HUB_OFFLINE and not datasets.config.HF_HUB_OFFLINE
    patch_hub(monkeypatch, answers=True, offline=False)
    with hub_reads.offline_unless_answered():
        assert not constants.HF_HUB_OFFLINE and not datasets.config.HF_HUB_OFFLINE


def test_a_local_model_folder_never_asks_the_hub(tmp_path, monkeypatch):
    """Its config is read from the folder: a node without a route would wait out the
    request's time limit, and warn about hub names, for a model that is no hub name."""
    from distzo.models import config_file

    LlamaConfig(**LLAMA).save_pretrained(tmp_path)
    session = patch_hub(monkeypatch, answers=False, offline=False)
    assert config_file.read_config(str(tmp_path)).model_type == "llama"
    assert session.asked == []


def test_only_a_snapshot_folder_names_a_commit_and_only_a_hash_is_one(tmp_path):
    commit = "0123456789abcdef" * 2 + "01234567"
    assert hub.snapshot_commit(tmp_path / "snapshots" / commit) == commit
    for other in (tmp_path / "models" / commit, tmp_path / "snapshots" / "main"):
        assert hub.snapshot_commit(other) is None
    assert hub.check_commit(commit, "log") == commit
    for damaged in ("main", commit[:7], commit + "0", commit.upper(), 7, None):
        with pytest.raises(ValueError, match=r"^log: base_revision .* is not a commit hash"):
            hub.check_commit(damaged, "log")


def test_a_model_the_hub_cannot_give_says_what_to_do(monkeypatch, tmp_path):
    """A hub name the cache lacks, the hub out of reach: transformers' line said what
    failed, not what to do; a path that is no folder was read as a bad hub name ('Repo id
    must use alphanumeric chars...')."""
    from huggingface_hub import constants

    from distzo.models import config_file

    patch_hub(monkeypatch, answers=False, offline=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError) as err:
        config_file.read_config("nosuchorg/nosuchmodel")
    assert str(err.value) == (
        "cannot load --model 'nosuchorg/nosuchmodel': the hub is out of reach "
        "(HF_HUB_OFFLINE=1, or no answer) and the Hugging Face cache holds no copy of it; "
        "download it where the hub answers (hf download nosuchorg/nosuchmodel) or give "
        "--model a local folder"
    )
    missing = f"{tmp_path}/nope"
    with pytest.raises(ValueError) as err:
        config_file.read_config(missing, "--base")
    assert str(err.value) == (
        f"cannot load --base {missing!r}: no such folder, nor a hub name (org/name); give "
        "the model's folder"
    )
