"""How long distzo waits on the hub, which huggingface_hub, transformers and datasets would
wait on without a limit wherever a call names none: a compute node whose route out accepts
and never answers, or a proxy that answers and then stalls, hung every rank with no output.
Here: one bounded probe (``hub_answers``), each read of distzo's own hub calls bounded
(``bounded_reads``), and a hub that stalled taken as silent (``note_stall``), so the rest of
the run reads the Hugging Face cache instead of waiting on it again.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx2

logger = logging.getLogger(__name__)
SILENT_HUB_S = 300.0  # how long a hub that did not answer is taken as unreachable
SILENT_SINCE: dict[str, float] = {}  # endpoint -> when it last did not answer
# huggingface_hub's HTTP client: httpx2 from hub 2.0, httpx before (transformers 5.20
# accepts hub 1.31); only the installed one is there to import
HTTP_CLIENTS = ("httpx2", "httpx")


def hub_answers() -> bool:
    """Whether the hub answers a request within ``HF_HUB_ETAG_TIMEOUT`` (10 s by default).
    huggingface_hub waits for an API answer without a time limit, so on a compute node
    whose route out accepts and never answers (a proxy, a firewall) a hub name hung the run
    before its first line; a node that cannot reach the hub reads its cache instead. A hub
    that did not answer is not asked again for ``SILENT_HUB_S`` (the run's config, then its
    snapshot). Offline (``HF_HUB_OFFLINE=1``): False, with no request."""
    from huggingface_hub import constants, get_session

    if constants.HF_HUB_OFFLINE:
        return False
    endpoint, timeout = constants.ENDPOINT, constants.HF_HUB_ETAG_TIMEOUT
    if time.monotonic() - SILENT_SINCE.get(endpoint, -SILENT_HUB_S) < SILENT_HUB_S:
        return False
    try:
        get_session().head(endpoint, timeout=timeout)
    except Exception as err:  # no route, no name, no answer in time: httpx's kinds
        SILENT_SINCE[endpoint] = time.monotonic()
        logger.warning(
            "the hub (%s) did not answer within %s s (%s): hub names are read from the Hugging "
            "Face cache; HF_HUB_OFFLINE=1 skips this wait",
            endpoint,
            timeout,
            first_line(err),
        )
        return False
    return True


def first_line(err: BaseException) -> str:
    """An error's first line, or its kind where it says nothing (httpx's timeouts)."""
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def causes(err: BaseException) -> Iterator[BaseException]:
    """``err``, then what it was raised from, and so on: the libraries wrap the HTTP
    client's or the file system's error in their own."""
    cause: BaseException | None = err
    while cause is not None:
        yield cause
        cause = cause.__cause__ or cause.__context__


def stalled(err: BaseException) -> bool:
    """Whether ``err`` is (or was raised from) a request that timed out: a hub that
    accepted it and sent nothing for ``HF_HUB_DOWNLOAD_TIMEOUT``."""
    timeouts = timeout_types()
    return any(isinstance(cause, timeouts) for cause in causes(err))


def timeout_types() -> tuple[type[BaseException], ...]:
    """The timeout errors of the HTTP clients loaded in this process (``HTTP_CLIENTS``).
    A client that was never imported raised nothing, so none is imported here: which one
    huggingface_hub uses depends on its version."""
    clients = [sys.modules.get(name) for name in HTTP_CLIENTS]
    return tuple(client.TimeoutException for client in clients if client is not None)


def note_stall(err: BaseException) -> None:
    """Take a hub that stalled as one that does not answer (``hub_answers``), with the
    probe's warning: the rest of the run reads the cache instead of waiting on it again."""
    from huggingface_hub import constants

    SILENT_SINCE[constants.ENDPOINT] = time.monotonic()
    logger.warning(
        "the hub (%s) answered, then sent nothing for %s s (%s): hub names are read from the "
        "Hugging Face cache; HF_HUB_OFFLINE=1 skips this wait, a larger "
        "HF_HUB_DOWNLOAD_TIMEOUT waits longer",
        constants.ENDPOINT,
        constants.HF_HUB_DOWNLOAD_TIMEOUT,
        first_line(err),
    )


# the limit on each read of the requests this thread makes in a ``bounded_reads`` block;
# None outside one (a notebook's other threads, the user's own hub calls)
READ_LIMIT: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "distzo_hub_read_limit", default=None
)
_HOOK_LOCK = threading.Lock()


def bound_reads(request: httpx2.Request) -> None:
    """A request hook: within a ``bounded_reads`` block of this thread, a connect or read
    phase without a timeout of its own gets the block's limit; elsewhere, nothing."""
    limit = READ_LIMIT.get()
    if limit is None:
        return
    timeouts = dict(request.extensions.get("timeout", {}))
    for phase in ("connect", "read"):
        if timeouts.get(phase) is None:
            timeouts[phase] = limit
    request.extensions["timeout"] = timeouts


def hook_session() -> None:
    """``bound_reads`` among the request hooks of huggingface_hub's shared client (once a
    client: the library makes a new one after a fork, ``close_session`` or a user's
    ``set_client_factory``). Replacing the client's factory instead closed the client
    another thread of a notebook was downloading with, and bounded that thread too."""
    from huggingface_hub import get_session

    with _HOOK_LOCK:
        client = get_session()
        hooks = client.event_hooks
        if bound_reads not in hooks["request"]:
            client.event_hooks = {**hooks, "request": [*hooks["request"], bound_reads]}


