"""LOZO-M (``optimizer_state="lowrank"``): the momentum kept in the low-rank factors, held
to a dense implementation of its formulas, on every layout, across a resume, and its
refusals."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from distzo import ZOConfig, ZOEngine
from distzo.zo import fast_noise
from tests.helpers.engines import buckets_of, train
from tests.helpers.models import FLOAT64_TINY, random_batch, tiny_opt
from tests.unit.test_engine import assert_same_trajectory, run

LOZO_M = dict(noise="lowrank", estimator="lozo", optimizer="momentum", optimizer_state="lowrank")


def lozo_m_engine(**overrides):
    options = dict(lr=1e-2, eps=1e-3, seed=5, device="cpu", weight_decay=0.1, beta1=0.8)
    options.update(LOZO_M, lozo_interval=2, **overrides)
    model = tiny_opt(seed=0, **FLOAT64_TINY)
    model.initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    return ZOEngine(model, ZOConfig(**options)), model


def dense_lozo_m(engine, initial, results, beta1, wd, interval):
    """LOZO-M written densely: per matrix M = N V^T, so a kept V gives
    M <- beta1 M + (1 - beta1) g Z and a redrawn one M <- beta1 M V V^T / n + (1 - beta1) g Z
    (N V_old^T V_new / n, times V_new^T); step 0 takes M = g Z. A 1-D entry's M is dense
    with its Gaussian z. W <- W (1 - lr wd on matrices) - lr M."""
    theta = {
        e.names[0]: initial[e.names[0]].clone().double()
        for layout, _ in buckets_of(engine)
        for e in layout.entries
    }
    moment = {name: torch.zeros_like(w) for name, w in theta.items()}
    for t, r in enumerate(results):
        (g,) = r.projected_grads
        for layout, block in buckets_of(engine):
            z = engine.noise.full(layout.numel, step=t, block_id=block)
            for e in layout.entries:
                name = e.names[0]
                zt = z[e.offset : e.offset + e.numel].view(e.shape[0], -1)
                m = moment[name].view(e.shape[0], -1)
                if t == 0:
                    m.copy_(g * zt)
                    continue
                if len(e.shape) >= 2 and t % interval == 0:
                    v = engine.noise.factors(t, block, e.offset)[1]
                    m.copy_(m @ v @ v.T / v.shape[0])
                m.copy_(beta1 * m + (1 - beta1) * g * zt)
            for e in layout.entries:
                name = e.names[0]
                if wd and e.offset < layout.decay_end:
                    theta[name] = theta[name] * (1 - r.lr * wd)
                theta[name] = theta[name] - r.lr * moment[name]
    return theta


def test_the_factored_momentum_equals_its_dense_formulas_across_two_redraws():
    """fp64, V redrawn at steps 2 and 4 of 6: every trained tensor, the embedding tables,
    the blocks' matrices and their biases and norm scales, lands where the dense
    formulas put it."""
    engine, model = lozo_m_engine()
    initial = model.initial
    results = train(engine, model.config.vocab_size, steps=6)
    expected = dense_lozo_m(engine, initial, results, 0.8, 0.1, 2)
    got = engine.named_parameters()
    assert set(expected) <= set(got) and len(expected) > 10  # lm_head is tied to embed_tokens
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-12, atol=1e-14)
        assert not torch.equal(got[name], initial[name]), name
    # and it is not LOZO's plain update, nor a dense stored momentum
    for state in ("stored", None):
        options = (
            dict(optimizer_state=state) if state else dict(optimizer="sgd", optimizer_state="auto")
        )
        other, other_model = lozo_m_engine(**options)
        train(other, other_model.config.vocab_size, steps=6)
        table = "model.decoder.embed_tokens.weight"
        assert not torch.equal(other.named_parameters()[table], got[table])


def test_the_state_is_a_factor_per_matrix_and_a_moment_per_vector():
    """An m x n matrix keeps m x r numbers, a 1-D tensor its own length; the update's
    scratch holds U and N for the most rows, V and V_old for the most columns."""
    engine, _ = lozo_m_engine(lozo_rank=3)
    lozo_m = engine.update_rule.lowrank_momentum
    for (layout, _), state in zip(buckets_of(engine), lozo_m.states, strict=True):
        expected = sum(e.shape[0] * 3 if len(e.shape) >= 2 else e.numel for e in layout.entries)
        assert state.numel() == expected < layout.numel
    matrices = [
        e.shape for layout, _ in buckets_of(engine) for e in layout.entries if len(e.shape) == 2
    ]
    rows, cols = max(m[0] for m in matrices), max(m[1] for m in matrices)
    scratch = (2 * rows * 3 + 2 * cols * 3 + 9) * 8  # float64
    assert engine.state_device_bytes == sum(s.nbytes for s in lozo_m.states) + scratch


def test_offload_equals_resident():
    options = dict(LOZO_M, lozo_interval=2, steps=5)
    resident = run("resident", **options)
    assert_same_trajectory(run("offload", **options), resident)
    assert_same_trajectory(run("offload", flush_at=(1, 2), noise_chunk=333, **options), resident)


def test_a_state_dict_resumes_mid_window_onto_the_uninterrupted_weights():
    """Cut at step 3 (mid-window of 2: V drawn at 2, redrawn at 4), resumed through the
    redraw onto the uninterrupted run's weights bit for bit; a state of another kind refused."""
    batches = [random_batch(64, pad="left", seed=i) for i in range(7)]
    uninterrupted, _ = lozo_m_engine()
    expected = [uninterrupted.step(b).projected_grads for b in batches]
    first, _ = lozo_m_engine()
    for b in batches[:3]:
        first.step(b)
    saved = first.state_dict()
    assert saved["optimizer"]["state"] == "lowrank" and len(saved["lowrank_momentum"]) == 3
    first.step(batches[3])  # the state is a copy: training on leaves it as it was saved
    resumed, _ = lozo_m_engine()
    resumed.load_state_dict(saved)
    assert [resumed.step(b).projected_grads for b in batches[3:]] == expected[3:]
    ours, theirs = resumed.named_parameters(), uninterrupted.named_parameters()
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    stored, _ = lozo_m_engine(optimizer_state="stored")
    with pytest.raises(ValueError, match="trained with state 'lowrank', the engine has 'stored'"):
        stored.load_state_dict(saved)
    with pytest.raises(ValueError, match="the engine needs them"):
        lozo_m_engine()[0].load_state_dict({**saved, "lowrank_momentum": None})


