import re

import pytest
import torch

from distzo import ZOConfig, ZOEngine
from distzo.data import CountingTask
from distzo.engine import PendingUpdate
from tests.helpers.engines import buckets_of
from tests.helpers.models import FLOAT64_TINY, random_batch, tiny_opt


def batches(vocab_size, n, seed=0):
    return [random_batch(vocab_size, pad="left", seed=seed + i) for i in range(n)]


def fail_in_the_last_block(engine, monkeypatch, error: type[BaseException] = IndexError):
    """The engine's passes fail inside their last block, after the first blocks ran."""
    forward = engine.family.block_forward

    def fails_in_the_last_block(block, hidden, ctx):
        if block is engine.blocks[-1]:
            raise error("a failure inside the pass")
        return forward(block, hidden, ctx)

    monkeypatch.setattr(engine.family, "block_forward", fails_in_the_last_block)


def run(mode, steps=20, num_slots=2, flush_at=(), **overrides):
    model = tiny_opt(seed=0, num_hidden_layers=3, word_embed_proj_dim=16)
    options = dict(lr=1e-3, eps=1e-3, weight_decay=0.1, seed=11, device="cpu", noise_chunk=1000)
    options.update(overrides)
    engine = ZOEngine(model, ZOConfig(mode=mode, num_slots=num_slots, **options))
    results = []
    for i, batch in enumerate(batches(model.config.vocab_size, steps)):
        results.append(engine.step(batch))
        if i in flush_at:
            engine.flush()
    return results, engine.named_parameters()


def assert_same_trajectory(a, b):
    (results_a, params_a), (results_b, params_b) = a, b
    assert [(r.loss_plus, r.loss_minus, r.projected_grads) for r in results_a] == [
        (r.loss_plus, r.loss_minus, r.projected_grads) for r in results_b
    ]
    assert params_a.keys() == params_b.keys()
    for name in params_a:
        assert torch.equal(params_a[name], params_b[name]), name


def test_offload_trajectory_equals_resident_bitwise():
    resident = run("resident")
    assert_same_trajectory(run("offload"), resident)
    # and the parameters really moved (the comparison is not between two untouched models)
    untouched = tiny_opt(seed=0, num_hidden_layers=3, word_embed_proj_dim=16).state_dict()
    assert not torch.equal(
        resident[1]["model.decoder.layers.0.fc1.weight"],
        untouched["model.decoder.layers.0.fc1.weight"],
    )


@pytest.mark.parametrize("num_slots", [1, 3, 5])
def test_number_of_slots_does_not_change_the_trajectory(num_slots):
    assert_same_trajectory(
        run("offload", steps=6, num_slots=num_slots), run("offload", steps=6, num_slots=2)
    )


def test_flushing_early_does_not_change_the_trajectory():
    assert_same_trajectory(run("offload", steps=6, flush_at=(1, 2, 4)), run("offload", steps=6))


def test_the_trajectory_depends_only_on_the_noise_key(monkeypatch):
    """Portable z: another workspace size (chunking) or the slow torch generator in place
    of the C kernel draws the same z, so the whole run is the same, bit for bit."""
    reference = run("offload", steps=4, noise_chunk=1000)
    assert_same_trajectory(run("offload", steps=4, noise_chunk=333), reference)
    assert_same_trajectory(run("resident", steps=4, noise_chunk=4096 * 3 + 1), reference)
    monkeypatch.setattr("distzo.zo.fast_noise.available", lambda: False)
    slow = run("offload", steps=4, noise_chunk=1000)
    assert_same_trajectory(slow, reference)


@pytest.mark.parametrize("kind", ["rademacher", "legacy"])
def test_every_noise_kind_keeps_offload_equal_to_resident(kind):
    resident = run("resident", steps=4, noise=kind)
    assert_same_trajectory(run("offload", steps=4, noise=kind), resident)
    with pytest.raises(AssertionError):  # and the kind is really another z
        assert_same_trajectory(resident, run("resident", steps=4))


