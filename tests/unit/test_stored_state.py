"""Stored optimizer state (MeZO-Adam, a stored ZO momentum): the engine follows a dense
reference, the moments stream with their blocks (offload == resident, sliced == naive),
a bf16 state rounds like a low-bit transfer, the memory plan counts the state, and a
state dict resumes it exactly."""

import math

import pytest
import torch

from distzo import ZOConfig, ZOEngine
from distzo.engine import PendingUpdate
from distzo.job.checkpoint import Checkpointer, latest_checkpoint
from distzo.job.memory_plan import plan_memory
from tests.helpers.engines import engine_for, reference_momentum, replayed_config, train
from tests.helpers.models import adapted, base_model, random_batch


def dense_buckets(engine, values):
    """name -> tensor as one flat fp64 tensor per bucket (resident = 0, block i = i + 1)."""
    layouts = [(0, engine.resident_layout)] + [
        (i + 1, layout) for i, layout in enumerate(engine.block_layouts)
    ]
    return layouts, {
        block: torch.cat([values[e.names[0]].reshape(-1) for e in layout.entries]).double()
        for block, layout in layouts
        if layout.entries
    }


def reference_moments(engine, initial, results, optimizer, beta1, wd, beta2=0.999, eps=1e-8):
    """Dense optimizer over every trained tensor, a plain transcription of the rule:
    ghat = mean_j g_j z_j (z drawn by the engine's own noise); momentum m = beta1 m + ghat,
    theta = theta (1 - lr wd) - lr m; Adam as transformers' AdamW (MeZO-Adam)."""
    layouts, theta = dense_buckets(engine, initial)
    m = {b: torch.zeros_like(x) for b, x in theta.items()}
    v = {b: torch.zeros_like(x) for b, x in theta.items()}
    for t, r in enumerate(results):
        for block, layout in layouts:
            if block not in theta:
                continue
            ghat = torch.zeros_like(theta[block])
            for j, g in enumerate(r.projected_grads):
                z = engine.noise.full(layout.numel, step=t, block_id=block, query=j).double()
                ghat += (
                    g
                    / len(r.projected_grads)
                    * torch.cat([z[e.offset : e.offset + e.numel] for e in layout.entries])
                )
            decay = torch.ones_like(theta[block])
            decay[: sum(e.numel for e in layout.entries if e.offset < layout.decay_end)] = (
                1 - r.lr * wd
            )
            if optimizer == "momentum":
                m[block] = beta1 * m[block] + ghat
                theta[block] = theta[block] * decay - r.lr * m[block]
                continue
            m[block] = beta1 * m[block] + (1 - beta1) * ghat
            v[block] = beta2 * v[block] + (1 - beta2) * ghat**2
            size = r.lr * math.sqrt(1 - beta2 ** (t + 1)) / (1 - beta1 ** (t + 1))
            theta[block] = (theta[block] - size * m[block] / (v[block].sqrt() + eps)) * decay
    out = {}
    for block, layout in layouts:
        offset = 0
        for e in layout.entries:
            out[e.names[0]] = theta[block][offset : offset + e.numel].view(e.shape)
            offset += e.numel
    return out


def assert_follows(engine, initial, expected):
    values = engine.named_parameters()
    moved = max((values[n] - initial[n]).abs().max().item() for n in expected)
    assert moved > 1e-4
    for name, value in expected.items():
        assert torch.allclose(
            values[name], value.to(values[name].dtype), rtol=1e-6, atol=1e-9 * moved
        ), name


@pytest.mark.parametrize(
    "family, optimizer, estimator",
    [
        ("opt", "adam", "spsa"),
        ("llama", "adam", "spsa"),
        ("opt", "momentum", "spsa"),
        ("llama", "momentum", "spsa"),
        ("llama", "adam", "fzoo"),
    ],
)
def test_stored_state_follows_a_dense_reference(family, optimizer, estimator):
    engine = engine_for(
        base_model(family, dtype=torch.float64),
        optimizer=optimizer,
        optimizer_state="stored",
        beta1=0.9,
        num_queries=2,
        estimator=estimator,
        lr=1e-3,
        weight_decay=0.1,
        mode="offload",
        num_slots=2,
    )
    initial = engine.named_parameters()
    results = train(engine, 64, steps=30)
    assert_follows(
        engine, initial, reference_moments(engine, initial, results, optimizer, 0.9, 0.1)
    )


