"""On several nodes a hub ``--model`` is read at one commit, rank 0's: each node's own
cache may hold another ``main`` (one node ran ``hf download`` last week, another today; the
hub answered one node and not another). Each node here is a process with a cache of its own
(an ``HF_HUB_CACHE`` folder), and rank 0's side of the host group a stand-in."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from distzo.dist import LaunchEnv
from distzo.job import build

OLD, NEW = "a" * 40, "b" * 40
# rank 1, the first rank of the second of two nodes
NODE_1 = LaunchEnv(rank=1, world_size=2, local_rank=0, local_world_size=1, node_rank=1)
NODE_0 = LaunchEnv(rank=0, world_size=2, local_rank=0, local_world_size=1, node_rank=0)


def cache_with(cache: Path, main: str, *commits: str) -> Path:
    """A Hugging Face cache holding ``tiny/llama`` at ``commits``, ``main`` naming one."""
    repo = cache / "models--tiny--llama"
    for commit in commits:
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text('{"model_type": "llama"}')
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(main)
    return cache


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """This process's node: its own cache, no hub (huggingface_hub read both variables
    when it was imported: its constants too)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


class Peer:
    """The host group of two ranks seen from ``rank``: the other rank's verdicts, one per
    gather, are ``theirs`` (None: it passed), rank 0's broadcast is ``sent`` (recorded
    on rank 0)."""

    distributed = True

    def __init__(self, rank: int, theirs: tuple = (), sent: object = None) -> None:
        self.rank, self.theirs, self.sent = rank, list(theirs), sent

    def all_gather_object(self, mine):
        other = self.theirs.pop(0) if self.theirs else None
        return [mine, other] if self.rank == 0 else [other, mine]

    def broadcast_object(self, value, src: int = 0):
        if self.rank == 0:
            self.sent = value
        return self.sent

    def barrier(self, timeout=None):
        pass


def test_a_node_whose_cache_moved_on_reads_rank_0s_commit(offline_cache):
    # node 1's main is NEW (an hf download today): it was read there, the folder check
    # then refused the run naming config.json, not the commit nor the fix
    cache_with(offline_cache, NEW, OLD, NEW)
    source = build.model_source("tiny/llama", NODE_1, Peer(1, sent=(OLD, False)))
    assert source == offline_cache / "models--tiny--llama" / "snapshots" / OLD


def test_rank_0_sends_every_node_the_commit_its_main_is(offline_cache):
    cache_with(offline_cache, OLD, OLD)
    comm = Peer(0)
    assert build.model_source("tiny/llama", NODE_0, comm).name == OLD
    assert comm.sent == (OLD, False)  # the cache's main, not the hub's


def test_rank_0_sends_the_hubs_main_where_the_hub_answers(offline_cache, monkeypatch):
    import huggingface_hub

    from distzo.models import hub, hub_reads

    cache_with(offline_cache, OLD, OLD, NEW)  # the hub's main is ahead of this cache's
    monkeypatch.setattr(hub_reads, "hub_answers", lambda: True)
    monkeypatch.setattr(huggingface_hub, "repo_info", lambda name: SimpleNamespace(sha=NEW))
    assert hub.main_commit("tiny/llama") == (NEW, True)


def test_a_node_whose_cache_lacks_rank_0s_commit_fails_every_rank_with_the_fix(
    offline_cache, monkeypatch
):
    cache_with(offline_cache, NEW, NEW)
    with pytest.raises(ValueError) as err:
        build.model_source("tiny/llama", NODE_1, Peer(1, sent=(OLD, False)))
    message = str(err.value)
    assert message.startswith(f"rank 1: cannot download --model 'tiny/llama' at commit {OLD}")
    assert "the one rank 0 reads as main (" in message and "\n" not in message
    assert message.endswith(f"hf download tiny/llama --revision {OLD}")
    # rank 0, whose own download went well, raises rank 1's line too
    failed = ("ValueError", message.removeprefix("rank 1: "), None, None)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache_with(offline_cache / "0", OLD, OLD)))
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        build.model_source("tiny/llama", NODE_0, Peer(0, theirs=(None, failed)))


