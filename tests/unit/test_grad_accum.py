"""Gradient accumulation: a step's batch as N micro-batches sharing its z gives the whole
batch's g and trajectory, moves each block once per step, and plans less activation memory.
(Under DDP and 2D the layouts test, ``test_objective_layouts.py``, runs with --grad-accum 2.)"""

import pytest
import torch

from distzo import ZOConfig
from distzo.adapters.peft_adapters import AdapterSpec, attach_adapter
from distzo.job.memory_plan import plan_memory
from distzo.runtime.option_names import named_as_flags
from tests.helpers.engines import Counting, engine_for, train
from tests.helpers.models import base_model, random_batch


def trajectory(engine, steps=3):
    results = train(engine, 64, steps=steps)
    return (
        [r.projected_grads for r in results],
        [(r.loss_plus, r.loss_minus) for r in results],
        engine.named_parameters(),
    )


def assert_same_run(a, b, rel):
    (grads_a, losses_a, params_a), (grads_b, losses_b, params_b) = a, b
    for ga, gb in zip(grads_a, grads_b):
        assert ga == pytest.approx(gb, rel=rel)
    for la, lb in zip(losses_a, losses_b):
        assert la == pytest.approx(lb, rel=rel)
    assert all(torch.allclose(params_a[n], params_b[n], rtol=rel, atol=0) for n in params_a)


@pytest.mark.parametrize("family", ["opt", "llama"])
@pytest.mark.parametrize("micro_batches", [2, 3, 4])
def test_micro_batches_give_the_whole_batchs_trajectory(family, micro_batches):
    # fp64, left padding, two queries; 3 micro-batches of 4 rows do not divide evenly (2, 1, 1)
    runs = [
        trajectory(
            engine_for(
                base_model(family, dtype=torch.float64),
                mode="offload",
                num_slots=2,
                num_queries=2,
                grad_accum=n,
            )
        )
        for n in (1, micro_batches)
    ]
    assert_same_run(*runs, rel=1e-9)


@pytest.mark.parametrize(
    "method, flags",
    [("lora-fa", dict(dual_forward=True, batch_queries=True)), ("prefix", dict(dual_forward=True))],
)
def test_micro_batches_of_batched_passes_give_the_whole_batchs_trajectory(method, flags):
    spec = AdapterSpec(method, r=4, alpha=8, prefix_length=2)
    runs = [
        trajectory(
            engine_for(
                attach_adapter(base_model("llama", dtype=torch.float64), spec, seed=5),
                mode="offload",
                num_queries=2,
                grad_accum=n,
                **flags,
            )
        )
        for n in (1, 2)
    ]
    assert_same_run(*runs, rel=1e-9)


@pytest.mark.parametrize("peft", ["none", "lora-fa"])
def test_fzoo_micro_batches_give_the_whole_batchs_trajectory(peft):
    # FZOO's N perturbed passes and its unperturbed one, each over 3 micro-batches (2, 1, 1)
    def model():
        base = base_model("llama", dtype=torch.float64)
        spec = AdapterSpec(peft, r=4, alpha=8)
        return attach_adapter(base, spec, seed=5) if spec.enabled else base

    flags = dict(batch_queries=True) if peft != "none" else {}
    runs = [
        trajectory(
            engine_for(
                model(),
                mode="offload",
                num_slots=2,
                estimator="fzoo",
                num_queries=3,
                noise="rademacher",
                grad_accum=n,
                **flags,
            )
        )
        for n in (1, 3)
    ]
    assert_same_run(*runs, rel=1e-9)


def test_each_block_goes_up_once_per_step_whatever_the_micro_batches():
    engine = engine_for(base_model("opt"), mode="offload", num_slots=2, grad_accum=4)
    counts = Counting(engine.store)
    train(engine, 64, steps=3)
    assert dict(counts.uploads) == {0: 3, 1: 3, 2: 3}
    assert dict(counts.offloads) == {
        0: 2,
        1: 2,
        2: 2,
    }  # steps 2 and 3 write the pending update back


def test_more_micro_batches_than_rows_is_a_one_line_error():
    engine = engine_for(base_model("opt"), grad_accum=5)
    with pytest.raises(  # from Python: the config's field and the rows passed, not flags
        ValueError,
        match="^grad_accum 5 needs at least 5 rows per rank, the batch has 4; lower "
        "grad_accum or raise the rows passed$",
    ):
        engine.step(random_batch(64, seed=0))
    with named_as_flags(), pytest.raises(ValueError, match="lower --grad-accum or raise --batch"):
        engine.step(random_batch(64, seed=0))
    with pytest.raises(ValueError, match="grad_accum must be >= 1"):
        ZOConfig(grad_accum=0)


def test_the_memory_plan_counts_one_micro_batchs_activations():
    model = base_model("llama")
    plans = {
        n: plan_memory(model, ZOConfig(device="cpu", grad_accum=n), 1, False, batch=16, seq=32)
        for n in (1, 4)
    }
    assert plans[4].activations < plans[1].activations
    # buckets, slots and scratch do not change
    assert plans[4].device_bytes == plans[1].device_bytes


def test_a_batch_that_does_not_split_evenly_plans_its_largest_micro_batch():
    # 5 rows in 2 micro-batches run 3 rows, then 2: a block's intermediates are 3 rows',
    # as for 6 rows, whose plan differs only by the sixth row's hidden states (SPSA's 2)
    model = base_model("llama")
    config = ZOConfig(device="cpu", grad_accum=2)
    plans = {rows: plan_memory(model, config, 1, False, batch=rows, seq=64) for rows in (5, 6)}
    row_of_hidden_states = 2 * 64 * model.config.hidden_size * 4
    assert plans[6].activations - plans[5].activations == row_of_hidden_states


def test_a_grad_accum_beyond_a_ranks_batch_is_one_line_before_any_work(tmp_path, capsys):
    from distzo.train import main  # in process: the entry point's own error path

    assert main(["--batch-size", "4", "--grad-accum", "5", "--output-dir", str(tmp_path)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: --grad-accum 5 must be between 1 and the 4 sequences of a rank's batch "
        "(--batch-size / dp); change one of them"
    ]