@contextlib.contextmanager
def bounded_reads() -> Iterator[None]:
    """huggingface_hub's requests that this thread makes in the block give up after
    ``HF_HUB_DOWNLOAD_TIMEOUT`` (10 s by default) without a byte, and connecting after as
    long. Its client waits without a limit (``timeout=None``) wherever a call names no
    timeout of its own (the ``repo_info`` of every snapshot and config, the tree listing),
    so a hub or proxy that answered the probe and then stalled hung every rank with no
    output. A limit on each read, not on the whole request: a slow download whose bytes keep
    coming is not cut off. Calls that name their own timeout keep it; other threads'
    requests, and the shared client itself, are left as they were."""
    from huggingface_hub import constants

    hook_session()
    token = READ_LIMIT.set(float(constants.HF_HUB_DOWNLOAD_TIMEOUT))
    try:
        yield
    finally:
        READ_LIMIT.reset(token)


@contextlib.contextmanager
def offline_unless_answered(
    dataset: str | None = None, revision: str | None = None
) -> Iterator[None]:
    """Offline, as ``HF_HUB_OFFLINE=1`` makes huggingface_hub and datasets (which read it
    once, when imported), while the hub does not answer (``hub_answers``): a library whose
    calls have no time limit of their own reads its cache, not a silent route forever.
    ``dataset``: asked about first (``repo_answers``), at ``revision`` (None: its main), the
    one the load reads; a hub that stalls on it is taken as silent."""
    if hub_answers() and (dataset is None or repo_answers(dataset, "dataset", revision)):
        with bounded_reads():
            yield
        return
    with hub_offline():
        yield


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """huggingface_hub and datasets offline in the block: their caches alone are read."""
    import datasets.config
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


def hub_commit(ask: Callable[[], str | None]) -> str | None:
    """``ask()`` (a repository's commit, from the hub) within bounded reads, or None where
    the hub does not answer or stalls on it (``note_stall``): the cache is read then."""
    if not hub_answers():
        return None
    with bounded_reads():
        try:
            return ask()
        except Exception as err:
            if not stalled(err):
                raise
            note_stall(err)
            return None


def is_repo_id(name: str) -> bool:
    """Whether ``name`` may be a hub repository's id (``org/name`` or ``name``), by
    huggingface_hub's own rule: a path such as ``./model`` or ``/data/x`` is none."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def dataset_commit(name: str, revision: str | None = None) -> str:
    """The commit hub dataset ``name`` is now (at ``revision``, a tag, branch or commit;
    None: its main), or "" where the hub does not answer (or stalls on it, or on one of its
    files: ``hub_commit``, ``ask_about_a_file``): a launch's ranks read it at this one
    commit. Asked as ``repo_answers`` asks, so the download that follows, in the process
    that asked, asks no more whether the hub answers."""
    from huggingface_hub import HfApi

    def ask() -> str:
        info = HfApi().repo_info(name, repo_type="dataset", revision=revision)
        files = [sibling.rfilename for sibling in getattr(info, "siblings", None) or []]
        ask_about_a_file(name, "dataset", files, info.sha)
        return str(info.sha)

    return str(hub_commit(ask) or "")


def repo_answers(name: str, kind: str = "model", revision: str | None = None) -> bool:
    """Whether the hub answers about repository ``name`` (a ``kind``: model, dataset) at
    ``revision`` (None: its main; a resume's recorded commit, which its load reads, so
    ``main`` is not asked about), and about one of its files, each within
    ``HF_HUB_DOWNLOAD_TIMEOUT``, in requests the library does not retry; any answer
    counts, an unknown name too (the caller's load says why). A stall is noted
    (``note_stall``): transformers and datasets retried a stalled file's metadata for
    minutes (10 s, then 60 s a try), a limit their calls name, which ``bounded_reads``
    leaves to them."""
    from huggingface_hub import HfApi

    with bounded_reads():
        try:  # an HfApi of now's endpoint
            info = HfApi().repo_info(name, repo_type=kind, revision=revision)
            files = [sibling.rfilename for sibling in getattr(info, "siblings", None) or []]
            ask_about_a_file(name, kind, files, info.sha)
        except Exception as err:
            if stalled(err):
                note_stall(err)
                return False
    return True


# the file each library asks about first: transformers a model's config, datasets its card
FIRST_READ = ("config.json", "README.md")


def ask_about_a_file(name: str, kind: str, files: list[str], commit: str | None) -> None:
    """The metadata of one of repository ``name``'s ``files`` (the one its library reads
    first, where it has it) at ``commit``: a hub whose API answers and whose files stall
    (a proxy that passes one path and not the other) is a stall here, not in the load."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url

    if not files:
        return
    first = next((f for f in FIRST_READ if f in files), files[0])
    url = hf_hub_url(name, first, repo_type=kind, revision=commit, endpoint=constants.ENDPOINT)
    get_hf_file_metadata(url, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT)