def zo_and_autograd_gradient(seed, eps, num_queries=1, lr=0.0):
    """(engine after one step, its g per query, z_j . autograd gradient per query)."""
    model = tiny_opt(seed=seed, **FLOAT64_TINY)
    reference = tiny_opt(seed=seed, **FLOAT64_TINY).eval()
    # Right padding: pad positions then never reach the loss. (With left padding the last
    # pad predicts the first real token, and autograd's padding_idx drops that gradient.)
    batch = random_batch(model.config.vocab_size, pad="right", seed=seed)
    config = ZOConfig(
        eps=eps, lr=lr, seed=seed, device="cpu", noise_chunk=777, num_queries=num_queries
    )
    engine = ZOEngine(model, config)
    grads = engine.step(batch).projected_grads

    reference(**batch).loss.backward()
    autograd = {name: p.grad for name, p in reference.named_parameters(remove_duplicate=False)}
    dots = [0.0] * num_queries
    for layout, block_id in buckets_of(engine):
        for query in range(num_queries):
            z = engine.noise.full(layout.numel, step=0, block_id=block_id, query=query)
            for entry in layout.entries:
                z_param = z[entry.offset : entry.offset + entry.numel].view(entry.shape)
                dots[query] += (z_param * autograd[entry.names[0]]).sum().item()
    return engine, grads, dots


@pytest.mark.parametrize("seed", [2, 3, 8])  # |g| >= 0.1: a relative bound means something
def test_projected_gradient_equals_z_dot_autograd_gradient(seed):
    _, (g,), (dot,) = zo_and_autograd_gradient(seed, eps=1e-4)
    assert g == pytest.approx(dot, rel=1e-4)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_projected_gradient_error_is_the_central_difference_truncation(seed):
    # Where g is near 0 (seed 1: |g| ~ 0.005) a relative bound at eps=1e-4 is meaningless; what
    # shows that the estimator has no bias is that its error shrinks as eps^2.
    _, (g4,), (dot,) = zo_and_autograd_gradient(seed, eps=1e-4)
    _, (g5,), _ = zo_and_autograd_gradient(seed, eps=1e-5)
    assert abs(g5 - dot) < abs(g4 - dot) / 30
    assert g5 == pytest.approx(dot, rel=1e-4)


def test_each_query_estimates_its_own_directional_derivative():
    # n-SPSA: query j's g is z_j . grad L for its own z_j; query 0 is MeZO's one direction.
    _, (single,), _ = zo_and_autograd_gradient(8, eps=1e-4)  # every |g_j| >= 0.05 at this seed
    _, grads, dots = zo_and_autograd_gradient(8, eps=1e-4, num_queries=3)
    assert grads[0] == single
    assert grads == pytest.approx(dots, rel=1e-4)
    assert len({round(d, 6) for d in dots}) == 3  # three different directions


