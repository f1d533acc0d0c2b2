"""A compute node whose route to the hub accepts connections and never answers (a proxy, a
firewall): huggingface_hub waits for an API answer without a time limit, so a hub
``--model`` hung the run, silently, before its first line. The hub gets one bounded try,
then the Hugging Face cache is read (a model's snapshot, an ``hf:`` dataset)."""

import socket
import subprocess
import sys
import threading
from pathlib import Path

from transformers import LlamaConfig, LlamaForCausalLM

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
