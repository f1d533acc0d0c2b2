"""FZOO and LOZO on the adapters, crossed with the streamed layout's options. Each of these
is tested beside SPSA or beside LoRA alone; a prefix had never trained under FZOO or LOZO,
nor an adapter over an fp8 base with their batched passes and micro-batches. One cheap
run per pairing keeps the whole cross covered: the options change how a step's passes
are run, never its losses, g or weights."""

import pytest
import torch

from distzo.adapters.peft_adapters import AdapterSpec, attach_adapter
from tests.helpers.engines import engine_for, train
from tests.helpers.models import base_model

ESTIMATORS = {
    "fzoo": dict(estimator="fzoo", num_queries=3, noise="rademacher", batch_queries=True),
    # LOZO's V kept for 2 of the 3 steps; both batchings of SPSA's passes
    "lozo": dict(
        estimator="lozo",
        noise="lowrank",
        lozo_interval=2,
        num_queries=2,
        batch_queries=True,
        dual_forward=True,
    ),
}


def run(method, estimator, **options):
    """Three steps' losses and g, then the trained weights."""
    spec = AdapterSpec(method, r=4, alpha=8, prefix_length=2)
    model = attach_adapter(base_model("llama", dtype=torch.float64), spec, seed=5)
    flags = dict(ESTIMATORS[estimator])
    if not options.pop("batched", False):  # each pass a forward of its own
        flags.update(batch_queries=False, dual_forward=False)
    engine = engine_for(model, **flags, **options)
    results = train(engine, model.config.vocab_size, steps=3)
    return [(r.losses, r.projected_grads) for r in results], engine.named_parameters()


def assert_same_run(a, b):
    (steps_a, weights_a), (steps_b, weights_b) = a, b
    for (losses_a, g_a), (losses_b, g_b) in zip(steps_a, steps_b, strict=True):
        assert losses_a == pytest.approx(losses_b, rel=1e-12)
        assert g_a == pytest.approx(g_b, rel=1e-8, abs=1e-8)
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        assert torch.allclose(weights_a[name], weights_b[name], rtol=1e-10, atol=1e-12), name


@pytest.mark.parametrize("method", ["lora-fa", "prefix"])
@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_an_adapters_passes_batched_split_and_streamed_follow_the_resident_run(method, estimator):
    resident = run(method, estimator, mode="resident")
    streamed = run(method, estimator, mode="offload", num_slots=1, grad_accum=2, batched=True)
    assert_same_run(streamed, resident)
    assert len({losses[-1] for losses, _ in resident[0]}) == 3  # the steps moved the adapter
    # over an fp8 base (rounded once to nearest), sequential and batched alike
    low_bit = run(method, estimator, mode="offload", transfer_dtype="fp8")
    assert low_bit[0][0][0] != resident[0][0][0]
    assert_same_run(
        run(method, estimator, mode="offload", transfer_dtype="fp8", grad_accum=2, batched=True),
        low_bit,
    )
