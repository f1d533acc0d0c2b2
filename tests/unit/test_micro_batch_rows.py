"""--micro-batch-rows: a training step's micro-batches hold at most N rows of a pass, so one
ReCoRD example of 30-50 candidate rows need not go through a block in one forward
(--grad-accum counts micro-batches and cannot split below one example); the step's losses,
g and update are the whole batch's, since candidate rows never attend to each other."""

import dataclasses

import pytest
import torch

from distzo import ZOConfig, ZOEngine
from distzo.data.encoding import PromptEncoder
from distzo.data.templates import TASKS, build_examples
from distzo.engine.passes import micro_batch_bounds, micro_batch_count
from distzo.job.memory_plan import check_fits, plan_memory
from distzo.models.tiny import byte_tokenizer
from distzo.objectives import Classification, collate_choices
from tests.helpers.models import base_model

TOKENIZER = byte_tokenizer()
NAMES = ["Tom", "Annabel", "Rome", "Paris-by-night", "Bo", "Kimberly", "L", "Maximilian", "N"]


def record_batches(steps=3, per_batch=1):
    """ReCoRD batches of ``per_batch`` examples, 5 to 9 candidates each, one row apiece."""
    rows = [
        {
            "passage": f"Tom met Ann in Rome, day {i}.\n@highlight\nA trip",
            "query": "@placeholder went home.",
            "entities": NAMES[: 5 + (3 * i + 4) % 5],
            "answers": [NAMES[i % 3]],
        }
        for i in range(steps * per_batch)
    ]
    encoder = PromptEncoder(TOKENIZER, max_length=256)
    encoded = [encoder.encode_choices(e) for e in build_examples(TASKS["record"], rows, "x")]
    return [
        collate_choices(encoded[s * per_batch : (s + 1) * per_batch], encoder.pad_id)
        for s in range(steps)
    ]


def engine_of(mode, most_rows, family="opt"):
    model = base_model(family, seed=1, vocab_size=len(TOKENIZER), max_position_embeddings=256)
    config = ZOConfig(
        device="cpu", seed=3, lr=1e-2, eps=1e-3, mode=mode, num_slots=2, micro_batch_rows=most_rows
    )
    return ZOEngine(model, config, objective=Classification())


def trajectory(engine, batches):
    start = {n: p.clone() for n, p in engine.named_parameters().items()}
    results = [engine.step(batch) for batch in batches]
    engine.flush()  # the last step's update, pending until now
    end = engine.named_parameters()
    assert any(not torch.equal(start[n], end[n]) for n in end)
    return [(r.loss_plus, r.loss_minus) for r in results], [r.projected_grads for r in results], end


@pytest.mark.parametrize("mode", ["resident", "offload"])
@pytest.mark.parametrize("family", ["opt", "llama"])
def test_rows_in_micro_batches_give_the_whole_candidate_sets_trajectory(mode, family):
    """float32, exactly: each micro-batch is a slice of the same padded rows, so a row's
    matmuls, attention and head read the same numbers in the same order; only how many
    rows share a kernel call changes, and no kernel here mixes rows."""
    # 9+7, 5+8 and 6+9 candidates, each example padded to the wider one's rows; 4 rows a
    # micro-batch split 18 rows as 4, 4, 4, 3, 3: the second straddles the two examples
    batches = record_batches(per_batch=2)
    assert [b["input_ids"].shape[:2] for b in batches] == [(2, 9), (2, 8), (2, 9)]
    whole, split = (trajectory(engine_of(mode, n, family), batches) for n in (0, 4))
    assert split[0] == whole[0]  # the step losses
    assert split[1] == whole[1]  # g
    assert all(torch.equal(split[2][n], whole[2][n]) for n in whole[2])


def test_no_block_forward_of_a_step_sees_more_than_the_bound(monkeypatch):
    engine = engine_of("offload", 4)
    rows: list[int] = []
    forward = engine.family.block_forward

    def spy(block, hidden, ctx):
        if block is engine.blocks[1]:
            rows.append(hidden.shape[0])
        return forward(block, hidden, ctx)

    monkeypatch.setattr(engine.family, "block_forward", spy)
    (batch,) = record_batches(steps=1)  # one example, 9 candidates: 9 rows
    assert batch["input_ids"].shape[:2] == (1, 9)
    engine.step(batch)
    # SPSA's two passes, each over 3 micro-batches of 3 rows (9 / ceil(9 / 4))
    assert rows == [3, 3, 3, 3, 3, 3]


def test_the_count_bounds_every_micro_batch_and_keeps_grad_accum_as_a_floor():
    for rows in range(1, 60):
        for most in range(1, 12):
            bounds = micro_batch_bounds(rows, micro_batch_count(rows, 1, most))
            assert max(hi - lo for lo, hi in bounds) <= most
            assert len(bounds) == -(-rows // most)  # no more forwards than it takes
    assert micro_batch_count(50, 1, 0) == 1  # 0: no bound
    assert micro_batch_count(4, 3, 10) == 3  # --grad-accum's count stands


def test_a_negative_bound_is_one_line_before_any_work(tmp_path, capsys):
    from distzo.train import main  # in process: the entry point's own error path

    assert main(["--micro-batch-rows", "-1", "--output-dir", str(tmp_path / "run")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: --micro-batch-rows must be >= 0, got -1; 0 leaves a micro-batch's rows unbounded"
    ]
    assert not (tmp_path / "run").exists()


def test_the_memory_plan_counts_a_bounded_micro_batch():
    """50 candidate rows: a block's intermediates are 4 rows' under the bound, as under
    --grad-accum 13 (its largest micro-batch is 4 rows too), and whole without it."""
    model = base_model("llama")

    def plan(**options):
        config = ZOConfig(device="cpu", **options)
        return plan_memory(model, config, 1, False, batch=50, seq=64, eval_rows=2)

    whole, bounded = plan(), plan(micro_batch_rows=4)
    assert bounded.activations < whole.activations
    assert bounded.activations == plan(grad_accum=13).activations
    assert plan(micro_batch_rows=50).activations == whole.activations
    assert bounded.device_bytes == whole.device_bytes  # buckets, slots and scratch alike
    # at most 30 of 50 rows: the engine runs two near-equal micro-batches of 25, as under
    # --grad-accum 2, not the 30 rows the bound would allow
    assert plan(micro_batch_rows=30).activations == plan(grad_accum=2).activations


def test_a_run_that_does_not_fit_is_told_of_the_bound():
    """A ReCoRD run at --batch-size 1 has no batch left to lower: the refusal names the
    flag that bounds its forward."""
    plan = plan_memory(base_model("opt"), ZOConfig(device="cpu"), 1, False, batch=50, seq=64)
    too_large = dataclasses.replace(plan, host_bytes=2**60)
    with pytest.raises(ValueError, match="bound a step's forward with --micro-batch-rows, "):
        check_fits(too_large, torch.device("cpu"), 1, force=False)