def test_a_multi_query_step_moves_theta_by_the_mean_of_its_estimates():
    lr, q = 1e-3, 3
    before = tiny_opt(seed=1, **FLOAT64_TINY).state_dict()
    engine, grads, _ = zo_and_autograd_gradient(1, eps=1e-4, num_queries=q, lr=lr)
    after = engine.named_parameters()
    for layout, block_id in buckets_of(engine):
        zs = [engine.noise.full(layout.numel, step=0, block_id=block_id, query=j) for j in range(q)]
        step = -lr * sum(g * z for g, z in zip(grads, zs)) / q
        for entry in layout.entries:
            expected = before[entry.names[0]] + step[
                entry.offset : entry.offset + entry.numel
            ].view(entry.shape)
            torch.testing.assert_close(after[entry.names[0]], expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize("num_queries", [2, 3])
def test_multi_query_offload_equals_resident_bitwise(num_queries):
    resident = run("resident", steps=5, num_queries=num_queries)
    assert_same_trajectory(run("offload", steps=5, num_queries=num_queries), resident)
    assert all(len(r.projected_grads) == num_queries for r in resident[0])
    single = run("resident", steps=5)  # the extra queries really change the step
    assert not torch.equal(
        single[1]["model.decoder.layers.0.fc1.weight"],
        resident[1]["model.decoder.layers.0.fc1.weight"],
    )


FZOO = dict(estimator="fzoo", num_queries=4, noise="rademacher")


def test_fzoo_offload_equals_resident_bitwise_whatever_the_slots_and_flushes():
    resident = run("resident", steps=5, **FZOO)
    assert_same_trajectory(run("offload", steps=5, **FZOO), resident)
    assert_same_trajectory(run("offload", steps=5, num_slots=1, flush_at=(1, 3), **FZOO), resident)
    assert all(len(r.projected_grads) == 4 and len(r.losses) == 5 for r in resident[0])
    spsa = run("resident", steps=5, num_queries=4, noise="rademacher")
    assert not torch.equal(  # FZOO really took another step
        spsa[1]["model.decoder.layers.0.fc1.weight"],
        resident[1]["model.decoder.layers.0.fc1.weight"],
    )


def test_a_hundred_steps_lower_the_loss_clearly():
    torch.manual_seed(0)
    model = tiny_opt(seed=0)
    task = CountingTask(model.config.vocab_size, seed=0)
    evaluation = task.batch(64)
    evaluation["labels"] = evaluation["input_ids"]
    engine = ZOEngine(model, ZOConfig(lr=1e-2, eps=1e-3, seed=0, device="cpu"))
    before = engine.forward(evaluation)[1].item()
    for _ in range(100):
        engine.step(task.batch(32))
    after = engine.forward(evaluation)[1].item()
    # Measured: 4.18 -> 3.86 here; seeds 0-5 drop 0.32-0.91 nats. Without learning it stays at
    # log(64).
    assert after < before - 0.25, (before, after)


def test_state_dict_resume_continues_the_same_trajectory():
    full, full_params = run("offload", steps=8)

    model = tiny_opt(seed=0, num_hidden_layers=3, word_embed_proj_dim=16)
    config = ZOConfig(
        mode="offload", lr=1e-3, eps=1e-3, weight_decay=0.1, seed=11, device="cpu", noise_chunk=1000
    )
    data = batches(model.config.vocab_size, 8)
    first = ZOEngine(model, config)
    for batch in data[:4]:
        first.step(batch)
    state = {k: v for k, v in first.state_dict().items()}
    state["params"] = {k: v.clone() for k, v in state["params"].items()}
    assert state["pending"] is not None and state["pending"]["step"] == 3  # saved unflushed

    # a differently seeded engine takes the saved state's seed, step and pending update
    second = ZOEngine(
        tiny_opt(seed=99, num_hidden_layers=3, word_embed_proj_dim=16),
        ZOConfig(
            mode="resident",
            lr=1e-3,
            eps=1e-3,
            weight_decay=0.1,
            seed=5,
            device="cpu",
            noise_chunk=1000,
        ),
    )
    second.load_state_dict(state)
    resumed = [second.step(batch) for batch in data[4:]]
    assert [r.projected_grad for r in resumed] == [r.projected_grad for r in full[4:]]
    params = second.named_parameters()
    for name in full_params:
        assert torch.equal(params[name], full_params[name]), name


def test_load_state_dict_refuses_a_mismatched_state():
    engine = ZOEngine(tiny_opt(), ZOConfig(device="cpu", seed=0))
    state = engine.state_dict()
    state["params"] = dict(state["params"])
    state["params"].pop("lm_head.weight", None)
    state["params"].pop("model.decoder.embed_tokens.weight")
    with pytest.raises(ValueError, match="missing"):
        engine.load_state_dict(state)
    # Another noise kind, or a state from before noise kinds (legacy), continues another run.
    with pytest.raises(
        ValueError,
        match="trained with rademacher-v1 noise, the engine draws gaussian-v1; "
        "set noise rademacher",
    ):
        engine.load_state_dict(engine.state_dict() | {"noise": "rademacher-v1"})
    legacy_state = {k: v for k, v in engine.state_dict().items() if k != "noise"}
    with pytest.raises(ValueError, match="trained with legacy noise"):
        engine.load_state_dict(legacy_state)
    # portable z: the chunk is only a workspace
    engine.load_state_dict(engine.state_dict() | {"noise_chunk": 5})
    legacy = ZOEngine(tiny_opt(), ZOConfig(device="cpu", seed=0, noise="legacy"))
    with pytest.raises(ValueError, match="noise_chunk"):  # legacy z depends on it
        legacy.load_state_dict(legacy_state | {"noise_chunk": 5})


def test_weight_decay_touches_matrices_only():
    model = tiny_opt(seed=0)
    engine = ZOEngine(model, ZOConfig(lr=0.5, eps=1e-3, weight_decay=0.1, seed=0, device="cpu"))
    before = {k: v.clone() for k, v in engine.named_parameters().items()}
    engine.pending = PendingUpdate(step=0, projected_grads=(0.0,), lr=0.5)  # g = 0: only decay acts
    after = engine.named_parameters()
    for name, value in after.items():
        if value.ndim >= 2:
            torch.testing.assert_close(value, before[name] * (1 - 0.5 * 0.1), rtol=1e-6, atol=0)
        else:
            assert torch.equal(value, before[name]), name


def test_an_empty_label_batch_is_refused():
    engine = ZOEngine(tiny_opt(), ZOConfig(device="cpu", seed=0))
    batch = random_batch(64)
    batch["labels"] = torch.full_like(batch["labels"], -100)
    with pytest.raises(ValueError, match="no label tokens"):
        engine.step(batch)


@pytest.mark.parametrize("error", [IndexError, KeyboardInterrupt])
def test_a_failed_pass_makes_the_engine_refuse_to_continue(monkeypatch, error):
    """A Ctrl-C half-way leaves the buckets as half-written as an error; a loaded state
    makes the engine whole again."""
    engine = ZOEngine(tiny_opt(), ZOConfig(device="cpu", seed=0))
    reference = ZOEngine(tiny_opt(), ZOConfig(device="cpu", seed=0))
    engine.step(random_batch(64))
    state = engine.state_dict()
    fail_in_the_last_block(engine, monkeypatch, error)  # the first blocks took the update
    with pytest.raises(error, match="inside the pass"):
        engine.step(random_batch(64))
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="unusable"):
        engine.step(random_batch(64))
    engine.load_state_dict(state)
    reference.step(random_batch(64))
    assert engine.step(random_batch(64)) == reference.step(random_batch(64))


