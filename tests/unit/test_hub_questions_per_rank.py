"""A hub ``--model``'s config is read by rank 0 alone and told to the other ranks through
the launcher's store, before the process group forms: each rank asking the hub itself made
7 requests, 448 as 64 ranks launched, and the hub's rate limit (HTTP 429) refused them.
Rank 0's failure is every rank's line at once; a rank 0 that never answers, a timeout."""

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch.distributed as dist
from transformers import Gemma3Config, LlamaConfig

from distzo.config.job import resolve
from distzo.dist import LaunchEnv, launch_gate
from distzo.dist.launch_gate import rank_0_answers, report_refusal
from distzo.job.validation import model_config_of
from distzo.models.config_file import config_from_text, config_text
from tests.helpers.models import LLAMA
from tests.helpers.stand_in_hub import stand_in_hub


def place(rank: int) -> LaunchEnv:
    """Rank ``rank`` of two, each on a node of its own."""
    return LaunchEnv(rank=rank, world_size=2, node_rank=rank, launched=True)


def until(condition: Callable[[], bool], within_s: float = 2.0) -> bool:
    """Whether ``condition`` came true within ``within_s``: a waiting test fails, not hangs."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def asking(
    rank: int, question: str, told: list[object], timeout_s: float = 2.0
) -> threading.Thread:
    """Rank ``rank`` waiting for rank 0's answer to ``question`` in a thread of its own,
    what it was told (or what it raised) appended to ``told``."""

    def wait() -> None:
        try:
            told.append(rank_0_answers(place(rank), question, lambda: "asked", timeout_s))
        except BaseException as err:  # noqa: BLE001 - the test reads it
            told.append(err)

    waiting = threading.Thread(target=wait)
    waiting.start()
    return waiting


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> dist.Store:
    """The launcher's store every rank reaches, its reads bounded by the caller's timeout
    as ``rendezvous_store`` bounds them (a read of a key never written fails, not hangs)."""
    shared = dist.HashStore()

    def reach(env: LaunchEnv, timeout: timedelta) -> dist.Store:
        shared.set_timeout(timeout)
        return shared

    monkeypatch.setattr(launch_gate, "rendezvous_store", reach)
    return shared


def test_rank_0_alone_asks_the_hub_for_the_models_config(store, monkeypatch, tmp_path):
    from huggingface_hub import constants

    job = resolve(["--model", "tiny/llama", "--dist-timeout", "3"])  # a bug fails, not hangs
    with stand_in_hub(monkeypatch, tmp_path / "node0") as requests:
        zero = model_config_of(job, place(0))
        asked = list(requests)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "node1"))
        one = model_config_of(job, place(1))
    assert "GET /api/models/tiny/llama" in asked  # rank 0 asked the hub
    assert requests == asked  # rank 1 did not
    assert type(one) is LlamaConfig and one.to_dict() == zero.to_dict()
    assert one.num_hidden_layers == LLAMA["num_hidden_layers"]


def test_rank_0s_refusal_is_the_waiting_ranks_line(store, monkeypatch, tmp_path):
    job = resolve(["--model", "tiny/none", "--dist-timeout", "3"])  # a bug fails, not hangs
    failed: list[BaseException] = []

    def rank_1() -> None:
        try:
            model_config_of(job, place(1))
        except BaseException as err:  # noqa: BLE001 - the test reads it
            failed.append(err)

    waiting = threading.Thread(target=rank_1)
    waiting.start()
    gate = launch_gate.gate_store(store, place(0))
    assert until(lambda: int(gate.add(launch_gate.ASKING, 0)) == 1)  # rank 1 waits
    with stand_in_hub(monkeypatch, tmp_path / "hub"), pytest.raises(ValueError) as raised:
        model_config_of(job, place(0))
    report_refusal(place(0), raised.value)  # as the trainer does, before its node's exit
    # rank 0 stayed until rank 1 had read its line: the store leaves with rank 0's node
    assert int(gate.add(launch_gate.ASKING, 0)) == 0
    waiting.join(5)
    assert not waiting.is_alive()
    assert isinstance(failed[0], ValueError)
    assert str(failed[0]) == (
        f"rank 0 on node 0 refused its input: {raised.value}; fix it on that node and launch again"
    )
    assert str(raised.value).startswith("cannot load --model 'tiny/none': ")


def test_a_rank_0_that_never_answers_is_a_timeout(store):
    with pytest.raises(dist.DistError, match=r"^rank 0 did not answer \(q\) within --dist-timeout"):
        rank_0_answers(place(1), "q", lambda: pytest.fail("rank 1 asked"), timeout_s=0.2)


def test_each_question_waits_for_its_own_answer(store):
    # rank 0 answered one question: a rank asking another is not told that answer
    assert rank_0_answers(place(0), "--model a's config", lambda: "config a", 5) == "config a"
    told: list[object] = []
    asking(1, "--model a's config", told).join(5)
    assert told == ["config a"]
    with pytest.raises(dist.DistError, match=r"^rank 0 did not answer \(--model b's config\)"):
        rank_0_answers(place(1), "--model b's config", lambda: "rank 1 asked", timeout_s=0.3)


def test_a_waiting_rank_is_counted_until_it_is_told(store):
    # a refusing rank 0 stays while the count is above 0: the store leaves with its node
    told: list[object] = []
    waiting = asking(1, "q", told)
    gate = launch_gate.gate_store(store, place(0))
    assert until(lambda: int(gate.add(launch_gate.ASKING, 0)) == 1)
    assert rank_0_answers(place(0), "q", lambda: "answer", 5) == "answer"
    waiting.join(5)
    assert told == ["answer"] and int(gate.add(launch_gate.ASKING, 0)) == 0


def test_a_plain_run_asks_itself():
    assert rank_0_answers(LaunchEnv(), "q", lambda: "mine", timeout_s=0.2) == "mine"


def test_a_config_told_as_text_is_the_config_read():
    multimodal = Gemma3Config(text_config={"num_hidden_layers": 2}, vision_config={})
    for config in (LlamaConfig(**LLAMA), multimodal):
        told = config_from_text(config_text(config))
        assert type(told) is type(config) and told.to_dict() == config.to_dict()