def test_saved_factors_of_other_buckets_are_refused_before_any_is_copied():
    """A bucket too few, one too many or one of another size: one line naming both
    lists of sizes, and the state as it was (zip would silently drop the extra bucket)."""
    from distzo.zo.lowrank import LowRankNoise
    from distzo.zo.lowrank_momentum import LowRankMomentum
    from tests.unit.test_lowrank import LAYOUT

    noise = LowRankNoise(3, 1 << 10, torch.device("cpu"), torch.float64, [LAYOUT] * 2, 2, 5)
    lozo_m = LowRankMomentum(noise, 0.9)
    sizes = [state.numel() for state in lozo_m.states]
    good = [torch.full((n,), 1.0, dtype=torch.float64) for n in sizes]
    for bad in (good[:1], [*good, good[0]], [good[0], good[1][:-1]]):
        with pytest.raises(ValueError, match=rf"this model's are \[{sizes[0]}, {sizes[1]}\]") as e:
            lozo_m.load(bad)
        assert "\n" not in str(e.value) and "same lozo rank" in str(e.value)
        assert not any(state.any() for state in lozo_m.states)
    lozo_m.load(good)
    assert all(torch.equal(state, saved) for state, saved in zip(lozo_m.states, good))


def test_an_update_of_a_piece_of_a_bucket_is_refused_not_applied_as_the_whole():
    """The factors index a whole bucket's matrices from its start: a piece (a master
    rebuilt a range at a time) or another noise would move the wrong elements."""
    from distzo.engine.updates import PendingUpdate
    from distzo.zo import NoiseSource

    engine, _ = lozo_m_engine()
    (layout, block), update = buckets_of(engine)[1], PendingUpdate(0, (0.5,), 1e-2)
    bucket = torch.zeros(layout.numel, dtype=torch.float64)
    gaussian = NoiseSource(5, 1 << 10, torch.device("cpu"), torch.float64)
    for noise, piece, start in (
        (engine.noise, bucket[8:], 8),
        (engine.noise, bucket[:-8], 0),
        (gaussian, bucket, 0),
    ):
        with pytest.raises(ValueError, match="^LOZO-M updates whole buckets with low-rank noise$"):
            engine.update_rule.apply(noise, update, piece, layout, block, [], start)
    assert not bucket.any() and not any(s.any() for s in engine.update_rule.lowrank_momentum.states)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(optimizer="adam"), "optimizer_state lowrank is LOZO-M, a momentum kept in the"),
        (dict(optimizer="sgd"), "use optimizer momentum, or optimizer_state stored for sgd"),
        (
            dict(noise="gaussian", estimator="spsa"),
            "keeps the momentum in the factors of low-rank z, the run draws noise gaussian: "
            "use estimator lozo",
        ),
        (dict(num_queries=2), "takes one low-rank estimate a step, got num_queries 2"),
        (
            dict(mode="offload", transfer_dtype="bf16", low_bit_master="recompute"),
            "stored or lowrank",
        ),
        (dict(mode="offload", state_dtype="bf16"), "lowrank's factors stay on the device"),
    ],
)
def test_what_it_cannot_honour_is_refused_in_one_line(options, message):
    config = dict(LOZO_M, device="cpu")
    config.update(options)
    with pytest.raises(ValueError, match=message) as refused:
        ZOConfig(**config)
    assert "\n" not in str(refused.value)