@pytest.mark.parametrize("pending", [False, True])
def test_a_measure_that_fails_before_the_blocks_leaves_the_engine_usable(pending):
    """A measure's own bug (before or after its pass) wrote no bucket: the engine was
    marked unusable all the same, and a notebook had to reload its state."""
    engine = ZOEngine(tiny_opt(), ZOConfig(device="cpu", seed=0))
    reference = ZOEngine(tiny_opt(), ZOConfig(device="cpu", seed=0))
    for e in (engine, reference):
        if pending:
            e.step(random_batch(64))

    def fails_before(runner):
        raise KeyError("a typo in the measure")

    def fails_after(runner):
        ids = random_batch(64)["input_ids"]
        runner.hidden_states({(0, 0): ids}, None)
        raise KeyError("a typo after the pass")

    for measure in (fails_before, fails_after):
        with pytest.raises(KeyError, match="typo"):
            engine.evaluate(measure)
    assert engine.step(random_batch(64, seed=1)) == reference.step(random_batch(64, seed=1))


@pytest.mark.parametrize("measure", [3, None, "accuracy"])
def test_evaluate_refuses_what_is_no_measure_in_one_line(measure):
    """``evaluate(3)`` was Python's bare "'int' object is not callable", naming neither
    the call nor what it takes."""
    engine = ZOEngine(tiny_opt(), ZOConfig(device="cpu", seed=0))
    kind = type(measure).__name__
    with pytest.raises(TypeError, match=rf"^evaluate takes a measure, .* got a {kind}$"):
        engine.evaluate(measure)


