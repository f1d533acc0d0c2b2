"""A hub (or a proxy) that answers the probe, then stalls: huggingface_hub's client waits
without a time limit wherever a call names none (the model listing of every snapshot), so
every rank hung with no output. Each read is bounded by ``HF_HUB_DOWNLOAD_TIMEOUT`` within
distzo's calls: the cache where it holds the model, else one line; a download whose bytes
keep coming is not cut off."""

import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import transformers.utils.hub
from transformers import LlamaConfig

from distzo.models import hub, hub_reads
from tests.helpers.models import LLAMA

LIMIT_S = 0.3  # HF_HUB_DOWNLOAD_TIMEOUT in these tests
BOUND_S = 10.0  # how long a call may take before the test calls it a hang
SLOW_BODY = b"x" * 4  # a byte each LIMIT_S / 2: alive, longer than LIMIT_S in all
# the API's answer about a repository (its name in %s) at a commit, and its files
FILES_INFO = (
    b'{"id": "%s", "sha": "' + b"d" * 40 + b'", "siblings": [{"rfilename": "README.md"}, '
    b'{"rfilename": "config.json"}, {"rfilename": "train.csv"}]}'
)


def _serve(connection: socket.socket) -> None:
    """HEAD / answered (the probe); /slow sent a byte at a time, /late whole after twice
    the limit; huggingface_hub's agent registry and dataset org/missing a 404 (not its own
    wait); the API's answers about model tiny/files and dataset org/files (not their
    files); anything else (a model's listing, its files) stalled."""
    reader = connection.makefile("rb")
    while line := reader.readline():
        while reader.readline() not in (b"\r\n", b""):
            pass
        method, path = line.split()[:2]
        if method == b"HEAD" and path == b"/":
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        elif path == b"/slow":
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(SLOW_BODY))
            for byte in SLOW_BODY:
                time.sleep(LIMIT_S / 2)
                connection.sendall(bytes([byte]))
        elif path == b"/late":
            time.sleep(2 * LIMIT_S)
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nlate")
        elif path == b"/api/agent-harnesses" or path.startswith(b"/api/datasets/org/missing"):
            connection.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        elif path.split(b"/")[3:5] in ([b"org", b"files"], [b"tiny", b"files"]):
            info = FILES_INFO % b"/".join(path.split(b"/")[3:5])
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(info) + info)
        else:
            return  # accepted, never answered


@pytest.fixture
def stalling_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    """huggingface_hub and datasets pointed at a local hub of the kind above, with a cache
    in tmp_path."""
    import datasets.config
    from huggingface_hub import constants

    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                connection = server.accept()[0]
            except OSError:  # closed
                return
            held.append(connection)
            threading.Thread(target=_serve, args=(connection,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
    url = constants.HUGGINGFACE_CO_URL_TEMPLATE.replace(constants.ENDPOINT, endpoint, 1)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url)  # a file's address
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    # transformers keeps one HfApi, of the endpoint it was made under: a later test's
    # stand-in hub would see its revision lookups sent to this one's port
    monkeypatch.setattr(transformers.utils.hub, "_hf_api", None)
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", endpoint)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", LIMIT_S)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_reads, "SILENT_SINCE", {})
    try:
        yield endpoint
    finally:
        server.close()
        for connection in held:  # ends a request the old code still waits on
            connection.close()