def test_stored_and_recomputed_momentum_apply_one_update_within_the_window():
    """The same 30 estimates (step, g, lr) applied by both forms: equal (to rounding) while the
    window holds every step; a window of 4 drops what the stored momentum keeps."""
    source = engine_for(
        base_model("llama", dtype=torch.float64), optimizer="momentum", lr=1e-3, momentum_window=30
    )
    initial = source.named_parameters()
    results = train(source, 64, steps=30)
    expected = reference_momentum(source, initial, results, 0.9, 30, 0.1)
    for state, window in (("stored", 30), ("recomputed", 30), ("recomputed", 4)):
        engine = engine_for(
            base_model("llama", dtype=torch.float64),
            optimizer="momentum",
            optimizer_state=state,
            momentum_window=window,
            lr=1e-3,
        )
        for r in results:  # as a replay applies a seed log
            engine.pending = engine.momentum_update(PendingUpdate(r.step, r.projected_grads, r.lr))
            engine.flush()
        values = engine.named_parameters()
        close = all(torch.allclose(values[n], expected[n], rtol=1e-9, atol=1e-15) for n in expected)
        assert close == (window == 30), (state, window)


@pytest.mark.parametrize("method", ["lora-fa", "prefix"])
def test_adapter_moments_live_on_the_device_and_follow_the_reference(method):
    engine = engine_for(
        adapted("llama", method, dtype=torch.float64), optimizer="adam", lr=1e-3, num_slots=2
    )
    # the adapter's buckets and their moments stay on the device
    assert engine.state_host_bytes == 0
    initial = engine.named_parameters()
    results = train(engine, 64, steps=10)
    assert_follows(engine, initial, reference_moments(engine, initial, results, "adam", 0.9, 0.1))


def test_adam_offload_equals_resident_and_a_state_dict_resumes_it():
    def adam_engine(mode, **extra):
        return engine_for(
            base_model("opt"), mode=mode, num_slots=2, optimizer="adam", lr=1e-3, **extra
        )

    runs = {}
    for mode in ("resident", "offload"):
        engine = adam_engine(mode)
        runs[mode] = (
            [r.projected_grads for r in train(engine, 64, steps=5)],
            engine.named_parameters(),
        )
    assert runs["resident"][0] == runs["offload"][0]
    assert all(
        torch.equal(runs["resident"][1][n], runs["offload"][1][n]) for n in runs["resident"][1]
    )

    first = adam_engine("offload")
    train(first, 64, steps=3)
    state = first.state_dict()
    assert set(state["optimizer_state"]) == {"exp_avg", "exp_avg_sq"}
    assert set(state["optimizer_state"]["exp_avg"]) == set(first.canonical_names)
    assert all(v.abs().max() > 0 for v in state["optimizer_state"]["exp_avg_sq"].values())
    resumed = adam_engine("resident")
    resumed.load_state_dict(state)
    rest = [resumed.step(random_batch(64, pad="left", seed=i)) for i in range(3, 5)]
    assert [r.projected_grads for r in rest] == runs["resident"][0][3:]
    values = resumed.named_parameters()
    assert all(torch.equal(values[n], runs["resident"][1][n]) for n in values)

    sgd = engine_for(base_model("opt"), mode="offload", num_slots=2)
    with pytest.raises(ValueError, match="trained with optimizer 'adam', the engine has 'sgd'"):
        sgd.load_state_dict(state)
    del state["optimizer"]  # a state from before the record: its moments are what tell
    with pytest.raises(
        ValueError,
        match=r"holds optimizer state \['exp_avg', 'exp_avg_sq'\], the engine keeps none",
    ):
        sgd.load_state_dict(state)