def test_a_replay_rebuilds_the_lowrank_state_kind():
    from tests.helpers.engines import replayed_config

    again = replayed_config(ZOConfig(**LOZO_M))
    assert (again.optimizer, again.optimizer_state) == ("momentum", "lowrank")


def test_a_checkpoint_resumes_mid_window_onto_the_uninterrupted_weights(tmp_path):
    """The job's checkpoint holds the factors (``lozo_momentum/<id>``): saved at step 3,
    resumed across the redraw at step 4 onto the uninterrupted weights; a run of another
    state kind refuses it in one line."""
    from distzo.job.checkpoint import Checkpointer, latest_checkpoint

    batches = [random_batch(64, pad="left", seed=i) for i in range(6)]
    uninterrupted, _ = lozo_m_engine()
    expected = [uninterrupted.step(b).projected_grads for b in batches]
    first, _ = lozo_m_engine()
    for b in batches[:3]:
        first.step(b)
    Checkpointer(tmp_path, first).save()
    path = latest_checkpoint(tmp_path)
    resumed, _ = lozo_m_engine(mode="offload")
    assert Checkpointer(tmp_path, resumed).load(path) == 3
    assert [resumed.step(b).projected_grads for b in batches[3:]] == expected[3:]
    ours, theirs = resumed.named_parameters(), uninterrupted.named_parameters()
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    for state, says in (
        ("stored", "has --optimizer momentum --optimizer-state stored;"),
        ("recomputed", "has --optimizer momentum;"),
    ):
        other, _ = lozo_m_engine(optimizer_state=state)
        with pytest.raises(ValueError, match="--optimizer-state lowrank, this run has") as refused:
            Checkpointer(tmp_path, other).load(path)
        assert says in str(refused.value) and "\n" not in str(refused.value)