def within_bound(call: Callable[[], object]) -> object:
    """``call``'s result or error, failing the test where it has not returned in BOUND_S."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as err:
            outcome.append(err)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(BOUND_S)
    assert outcome, f"still waiting on the hub after {BOUND_S} s"
    return outcome[0]


def cache_model(cache: Path, name: str) -> Path:
    commit = "c" * 40
    repo = cache / f"models--{name.replace('/', '--')}"
    LlamaConfig(**LLAMA).save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


def test_a_hub_that_stalls_after_the_probe_is_read_from_the_cache(stalling_hub, caplog):
    from huggingface_hub import constants

    cached = cache_model(Path(constants.HF_HUB_CACHE), "tiny/llama")
    with caplog.at_level(logging.WARNING, logger=hub_reads.__name__):
        assert within_bound(lambda: hub.snapshot("tiny/llama", True)) == cached
    said = [r.getMessage() for r in caplog.records if r.name == hub_reads.__name__]
    assert len(said) == 1 and said[0].startswith(f"the hub ({stalling_hub}) answered, then ")
    assert f"sent nothing for {LIMIT_S} s" in said[0]
    assert stalling_hub in hub_reads.SILENT_SINCE  # not asked again: the config, the other ranks


def test_a_stalled_hub_without_the_model_in_the_cache_is_one_line(stalling_hub):
    error = within_bound(lambda: hub.snapshot("tiny/none", True))
    assert isinstance(error, ValueError)
    assert str(error) == (
        f"cannot download --model 'tiny/none': the hub ({stalling_hub}) sent nothing for "
        f"{LIMIT_S} s (HF_HUB_DOWNLOAD_TIMEOUT; a larger one waits longer, HF_HUB_OFFLINE=1 "
        "reads the cache where it holds the model)"
    )


def test_each_read_is_bounded_not_the_download(stalling_hub):
    """A body whose bytes keep coming outlasts the limit and arrives whole; a stalled
    answer times out; on a client made after the library closed its last one too."""
    from huggingface_hub import close_session, get_session

    with hub_reads.bounded_reads():
        pass
    close_session()  # as after a fork, or a user's set_client_factory
    with hub_reads.bounded_reads():
        started = time.monotonic()
        assert get_session().get(f"{stalling_hub}/slow").content == SLOW_BODY
        assert time.monotonic() - started > LIMIT_S
        with pytest.raises(Exception) as raised:  # httpx2's or httpx's, as the hub's version
            get_session().get(f"{stalling_hub}/api/models/tiny/llama", timeout=None)
        assert type(raised.value).__name__ == "ReadTimeout"


def test_another_threads_client_and_its_waits_are_left_as_they_were(stalling_hub):
    """A notebook thread that downloads while distzo bounds its own reads keeps its client
    (the block closed the shared client, and that thread's next request raised) and waits
    as long as it asked (the block's limit applied to every thread's request)."""
    from huggingface_hub import get_session

    client = get_session()
    entered, answered = threading.Event(), threading.Event()
    replies: list[object] = []

    def notebook() -> None:
        entered.wait(BOUND_S)
        try:
            replies.append(client.get(f"{stalling_hub}/late", timeout=None).content)
        except Exception as err:
            replies.append(err)
        answered.set()

    thread = threading.Thread(target=notebook, daemon=True)
    thread.start()
    with hub_reads.bounded_reads():
        entered.set()
        assert answered.wait(BOUND_S)
    assert replies == [b"late"]
    assert get_session() is client
    assert client.head(stalling_hub).status_code == 200


def test_a_timeout_is_known_whichever_client_the_hub_sends_through(monkeypatch):
    """huggingface_hub 1.x (which transformers 5.20 accepts) sends through httpx, not
    httpx2: any hub failure there had raised ``No module named 'httpx2'`` from the check."""

    class TimeoutException(Exception):
        pass

    class ReadTimeout(TimeoutException):
        pass

    monkeypatch.setitem(sys.modules, "httpx2", None)  # not installed: importing it raises
    monkeypatch.setitem(sys.modules, "httpx", SimpleNamespace(TimeoutException=TimeoutException))
    listing = ValueError("the listing failed")
    listing.__context__ = ReadTimeout("timed out")
    assert hub_reads.stalled(listing)
    assert not hub_reads.stalled(ValueError("404 Not Found"))


def test_a_hub_models_config_is_read_from_the_cache_where_the_hub_stalls(stalling_hub, caplog):
    """Asked about once, bounded, then read as offline: transformers had waited on its
    revision listing without a limit, and on an uncached config.json retried its metadata
    six times, 60 s each."""
    from huggingface_hub import constants

    from distzo.models.config_file import read_config

    cache_model(Path(constants.HF_HUB_CACHE), "tiny/llama")
    with caplog.at_level(logging.WARNING, logger=hub_reads.__name__):
        config = within_bound(lambda: read_config("tiny/llama"))
    assert config.num_hidden_layers == LLAMA["num_hidden_layers"]
    said = [r.getMessage() for r in caplog.records if r.name == hub_reads.__name__]
    assert len(said) == 1 and said[0].startswith(f"the hub ({stalling_hub}) answered, then ")
    hub_reads.SILENT_SINCE.clear()  # the hub asked again, for a model the cache lacks
    error = within_bound(lambda: read_config("tiny/none"))
    assert isinstance(error, ValueError) and "\n" not in str(error)
    assert str(error).startswith("cannot load --model 'tiny/none': ")


def test_a_hub_dataset_where_the_hub_stalls_is_one_line(stalling_hub, caplog):
    """Asked about once, not through datasets' retries of a file's metadata (over six
    minutes): then offline, as a hub that never answers."""
    from distzo.data.loaders import load_rows

    with caplog.at_level(logging.WARNING, logger=hub_reads.__name__):
        error = within_bound(lambda: load_rows("hf:org/none:train"))
    assert isinstance(error, ValueError)
    assert str(error).startswith("hf:org/none:train: cannot load from the hub (")
    assert str(error).endswith("; use a local file") and "\n" not in str(error)
    said = [r.getMessage() for r in caplog.records if r.name == hub_reads.__name__]
    assert len(said) == 1 and said[0].startswith(f"the hub ({stalling_hub}) answered, then ")


class ListingHub:
    """HfApi as a hub whose model listing names ``siblings`` (None: a listing without
    them) and whose tree listing names ``tree``; snapshot_download as the patterns it got."""

    def __init__(self, siblings: list[str] | None, tree: list[str]) -> None:
        self.siblings, self.tree = siblings, tree
        self.fetched: list[list[str]] = []

    def model_info(self, name: str, revision: str | None) -> object:
        from huggingface_hub.hf_api import RepoSibling

        names = self.siblings
        return SimpleNamespace(siblings=None if names is None else [RepoSibling(n) for n in names])

    def list_repo_files(self, name: str, revision: str | None) -> list[str]:
        return self.tree

    def snapshot_download(self, name: str, revision: str | None, allow_patterns: list[str]) -> str:
        self.fetched.append(allow_patterns)
        return "folder"


@pytest.mark.parametrize(
    ("siblings", "weights"),
    [(["config.json", "model.bin"], "*.bin"), (None, "*.safetensors")],
)
def test_the_listing_that_chooses_the_weights_is_the_models_own(monkeypatch, siblings, weights):
    """One model_info request names the files (its tree listing where it names none): a
    repository with safetensors is fetched without its .bin duplicates."""
    import huggingface_hub

    listing = ListingHub(siblings, tree=["config.json", "model.safetensors", "model.bin"])
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda: listing)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", listing.snapshot_download)
    assert hub._download("org/model", None) == Path("folder")
    assert listing.fetched == [hub.METADATA + [weights]]


def test_a_call_that_names_its_own_timeout_keeps_it(stalling_hub):
    """An answer later than the limit reaches a call that waits longer of its own."""
    from huggingface_hub import get_session

    with hub_reads.bounded_reads():
        assert get_session().get(f"{stalling_hub}/late", timeout=BOUND_S).content == b"late"


def test_the_limit_ends_with_the_block_and_its_hook_is_added_once(stalling_hub):
    """A notebook's own hub calls after a run wait as long as they ask, and each run adds
    no hook of its own to the shared client."""
    from huggingface_hub import get_session

    for _ in range(2):
        with hub_reads.bounded_reads():
            pass
    assert get_session().event_hooks["request"].count(hub_reads.bound_reads) == 1
    assert get_session().get(f"{stalling_hub}/late", timeout=None).content == b"late"
    request = SimpleNamespace(extensions={"timeout": {"connect": None, "read": None}})
    hub_reads.bound_reads(request)  # outside a block: the user's call
    assert request.extensions["timeout"] == {"connect": None, "read": None}


def test_connecting_is_bounded_too(monkeypatch):
    """A host that takes no connection (a firewall that drops the files' host, not the
    hub's) is a stall after the limit: the client's own wait was the system's, minutes."""
    from huggingface_hub import constants, get_session

    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", LIMIT_S)
    with socket.create_server(("127.0.0.1", 0), backlog=0) as full:  # never accepts
        address = full.getsockname()
        with socket.create_connection(address):  # the one its queue holds

            def connect() -> object:
                with hub_reads.bounded_reads():
                    return get_session().get(f"http://{address[0]}:{address[1]}")

            error = within_bound(connect)
    assert hub_reads.stalled(error), error


def test_a_hub_that_answers_no_such_repository_has_answered(stalling_hub, caplog):
    """Its load then says why; no stall is said, and the hub is asked again."""
    with caplog.at_level(logging.WARNING, logger=hub_reads.__name__):
        assert hub_reads.repo_answers("org/missing", "dataset")
    assert not [r for r in caplog.records if r.name == hub_reads.__name__]
    assert not hub_reads.SILENT_SINCE


def test_the_commit_of_main_where_the_hub_stalls_on_it_is_the_caches(
    stalling_hub, caplog, monkeypatch
):
    """Rank 0 asks which commit ``main`` is for every node: a stall there hung the job."""
    import huggingface_hub
    from huggingface_hub import constants

    # the library's repo_info asks the endpoint of its import: this one's, as HF_ENDPOINT
    monkeypatch.setattr(huggingface_hub, "repo_info", huggingface_hub.HfApi().repo_info)
    cached = cache_model(Path(constants.HF_HUB_CACHE), "tiny/llama")
    with caplog.at_level(logging.WARNING, logger=hub_reads.__name__):
        assert within_bound(lambda: hub.main_commit("tiny/llama")) == (cached.name, False)
    said = [r.getMessage() for r in caplog.records if r.name == hub_reads.__name__]
    assert len(said) == 1 and said[0].startswith(f"the hub ({stalling_hub}) answered, then ")


def test_load_model_of_a_hub_name_is_bounded_as_the_clis_model(stalling_hub, caplog, tmp_path):
    """The Python API's ``load_model("org/name")``, on a hub that stalls: the cache's model
    with the one warning, or one line, as ``--model`` (it had waited out transformers'
    retries of a file's metadata, 60 s each, or forever on its revision listing)."""
    from huggingface_hub import constants

    from distzo import load_model
    from tests.helpers.models import base_model

    cached = cache_model(Path(constants.HF_HUB_CACHE), "tiny/llama")
    base_model("llama").save_pretrained(cached)
    with caplog.at_level(logging.WARNING, logger=hub_reads.__name__):
        model = within_bound(lambda: load_model("tiny/llama"))
    assert not isinstance(model, Exception), model
    assert model.config.num_hidden_layers == LLAMA["num_hidden_layers"]
    assert model.name_or_path == model.config.name_or_path == "tiny/llama"
    said = [r.getMessage() for r in caplog.records if r.name == hub_reads.__name__]
    assert len(said) == 1 and said[0].startswith(f"the hub ({stalling_hub}) answered, then ")
    hub_reads.SILENT_SINCE.clear()
    error = within_bound(lambda: load_model("tiny/none"))
    assert isinstance(error, ValueError) and "\n" not in str(error)
    assert str(error).startswith("cannot load model 'tiny/none': ")


def test_a_hub_whose_answers_come_and_files_stall_is_asked_once_then_read_offline(
    stalling_hub, caplog
):
    """A proxy that passes the API and not the files: a model's config from the cache, a
    dataset in one line, each with the one warning (datasets and transformers had asked
    about a file six times, 10 s then 60 s each, their own limit)."""
    from huggingface_hub import constants

    from distzo.data.loaders import load_rows
    from distzo.models.config_file import read_config

    cache_model(Path(constants.HF_HUB_CACHE), "tiny/files")
    with caplog.at_level(logging.WARNING, logger=hub_reads.__name__):
        config = within_bound(lambda: read_config("tiny/files"))
        assert config.num_hidden_layers == LLAMA["num_hidden_layers"]
        hub_reads.SILENT_SINCE.clear()
        error = within_bound(lambda: load_rows("hf:org/files:train"))
    assert isinstance(error, ValueError) and "\n" not in str(error)
    assert str(error).startswith("hf:org/files:train: cannot load from the hub (")
    said = [r.getMessage() for r in caplog.records if r.name == hub_reads.__name__]
    assert len(said) == 2 and all(s.startswith(f"the hub ({stalling_hub}) answered") for s in said)


def test_rank_0s_commit_of_a_dataset_whose_files_stall_is_the_caches(stalling_hub, caplog):
    """Rank 0's question (which commit?) asks about one of the dataset's files too: its
    download that follows asks no more whether the hub answers, so a stall on the files is
    found here, in one bounded request, not in datasets' retries (10 s, then 60 s a try)."""
    from distzo.data.loaders import hub_dataset_revision

    with caplog.at_level(logging.WARNING, logger=hub_reads.__name__):
        assert within_bound(lambda: hub_dataset_revision("hf:org/files:train")) == ""
    said = [r.getMessage() for r in caplog.records if r.name == hub_reads.__name__]
    assert len(said) == 1 and said[0].startswith(f"the hub ({stalling_hub}) answered, then ")
