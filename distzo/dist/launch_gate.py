"""Every rank's input checks, agreed on before the process group forms.

Each rank checks its own input (``distzo.job.validation``) before it joins the process
group. On one node a rank that refuses its input ends the others at once: torchrun's
agent stops its node's ranks when one exits. Another node's agent never learns of it,
so its ranks would wait in the process group's rendezvous for the rank that left, the
whole ``--dist-timeout`` (5 minutes by default), and then blame "another rank". A node
may well refuse what another accepts: a data file or a model folder at a path that
exists on one node only. So the rendezvous store torchrun already provides carries the
verdicts: a rank that refuses its input writes why (``report_refusal``), and a rank that
passed waits there until every rank has passed (``await_every_rank``), or raises the
refusal, naming the rank and its node, within a poll interval. A question every rank
needs answered from a shared service (the hub) is asked by rank 0 alone, its answer told to
the others through the same store (``rank_0_answers``); one a node's ranks share (its cache
filled), by the node's first rank (``node_first_answers``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from distzo.dist.launch_env import LaunchEnv

POLL_S = 0.1
# How long a refusing rank tries to reach the store, and then waits for the ranks that
# were already waiting to read its refusal (node 0's agent hosts the store: once that
# node's ranks have exited it goes, and a rank that had not read the refusal yet would
# only see the store gone).
REPORT_S = 5.0
REFUSAL = "refusal"  # the first refusing rank's line
PASSED = "passed"  # how many ranks passed their checks
TOLD = "told"  # how many ranks have read the refusal
ANSWER = "answer/"  # rank 0's answers, by question (``rank_0_answers``)
ASKING = "asking"  # how many ranks wait for one of rank 0's answers


def gate_store(store: dist.Store, env: LaunchEnv) -> dist.Store:
    """The keys of this launch attempt's checks in ``store`` (torchrun's store outlives a
    restart, and still holds the failed attempt's verdicts)."""
    return dist.PrefixStore(f"distzo/attempt-{env.restart_count}/checks", store)


def rendezvous_store(env: LaunchEnv, timeout: timedelta) -> dist.Store:
    """The launcher's store (torchrun's agent hosts it), as ``env://`` reaches it."""
    store, _, _ = next(dist.rendezvous("env://", env.rank, env.world_size, timeout=timeout))
    store.set_timeout(timeout)
    return store