def test_a_pass_that_fails_with_no_update_to_take_leaves_the_engine_usable(monkeypatch):
    """The first step's pass has no pending update to write into the buckets: a failure in
    its last block leaves every bucket as it was, and the step taken again is the
    reference's first step."""
    engine = ZOEngine(tiny_opt(), ZOConfig(device="cpu", seed=0))
    reference = ZOEngine(tiny_opt(), ZOConfig(device="cpu", seed=0))
    fail_in_the_last_block(engine, monkeypatch)
    with pytest.raises(IndexError, match="inside the pass"):
        engine.step(random_batch(64))
    monkeypatch.undo()
    assert engine.step(random_batch(64)) == reference.step(random_batch(64))


def test_a_failure_at_the_steps_read_makes_the_engine_refuse_to_continue(monkeypatch):
    """A device reports an error in a queued pass (which took the last step's update) at the
    step's one read: the buckets may be half-updated, so the engine refuses to go on."""
    engine = ZOEngine(tiny_opt(), ZOConfig(device="cpu", seed=0))
    engine.step(random_batch(64))

    def read_later(vector):
        def read():
            raise RuntimeError("device-side assert triggered")

        return read

    monkeypatch.setattr(engine.parallel.comm, "read_later", read_later)
    with pytest.raises(RuntimeError, match="device-side assert"):
        engine.step(random_batch(64))
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="unusable"):
        engine.step(random_batch(64))


def test_a_batch_too_short_for_grad_accum_is_refused_before_the_pending_update():
    """The rows were checked in the pass, after the resident bucket took the pending
    update: the refusal left the engine half-updated and unusable."""
    engine = ZOEngine(tiny_opt(), ZOConfig(device="cpu", seed=0, grad_accum=4))
    engine.step(random_batch(64))
    with pytest.raises(ValueError, match="^grad_accum 4 needs at least 4 rows"):
        engine.step(random_batch(64, batch=2))
    assert engine.pending is not None and engine.pending.step == 0
    assert engine.step(random_batch(64)).step == 1


def test_a_data_parallel_step_without_the_global_count_is_refused():
    """Under dp ranks each share divided by its own count would add up to dp times the
    global mean in the all-reduce: the default count is one process's only."""
    from distzo.dist import Collectives, LaunchEnv, ParallelContext, ParallelDims

    parallel = ParallelContext(
        LaunchEnv(rank=0, world_size=2, local_world_size=2),
        ParallelDims(2, 1),
        comm=Collectives(torch.device("cpu")),
    )
    model = tiny_opt(seed=0)
    engine = ZOEngine(model, ZOConfig(device="cpu", seed=0), parallel=parallel)
    batch = parallel.shard_batch(random_batch(model.config.vocab_size, batch=4))
    with pytest.raises(ValueError, match=r"^step: under data parallelism \(dp 2\).*num_items"):
        engine.step(batch)
    assert engine.step_index == 0


