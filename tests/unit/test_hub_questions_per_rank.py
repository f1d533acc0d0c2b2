"""A hub ``--model``'s config is read by rank 0 alone and told to the other ranks through
the launcher's store, before the process group forms: each rank asking the hub itself made
7 requests, 448 as 64 ranks launched, and the hub's rate limit (HTTP 429) refused them.
Rank 0's failure is every rank's line at once; a rank 0 that never answers, a timeout."""

import threading
import time

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


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> dist.Store:
    """The launcher's store every rank reaches."""
    shared = dist.HashStore()
    monkeypatch.setattr(launch_gate, "rendezvous_store", lambda env, timeout: shared)
    return shared


def test_rank_0_alone_asks_the_hub_for_the_models_config(store, monkeypatch, tmp_path):
    from huggingface_hub import constants

    job = resolve(["--model", "tiny/llama"])
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
    job = resolve(["--model", "tiny/none"])
    failed: list[BaseException] = []

    def rank_1() -> None:
        try:
            model_config_of(job, place(1))
        except BaseException as err:  # noqa: BLE001 - the test reads it
            failed.append(err)

    waiting = threading.Thread(target=rank_1)
    waiting.start()
    gate = launch_gate.gate_store(store, place(0))
    while int(gate.add(launch_gate.ASKING, 0)) == 0 and waiting.is_alive():
        time.sleep(0.01)  # rank 1 waits for rank 0's answer
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


def test_a_plain_run_asks_itself():
    assert rank_0_answers(LaunchEnv(), "q", lambda: "mine", timeout_s=0.2) == "mine"


def test_a_config_told_as_text_is_the_config_read():
    multimodal = Gemma3Config(text_config={"num_hidden_layers": 2}, vision_config={})
    for config in (LlamaConfig(**LLAMA), multimodal):
        told = config_from_text(config_text(config))
        assert type(told) is type(config) and told.to_dict() == config.to_dict()