@pytest.mark.parametrize(
    "other, message",
    [
        (dict(optimizer="sgd"), "optimizer 'momentum', the engine has 'sgd'"),
        (dict(optimizer="momentum", beta1=0.5), "beta1 0.9, the engine has 0.5"),
    ],
)
def test_a_recomputed_momentum_state_needs_its_own_optimizer(other, message):
    """Recomputed momentum stores no moments: only the record tells its state from SGD's
    (loaded into SGD, the next steps moved by 0.14 without a word)."""
    first = engine_for(base_model("opt"), optimizer="momentum", beta1=0.9, lr=1e-3)
    train(first, 64, steps=3)
    state = first.state_dict()
    with pytest.raises(ValueError, match=message):
        engine_for(base_model("opt"), lr=1e-3, **other).load_state_dict(state)
    engine_for(base_model("opt"), optimizer="momentum", beta1=0.9, lr=1e-3).load_state_dict(state)


@pytest.mark.parametrize(
    "saved, other, message",
    [
        (dict(optimizer="adam"), dict(beta1=0.5), "--beta1 0.9, this run has --beta1 0.5"),
        (dict(optimizer="adam"), dict(adam_eps=1e-3), "--adam-eps 1e-08, this run has"),
        (
            dict(optimizer="momentum"),
            dict(momentum_window=4),
            "--momentum-window 32, this run has --momentum-window 4",
        ),
    ],
)
def test_a_checkpoint_resumes_only_under_the_betas_and_window_it_was_saved_with(
    tmp_path, saved, other, message
):
    """The checkpoint records them, as a state dict does: a run resumed from it with others
    applied its moments (or its history) by another rule without a word."""
    first = engine_for(base_model("opt"), lr=1e-3, **saved)
    train(first, 64, steps=2)
    Checkpointer(tmp_path, first).save()
    path = latest_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=message):
        Checkpointer(tmp_path, engine_for(base_model("opt"), lr=1e-3, **saved, **other)).load(path)
    same = engine_for(base_model("opt"), lr=1e-3, **saved)
    assert Checkpointer(tmp_path, same).load(path) == 2
    # options the optimizer does not use are not compared
    sgd_like = dict(beta2=0.5) if saved["optimizer"] == "momentum" else dict(momentum_window=4)
    Checkpointer(tmp_path, engine_for(base_model("opt"), lr=1e-3, **saved, **sgd_like)).load(path)


def test_moments_travel_only_with_an_update():
    engine = engine_for(base_model("opt"), mode="offload", num_slots=2, optimizer="adam", lr=1e-3)
    moved = {"upload": 0, "offload": 0}

    def counting(name, original):
        def counted(index):
            moved[name] += 1
            original(index)

        return counted

    for store in engine.moments.blocks:
        for name in moved:
            setattr(store, name, counting(name, getattr(store, name)))
    blocks = len(engine.blocks)
    engine.step(random_batch(64, seed=0))  # no pending update yet: nothing to carry
    assert moved == {"upload": 0, "offload": 0}
    # step 0's update: each block's two moments up and back once
    engine.step(random_batch(64, seed=1))
    assert moved == {"upload": 2 * blocks, "offload": 2 * blocks}
    engine.forward(random_batch(64, seed=2))  # applies step 1's update, then reads
    assert moved == {"upload": 4 * blocks, "offload": 4 * blocks}
    engine.forward(random_batch(64, seed=2))  # an evaluation with no update leaves them at rest
    assert moved == {"upload": 4 * blocks, "offload": 4 * blocks}


def test_bf16_state_rests_at_half_the_bytes_and_stays_close_to_fp32():
    engines = {
        dtype: engine_for(
            base_model("llama"),
            mode="offload",
            num_slots=2,
            optimizer="adam",
            lr=1e-3,
            state_dtype=dtype,
        )
        for dtype in ("fp32", "bf16")
    }
    assert engines["bf16"].state_host_bytes * 2 == engines["fp32"].state_host_bytes
    assert engines["bf16"].moments.blocks[0].host_storage.dtype == torch.bfloat16
    for engine in engines.values():
        train(engine, 64, steps=6)
    a, b = (engines[d].named_parameters() for d in ("fp32", "bf16"))
    initial = base_model("llama").state_dict()
    for name in a:
        moved = (a[name] - initial[name]).abs().max()
        assert (a[name] - b[name]).abs().max() <= 0.05 * moved + 1e-7, name