def test_the_plan_counts_the_factors_the_engine_allocates_and_a_save_copies(tmp_path):
    from distzo.job.checkpoint import Checkpointer
    from distzo.job.memory_plan import plan_memory

    for mode in ("resident", "offload"):
        config = ZOConfig(device="cpu", num_slots=2, mode=mode, lozo_rank=3, **LOZO_M)
        lozo = ZOConfig(device="cpu", num_slots=2, mode=mode, lozo_rank=3, noise="lowrank")
        model = tiny_opt(seed=0, num_hidden_layers=2)
        plan = plan_memory(model, config, 1, False, 2, 8)
        engine = ZOEngine(tiny_opt(seed=0, num_hidden_layers=2), config)
        assert plan.state_device_bytes == engine.state_device_bytes > 0
        assert plan.state_host_bytes == engine.state_host_bytes == 0
        assert "optimizer state" in plan.describe()
        # an asynchronous save copies the factors (rank 0's), a synchronous one on the CPU
        # writes them as they are
        saved = Checkpointer(tmp_path, engine)._state(private=True)
        factors = sum(v.nbytes for k, v in saved.items() if k.startswith("lozo_momentum/"))
        for async_save, copied in ((True, factors), (False, 0)):
            ours, theirs = (
                plan_memory(model, c, 1, False, 2, 8, async_save=async_save).checkpoint_bytes
                for c in (config, lozo)
            )
            assert ours - theirs == copied
        lozo_m = engine.update_rule.lowrank_momentum
        assert factors == engine.state_device_bytes - lozo_m.scratch.device_bytes > 0


def test_the_plan_cuts_each_bucket_into_segments_once(monkeypatch):
    """The plan of a LOZO-M run cut every bucket four times (the noise's buffers, the
    update's scratch, the factors on the device, the factors a save copies)."""
    import distzo.job.memory_plan as memory_plan
    import distzo.zo.lowrank as lowrank
    from distzo.job.memory_plan import plan_memory

    cut, segments = [], lowrank.segments

    def counted(layout, rank):
        cut.append(layout)
        return segments(layout, rank)

    monkeypatch.setattr(memory_plan, "segments", counted)
    monkeypatch.setattr(lowrank, "segments", counted)
    config = ZOConfig(device="cpu", num_slots=2, mode="offload", lozo_rank=3, **LOZO_M)
    plan_memory(tiny_opt(seed=0, num_hidden_layers=2), config, 1, False, 2, 8)
    assert len(cut) == len({id(layout) for layout in cut}) == 3  # the resident bucket, 2 blocks


def test_the_jobs_memory_fallbacks_never_try_to_recompute_the_master():
    """A low-bit run that does not fit tries ``low_bit_master recompute``, which would
    advance the factors once per pass: LOZO-M's fallbacks leave it out (they were a
    refusal of the job's own choice before)."""
    from tests.unit.test_rebuilt_master import fallbacks_of

    flags = ["--transfer-dtype", "bf16", "--estimator", "lozo", "--optimizer", "momentum"]
    tried = fallbacks_of(*flags, "--optimizer-state", "lowrank", "--perturb-scope", "block")
    assert tried == [(3, "buffer", "block", []), (2, "buffer", "block", [tried[1][3][0]])]


class Allocations(TorchDispatchMode):
    """The ops that return a tensor in storage none of their inputs hold (allocations),
    except inside the noise source's draws (its torch fallback, without the C kernel, has
    temporaries of its own: the noise's business, not the update's)."""

    def __init__(self, noise):
        super().__init__()
        self.made, self.drawing = [], False
        fill = noise._fill

        def drawn(*args, **kwargs):
            self.drawing = True
            try:
                return fill(*args, **kwargs)
            finally:
                self.drawing = False

        noise._fill = drawn

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}  # fmt: skip
        if not self.drawing:
            self.made += [
                str(func)
                for t in tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given
            ]
        return out