def refusal_line(err: BaseException) -> str:
    """What a rank's failed check says to its peers: a refusal's own line, or the type and
    first line of an unexpected failure."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return text if isinstance(err, ValueError) else f"{type(err).__name__}: {text}".rstrip(": ")


def report_refusal(env: LaunchEnv, err: BaseException) -> None:
    """Tell every other rank that this one failed its checks, so that none waits for it
    in the process group; best effort and bounded (``REPORT_S``): with no store to reach,
    the peers time out as they would have."""
    if not env.launched or env.world_size == 1:
        return
    line = f"rank {env.rank} on node {env.node_rank} refused its input: {refusal_line(err)}"
    try:
        store = gate_store(rendezvous_store(env, timedelta(seconds=REPORT_S)), env)
        store.compare_set(REFUSAL, "", line)  # the first refusal stands
        deadline = time.monotonic() + REPORT_S
        while int(store.add(TOLD, 0)) < int(store.add(PASSED, 0)) or int(store.add(ASKING, 0)) > 0:
            if time.monotonic() > deadline:
                return
            time.sleep(POLL_S)

    except (RuntimeError, ValueError, TimeoutError):  # no store (DistError is a RuntimeError)
        return


def await_every_rank(store: dist.Store, env: LaunchEnv, timeout_s: float) -> None:
    """Having passed its own checks, wait until every rank has passed theirs: raise the
    first refusal as a ``ValueError`` as soon as one is written, and a ``DistError`` naming
    the count still missing after ``timeout_s`` (a rank that died or hung checking)."""
    store = gate_store(store, env)
    store.add(PASSED, 1)
    deadline = time.monotonic() + timeout_s
    while True:
        if store.check([REFUSAL]):
            line = store.get(REFUSAL).decode()
            store.add(TOLD, 1)
            raise ValueError(f"{line}; fix it on that node and launch again")
        passed = int(store.add(PASSED, 0))
        if passed >= env.world_size:
            return
        if time.monotonic() > deadline:
            raise dist.DistError(
                f"{env.world_size - passed} of {env.world_size} ranks did not finish checking "
                f"their input within --dist-timeout {timeout_s:g}s"
            )
        time.sleep(POLL_S)


def rank_0_answers(
    env: LaunchEnv, question: str, answer: Callable[[], str], timeout_s: float
) -> str:
    """``answer()`` asked on rank 0 alone and told to every other rank through the
    launcher's store, before the process group forms: a question to a shared service (the
    hub, whose rate limit answered a launch of 64 ranks asking at once with HTTP 429) is
    asked once a launch, not once a rank. Where rank 0 fails (its ``report_refusal``) a
    waiting rank raises its line at once; where it never answers, after ``timeout_s``."""
    asker = None if env.rank == 0 else "rank 0"
    limit = f"--dist-timeout {timeout_s:g}s"
    return _answered(env, question, answer, (timedelta(seconds=timeout_s), limit), asker)


def node_first_answers(
    env: LaunchEnv, question: str, answer: Callable[[], str], timeout: timedelta
) -> str:
    """``answer()`` asked on each node's first local rank and told to that node's other
    ranks, as ``rank_0_answers`` does (work a node's ranks share: its cache filled once):
    its failure is every waiting rank's line; ``timeout``: the wait's limit (a download's)."""
    asker = None if env.local_rank == 0 else f"node {env.node_rank}'s first rank"
    limit = f"{timeout.total_seconds():g}s (a node's download)"
    question = f"{question}, on node {env.node_rank}"
    return _answered(env, question, answer, (timeout, limit), asker)


def _answered(
    env: LaunchEnv,
    question: str,
    answer: Callable[[], str],
    timeout: tuple[timedelta, str],
    asker: str | None,
) -> str:
    """``answer()`` where ``asker`` is None (this rank asks), else ``asker``'s answer read
    from the launcher's store; ``timeout``: the wait's limit, and how a timeout names it."""
    if not env.launched or env.world_size == 1:
        return answer()
    store = gate_store(rendezvous_store(env, timeout[0]), env)
    if asker is None:
        told = answer()
        store.set(ANSWER + question, told)
        return told
    store.add(ASKING, 1)  # a refusing rank 0 waits until this rank has read its line
    try:
        return _await_answer(store, question, timeout, asker)
    finally:
        try:
            store.add(ASKING, -1)
        except RuntimeError:  # the store went with rank 0's node: nobody waits any more
            pass


def _await_answer(
    store: dist.Store, question: str, timeout: tuple[timedelta, str], asker: str
) -> str:
    """``asker``'s answer to ``question`` once it is in ``store``; a refusal, or an asker
    silent for ``timeout``, raised."""
    deadline = time.monotonic() + timeout[0].total_seconds()
    while True:
        try:
            if store.check([ANSWER + question]):
                return store.get(ANSWER + question).decode()
            refusal = store.get(REFUSAL).decode() if store.check([REFUSAL]) else None
        except RuntimeError as err:  # the launcher's store went with rank 0's node
            raise ValueError(
                f"the launcher's store went away before {asker} answered ({question}): "
                f"{refusal_line(err)}; rank 0's node says why"
            ) from None
        if refusal is not None:
            raise ValueError(f"{refusal}; fix it on that node and launch again")
        if time.monotonic() > deadline:
            raise dist.DistError(f"{asker} did not answer ({question}) within {timeout[1]}")
        time.sleep(POLL_S)