def test_the_plan_counts_the_state_the_engine_allocates():
    for options in (
        dict(mode="offload", optimizer="adam"),
        dict(mode="offload", optimizer="adam", state_dtype="bf16"),
        dict(mode="resident", optimizer="momentum", optimizer_state="stored"),
    ):
        config = ZOConfig(device="cpu", num_slots=2, **options)
        model = base_model("llama")
        sgd = plan_memory(
            model, ZOConfig(device="cpu", num_slots=2, mode=options["mode"]), 1, False, 2, 8
        )
        plan = plan_memory(model, config, 1, False, 2, 8)
        engine = ZOEngine(base_model("llama"), config)
        assert plan.state_host_bytes == engine.state_host_bytes
        rounding = engine.rounding_noise.device_bytes if options.get("state_dtype") == "bf16" else 0
        assert plan.device_bytes - sgd.device_bytes == engine.state_device_bytes + rounding
        assert plan.state_host_bytes + plan.state_device_bytes > 0


def test_bad_optimizer_state_options_are_one_line_errors():
    with pytest.raises(ValueError, match="optimizer_state recomputed applies to momentum only"):
        ZOConfig(optimizer="adam", optimizer_state="recomputed")
    with pytest.raises(ValueError, match="ZO-SGD has no optimizer state to store"):
        ZOConfig(optimizer_state="stored")
    with pytest.raises(
        ValueError,
        match="state_dtype bf16 applies to stored optimizer state at rest in host memory",
    ):
        ZOConfig(optimizer="adam", mode="resident", state_dtype="bf16")
    with pytest.raises(ValueError, match="beta2 must be in"):
        ZOConfig(optimizer="adam", beta2=1.0)
    with pytest.raises(ValueError, match="adam_eps must be > 0"):
        ZOConfig(optimizer="adam", adam_eps=0.0)


def test_a_step_moves_each_blocks_moments_over_the_link_beside_its_weights():
    """The link rate the metrics report counts what a step moves: Adam's two fp32 moments
    triple SGD's bytes per step; at rest in bf16 they add half as much each."""
    sgd = engine_for(base_model("opt"), mode="offload", num_slots=2)
    adam = {
        dtype: engine_for(
            base_model("opt"), mode="offload", num_slots=2, optimizer="adam", state_dtype=dtype
        )
        for dtype in ("fp32", "bf16")
    }
    assert sgd.link_bytes_per_step > 0
    assert adam["fp32"].link_bytes_per_step == 3 * sgd.link_bytes_per_step
    assert adam["bf16"].link_bytes_per_step == 2 * sgd.link_bytes_per_step


def test_bf16_moments_are_rounded_with_the_steps_own_noise_keys():
    """A bf16 moment rounded on its way back draws the uniforms of the step under way, as
    the blocks do: with one step's draws every step, an element between two bf16 values
    would round the same way each time, a bias that stochastic rounding exists to avoid."""
    engine = engine_for(
        base_model("opt"), mode="offload", num_slots=2, optimizer="adam", state_dtype="bf16"
    )
    train(engine, 64, steps=3)
    assert engine.store.step == 2
    assert [store.step for store in engine.moments.blocks] == [2, 2]


def test_a_replay_rebuilds_the_runs_optimizer_from_its_log():
    """A stored momentum replayed as a recomputed one, or Adam's betas as the defaults, is
    another trajectory; a log from before Adam (no beta2 in its record) still replays."""
    stored = ZOConfig(optimizer="momentum", optimizer_state="stored", beta1=0.8)
    assert replayed_config(stored).stored_state
    adam = ZOConfig(optimizer="adam", beta1=0.7, beta2=0.95, adam_eps=1e-6)
    again = replayed_config(adam)
    assert (again.beta1, again.beta2, again.adam_eps) == (0.7, 0.95, 1e-6)
    before_adam = {"name": "momentum", "beta1": 0.8, "momentum_window": 3}
    old = replayed_config(ZOConfig(), optimizer=before_adam)
    assert (old.optimizer, old.beta1, old.momentum_window) == ("momentum", 0.8, 3)
    assert not old.stored_state and old.beta2 == ZOConfig().beta2