@pytest.mark.parametrize("kernel", [True, False], ids=["c-kernel", "torch-draws"])
def test_a_step_allocates_nothing_not_even_at_a_redraw(monkeypatch, kernel):
    """U, V and V_old are drawn into scratch made with the state, the projection of N
    runs there: six steps of interval 2 (redraws at 2 and 4), every bucket's update, no
    tensor allocated (each update drew its factors into new tensors before)."""
    if kernel and not fast_noise.available():
        pytest.skip("the compiled noise kernel is not built")
    monkeypatch.setattr("distzo.zo.fast_noise.available", lambda: kernel)
    engine, model = lozo_m_engine()
    rule = engine.update_rule.lowrank_momentum
    apply, allocations = rule.apply, Allocations(engine.noise)

    def watched(*args, **kwargs):
        with allocations:
            apply(*args, **kwargs)

    rule.apply = watched
    train(engine, model.config.vocab_size, steps=6)
    engine.flush()
    assert allocations.made == []
    # the probe sees an allocation where there is one
    with allocations:
        engine.noise.column_factor(2, 1, engine.block_layouts[0].entries[0].offset)
    assert allocations.made == ["aten.clone.default"]


@pytest.mark.parametrize("method", ["lora", "lora-fa"])
def test_an_adapters_matrices_follow_the_dense_formulas(method):
    """LoRA's A and B (LoRA-FA's B alone) keep their factors like any matrix: fp64, two
    redraws, the dense formulas; the frozen base untouched; P-RGE's batched passes the
    same steps bit for bit."""
    from tests.helpers.models import adapted

    def adapter_run(**overrides):
        model = adapted("llama", method, dtype=torch.float64)
        initial = {n.removeprefix("base_model.model."): p.detach().clone()
                   for n, p in model.named_parameters()}  # fmt: skip
        options = dict(lr=1e-1, eps=1e-3, seed=5, device="cpu", weight_decay=0.1, beta1=0.8)
        engine = ZOEngine(model, ZOConfig(**options, **LOZO_M, lozo_interval=2, **overrides))
        return engine, initial, train(engine, model.config.vocab_size, steps=6)

    engine, initial, results = adapter_run()
    expected = dense_lozo_m(engine, initial, results, 0.8, 0.1, 2)
    got = engine.named_parameters()
    trained = {"lora_B"} if method == "lora-fa" else {"lora_A", "lora_B"}
    assert {name.split(".")[-3] for name in expected} == trained
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-12, atol=1e-14)
        assert not torch.equal(got[name], initial[name]), name
    batched, _, batched_results = adapter_run(dual_forward=True)
    assert [r.projected_grads for r in batched_results] == [r.projected_grads for r in results]
    assert all(torch.equal(batched.named_parameters()[n], got[n]) for n in expected)


def test_module_scope_and_a_bf16_link_take_the_documented_steps():
    """``perturb_scope module`` is the block scope's trajectory bit for bit; a bf16 link's
    buffer master is its double master's and module scope's bit for bit, and lands near
    the fp32 run, its weights rounded to bf16 at rest: 0.22 of the distance the fp32 run
    moved (an update applied twice per step, the factors advanced twice, lands 1.42)."""

    def lozo_m_run(mode, **overrides):
        return run(mode, steps=5, lr=1e-2, **LOZO_M, lozo_interval=2, **overrides)

    resident = lozo_m_run("resident")
    assert_same_trajectory(lozo_m_run("resident", perturb_scope="module"), resident)
    assert_same_trajectory(lozo_m_run("offload", perturb_scope="module"), resident)
    bf16 = lozo_m_run("offload", transfer_dtype="bf16")
    assert_same_trajectory(
        lozo_m_run("offload", transfer_dtype="bf16", low_bit_master="double"), bf16
    )
    assert_same_trajectory(
        lozo_m_run("offload", transfer_dtype="bf16", perturb_scope="module"), bf16
    )
    initial = tiny_opt(seed=0, num_hidden_layers=3, word_embed_proj_dim=16).state_dict()
    fp32, rounded = resident[1], bf16[1]
    drift = sum((rounded[k] - fp32[k]).double().norm() ** 2 for k in fp32) ** 0.5
    moved = sum((fp32[k] - initial[k]).double().norm() ** 2 for k in fp32) ** 0.5
    assert drift < 0.5 * moved