def test_a_model_rank_0_cannot_resolve_fails_every_rank_naming_it(offline_cache):
    failed = ("ValueError", "cannot download --model 'tiny/none': no such model", None, None)
    with pytest.raises(ValueError, match=r"^rank 0: cannot download --model 'tiny/none'"):
        build.model_source("tiny/none", NODE_1, Peer(1, theirs=(failed,)))


def test_a_resumed_run_reads_its_logged_commit_on_every_node_without_asking_rank_0(
    offline_cache,
):
    cache_with(offline_cache, NEW, OLD, NEW)
    source = build.model_source("tiny/llama", NODE_1, Peer(1, sent=(NEW, False)), OLD)
    assert source.name == OLD


def test_a_nodes_failed_download_is_every_ranks_line_with_its_own_reason(monkeypatch):
    """The download's reason (a refused token, a stall), not the cache read that followed
    it (the model is not in this node's cache), which hid it."""
    from distzo.models import hub

    downloads: list[bool] = []

    def snapshot(name, download, revision=None, option="--model", pinned_by=""):
        downloads.append(download)
        reason = "401 Unauthorized" if download else "not in the local cache"
        raise ValueError(f"cannot download --model {name!r} at commit {revision} ({reason})")

    monkeypatch.setattr(hub, "snapshot", snapshot)
    with pytest.raises(ValueError, match=r"^rank 1: cannot download .* \(401 Unauthorized\)$"):
        build.model_source("tiny/llama", NODE_1, Peer(1), OLD)
    assert downloads == [True]


def test_a_node_whose_cache_names_no_main_reads_rank_0s_commit(offline_cache):
    """Only rank 0 asks which commit ``main`` is: a node that fetched the commit by its hash
    (``hf download --revision``) has no ``main`` of its own to name, and needs none."""
    snapshot = offline_cache / "models--tiny--llama" / "snapshots" / OLD
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"model_type": "llama"}')
    assert build.model_source("tiny/llama", NODE_1, Peer(1, sent=(OLD, False))) == snapshot


def test_a_main_that_names_no_commit_is_one_line(offline_cache, monkeypatch):
    """A hub (a mirror) whose answer names no commit hash: every node would read its own."""
    import huggingface_hub

    from distzo.models import hub, hub_reads

    monkeypatch.setattr(hub_reads, "hub_answers", lambda: True)
    monkeypatch.setattr(huggingface_hub, "repo_info", lambda name: SimpleNamespace(sha="v1.0"))
    with pytest.raises(ValueError, match=r"^cannot download --model 'tiny/llama': its main names "):
        hub.main_commit("tiny/llama")


def test_a_node_that_read_the_hubs_main_by_its_hash_names_it_main(offline_cache):
    """As a download of ``main`` on one node does: an offline ``from_pretrained(name)`` on
    another node read the older ``main`` its cache named (or none, and failed)."""
    from huggingface_hub import snapshot_download

    cache_with(offline_cache, OLD, OLD, NEW)
    source = build.model_source("tiny/llama", NODE_1, Peer(1, sent=(NEW, True)))
    assert Path(snapshot_download("tiny/llama", local_files_only=True)) == source
    assert source.name == NEW
    assert [p.name for p in (offline_cache / "models--tiny--llama" / "refs").iterdir()] == ["main"]


def test_a_node_keeps_its_main_where_rank_0s_came_from_a_cache(offline_cache):
    """Rank 0's cache's main (the hub did not answer it) may be older than this node's."""
    from huggingface_hub import snapshot_download

    cache_with(offline_cache, NEW, OLD, NEW)
    assert build.model_source("tiny/llama", NODE_1, Peer(1, sent=(OLD, False))).name == OLD
    assert Path(snapshot_download("tiny/llama", local_files_only=True)).name == NEW


def test_a_node_whose_cache_it_may_only_read_keeps_its_main_and_loads(offline_cache, monkeypatch):
    """A group's shared cache: its ``main`` is its owners' to move, and the run goes on."""
    cache_with(offline_cache, OLD, OLD, NEW)

    def refused(path: Path, *args, **kwargs) -> None:  # as for a member, root included
        raise PermissionError(13, "Permission denied", str(path))

    with monkeypatch.context() as patched:
        patched.setattr(Path, "write_text", refused)
        source = build.model_source("tiny/llama", NODE_1, Peer(1, sent=(NEW, True)))
    assert source.name == NEW
    assert (offline_cache / "models--tiny--llama" / "refs" / "main").read_text() == OLD