def test_a_pert_group_wider_than_a_steps_passes_is_refused_in_one_line():
    """The command line refuses it before the engine; built in Python, rank 3 of a pert
    group of 4 had none of SPSA's 2 passes and failed on an empty max() in the build."""
    from distzo.dist import Collectives, LaunchEnv, ParallelContext, ParallelDims

    parallel = ParallelContext(
        LaunchEnv(rank=3, world_size=4, local_world_size=4),
        ParallelDims(1, 4),
        comm=Collectives(torch.device("cpu")),
    )
    with pytest.raises(  # named as the Python caller set them: no --pert flag here
        ValueError,
        match=r"^pert 4 is more ranks than the 2 forward passes of a step \(estimator spsa, "
        r"num_queries 1\); use pert 2 or fewer, or more num_queries$",
    ):
        ZOEngine(tiny_opt(seed=0), ZOConfig(device="cpu", seed=0), parallel=parallel)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_state_of_other_shapes_is_refused_before_any_bucket_is_written(optimizer):
    """A state of a wider model under the same names failed part-way through the copy
    (a torch size error), the embeddings already overwritten, and the engine stepped on
    from the half-loaded weights."""
    config = ZOConfig(device="cpu", seed=0, optimizer=optimizer)
    engine = ZOEngine(tiny_opt(seed=0), config)
    before = engine.named_parameters()
    wider = ZOEngine(tiny_opt(seed=1, ffn_dim=128), config).state_dict()
    with pytest.raises(ValueError, match=r"fc1.weight has shape \(128, 32\).*\(64, 32\)"):
        engine.load_state_dict(wider)
    if optimizer == "adam":  # the parameters fit, one moment does not
        state = engine.state_dict()
        state["optimizer_state"]["exp_avg"] = wider["optimizer_state"]["exp_avg"]
        with pytest.raises(ValueError, match="exp_avg of .*fc1.weight has shape"):
            engine.load_state_dict(state)
    after = engine.named_parameters()
    assert all(torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("call", ["step", "forward"])
def test_a_mistyped_batch_key_is_refused_not_ignored(call):
    """``label`` for ``labels`` was ignored: the step trained on every token instead of
    the labels given, with no word said."""
    engine = ZOEngine(tiny_opt(), ZOConfig(device="cpu", seed=0))
    batch = random_batch(64)
    with pytest.raises(ValueError, match=r"^the batch has keys .* 'label' \(it reads input_ids"):
        getattr(engine, call)({"input_ids": batch["input_ids"], "label": batch["labels"]})
    assert engine.step_index == 0 and engine.pending is None


@pytest.mark.parametrize("call", ["step", "forward"])
def test_a_bare_tensor_for_a_batch_is_refused_in_one_line(call):
    """It failed inside torch's ``Tensor.__contains__``, naming no batch."""
    engine = ZOEngine(tiny_opt(), ZOConfig(device="cpu", seed=0))
    with pytest.raises(ValueError, match=r"^a batch is a mapping of tensors.*got a Tensor"):
        getattr(engine, call)(random_batch(64)["input_ids"])


@pytest.mark.parametrize("num_items", [2.5, 40.0, True, -44])
def test_a_count_that_is_no_whole_number_is_refused(num_items):
    """``num_items`` is typed int: 2.5 or True divided the losses and scaled g silently
    (True: the summed loss of 44 tokens, 116 where the mean is 4.2); -44 was refused as
    "the batch has nothing to train on", of a batch of 44 label tokens."""
    engine = ZOEngine(tiny_opt(), ZOConfig(device="cpu", seed=0))
    with pytest.raises(ValueError, match=r"^num_items must be a whole count"):
        engine.step(random_batch(64), num_items=num_items)
    assert engine.step(random_batch(64), num_items=torch.tensor(44)).step == 0


@pytest.mark.parametrize("run_seed", [1.5, "1", True])
def test_a_run_seed_that_is_no_whole_number_is_refused(run_seed):
    """``int()`` took them: 1.5 and True drew run seed 1's noise, "1" as well, with no
    word said (``ZOConfig.seed`` refuses the same values)."""
    with pytest.raises(ValueError, match=rf"^run_seed must be a whole number, got {run_seed!r}$"):
        ZOEngine(tiny_opt(), ZOConfig(device="cpu"), run_seed=run_seed)
    assert ZOEngine(tiny_opt(), ZOConfig(device="cpu"), run_seed=torch.tensor(1)).run_seed == 1


@pytest.mark.parametrize(
    "config, got", [({"lr": 1e-3}, "dict {'lr': 0.001}"), (None, "NoneType None"), ("t", "str 't'")]
)
def test_a_config_that_is_no_zoconfig_is_refused_in_one_line(config, got):
    """A dict of its fields was "'dict' object has no attribute 'validate'"; the refusal
    then said "got a dict" where every other argument's says its type and value."""
    with pytest.raises(TypeError, match=rf"^config must be a ZOConfig, got {re.escape(got)}: ZOE"):
        ZOEngine(tiny_opt(), config)


@pytest.mark.parametrize(
    "argument, value, got",
    [
        ("objective", "lm", "an Objective, got str 'lm': one from distzo.objectives"),
        ("family", "opt", "a ModelFamily, got str 'opt': omit it"),
        ("weights", "x", "a WeightSource, got str 'x': open_checkpoint(path)"),
        ("parallel", 1, "a distzo.dist.ParallelContext, got int 1: a torchrun job's"),
        (
            "model",
            torch.nn.Linear(4, 4),
            "a transformers causal or masked LM (or a peft model of one), got",
        ),
    ],
)
def test_an_argument_of_the_wrong_type_is_refused_at_construction(argument, value, got):
    """objective="lm" was accepted and the first step failed with "'str' object has no
    attribute 'num_items'"; family="opt", parallel=1, weights="x" and an nn.Linear failed
    in the build on an attribute of theirs, naming neither the argument nor its type."""
    arguments = {"model": tiny_opt(), "config": ZOConfig(device="cpu", seed=0), argument: value}
    with pytest.raises(TypeError, match=rf"^{argument} must be {re.escape(got)}"):
        ZOEngine(**arguments)


@pytest.mark.parametrize("stop", ["yes", 0.5, None])
def test_a_stop_vote_that_is_no_bool_is_refused_before_the_step(stop):
    """stop="yes" failed inside the step with "could not convert string to float: 'yes'"
    and 0.5 went into the all-reduce as half a vote; the step count stays where it was."""
    engine = ZOEngine(tiny_opt(), ZOConfig(device="cpu", seed=0))
    with pytest.raises(TypeError, match=r"^stop must be True or False, got .*: this rank's vote"):
        engine.step(random_batch(8), stop=stop)
    assert engine.step(random_batch(8), stop=True).stop and engine.step_index == 1


def test_load_state_dict_refuses_what_is_no_state_before_writing():
    """A state missing a key, with a step no run reaches, or with a malformed pending
    update is refused in one line, and the engine keeps its own parameters."""
    model = tiny_opt()
    engine = ZOEngine(model, ZOConfig(device="cpu", seed=0))
    batch = random_batch(model.config.vocab_size, seed=0)
    engine.step(batch)
    before = engine.named_parameters()
    state = engine.state_dict()
    zeroed = {name: torch.zeros_like(value) for name, value in state["params"].items()}
    bad = {
        "lacks noise_chunk: load what ZOEngine.state_dict": {
            k: v for k, v in state.items() if k != "noise_chunk"
        },
        r"step must be a whole number in \[0, 2\^63\), got -3": state | {"step": -3},
        "step must be a whole number.*got 1.5": state | {"step": 1.5},
        "run_seed must be a whole number.*got True": state | {"run_seed": True},
        "pending update is malformed": state | {"params": zeroed, "pending": {"step": 1}},
        "pending update is malformed: .*missing": state | {"params": zeroed, "pending": {}},
        r"run_seed must be a whole number.*got 9223372036854775808": state | {"run_seed": 2**63},
        "pending update is malformed: a pending update needs one projected gradient": state
        | {"params": zeroed, "pending": {"step": 1, "projected_grads": [], "lr": 0.1}},
        "got a list": [],
    }
    for message, saved in bad.items():
        with pytest.raises(ValueError, match=message):
            engine.load_state_dict(saved)
    after = engine.named_parameters()
    assert all(torch.equal(after[name], before[name]) for name in before)
    engine.load_state_dict(state | {"step": torch.tensor(1)})  # a 0-dim integer tensor is a count
    assert engine.step(batch).step == 1
