"""The estimators against autograd in float64: what each one's update converges to over
many noise keys (SPSA: the gradient; FZOO: the normalised gradient, scaled by kappa_N),
FZOO's coefficients and step written out densely, and the pairings it refuses."""

import math

import pytest
import torch

from distzo import ZOConfig, ZOEngine
from distzo.config.checks import check_job
from distzo.config.job import resolve
from distzo.dist import LaunchEnv
from distzo.job.memory_plan import RankPlace, plan_memory
from distzo.runtime.option_names import named_as_flags
from distzo.zo import NoiseSource
from distzo.zo.estimators import ESTIMATORS, FZOO
from tests.helpers.engines import Counting, buckets_of
from tests.helpers.models import FLOAT64_TINY, random_batch, tiny_opt

# A tiny model as a function of one flat parameter vector, evaluated for many parameter
# vectors at once: a tanh MLP classifying 16 fixed points into 3 classes (51 parameters).
SHAPES = [(4, 6), (6,), (6, 3), (3,)]
DIM = sum(math.prod(s) for s in SHAPES)


def tiny_problem():
    g = torch.Generator().manual_seed(0)
    inputs = torch.randn(16, 4, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 3, (16,), generator=g)
    theta = 0.5 * torch.randn(DIM, generator=g, dtype=torch.float64)

    def loss(thetas: torch.Tensor) -> torch.Tensor:  # (rows, DIM) -> (rows,)
        parts, lo = [], 0
        for shape in SHAPES:
            parts.append(thetas[:, lo : lo + math.prod(shape)].reshape(-1, *shape))
            lo += math.prod(shape)
        w1, b1, w2, b2 = parts
        hidden = torch.tanh(torch.einsum("nf,rfh->rnh", inputs, w1) + b1[:, None])
        logits = torch.einsum("rnh,rho->rno", hidden, w2) + b2[:, None]
        targets = labels.expand(thetas.shape[0], -1)
        return torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), targets, reduction="none"
        ).mean(1)

    leaf = theta.clone().requires_grad_(True)
    loss(leaf[None])[0].backward()
    return loss, theta, leaf.grad


def mean_update_direction(name, kind, keys, queries, eps=1e-5):
    """The mean over ``keys`` noise keys (one per step, as the engine keys them) of the
    direction the update moves theta against: mean_j c_j z_j."""
    loss, theta, grad = tiny_problem()
    estimator = ESTIMATORS[name]
    noise = NoiseSource(11, 4096, torch.device("cpu"), torch.float64, kind=kind)
    passes = estimator.passes(queries)
    z = torch.stack(
        [noise.full(queries * DIM, step=k, block_id=1).view(queries, DIM) for k in range(keys)]
    )
    signs = torch.tensor([sign for _, sign in passes], dtype=torch.float64)
    directions = z[:, [query for query, _ in passes]]  # (keys, passes, DIM)
    losses = loss((theta + eps * signs[:, None] * directions).view(-1, DIM)).view(keys, -1)
    total = torch.zeros(DIM, dtype=torch.float64)
    for k in range(keys):
        c = torch.tensor(
            estimator.update_coefficients(losses[k].tolist(), eps), dtype=torch.float64
        )
        total += (c[:, None] * z[k]).mean(0)
    return total / keys, grad


def kappa(n: int) -> float:
    """E[s + xbar^2 / s] over n standard normals (s: population std, xbar: mean): the
    norm of FZOO's expected step direction (docstring of distzo.zo.estimators.fzoo)."""
    ratio = math.exp(math.lgamma(n / 2) - math.lgamma((n - 1) / 2))
    inverse = math.exp(math.lgamma(n / 2 - 1) - math.lgamma((n - 1) / 2))
    return math.sqrt(2 / n) * ratio + math.sqrt(1 / (2 * n)) * inverse


def test_spsas_update_direction_averages_to_the_gradient():
    # 4000 keys, 51 parameters: the mean's error is about sqrt(51 / 4000) = 11 % of |grad|,
    # nearly all of it orthogonal to grad
    mean, grad = mean_update_direction("spsa", "gaussian", keys=4000, queries=1)
    cosine = torch.nn.functional.cosine_similarity(mean, grad, dim=0).item()
    assert cosine > 0.98, cosine
    assert mean.norm() / grad.norm() == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("kind", ["gaussian", "rademacher"])
def test_fzoos_update_direction_averages_to_the_normalised_gradient(kind):
    # FZOO's sum_j g_j z_j = mean_j c_j z_j: its mean points along grad with norm kappa_8
    # = 1.053 whatever |grad| is (0.64 here): exactly so for Gaussian z in the small-eps
    # limit, and closely for Rademacher z. 1500 keys: the mean's error is ~ sqrt(51/8/1500)
    mean, grad = mean_update_direction("fzoo", kind, keys=1500, queries=8)
    cosine = torch.nn.functional.cosine_similarity(mean, grad, dim=0).item()
    assert cosine > 0.99, cosine
    assert kappa(8) == pytest.approx(1.0532, abs=1e-4)
    assert mean.norm().item() == pytest.approx(kappa(8), abs=0.05)
    assert abs(grad.norm().item() - kappa(8)) > 0.3  # so the norm is not the gradient's


def test_fzoo_coefficients_are_its_normalised_one_sided_differences():
    fzoo = FZOO()
    assert fzoo.passes(3) == ((0, 1), (1, 1), (2, 1), (0, 0))
    losses = [2.0, 2.5, 1.25, 2.25]  # L_1, L_2, L_3, then L_0 = L(theta)
    perturbed = torch.tensor(losses[:-1], dtype=torch.float64)
    sigma = perturbed.std(unbiased=False).item()  # FZOO's own spread
    g = [(loss - losses[-1]) / (3 * sigma) for loss in losses[:-1]]
    # the engine's update is the mean of c_j z_j: c_j = N g_j makes it FZOO's sum_j g_j z_j
    assert fzoo.update_coefficients(losses, eps=1e-3) == pytest.approx([3 * x for x in g])
    # eps cancels, and so does the loss's scale: a normalised step
    assert fzoo.update_coefficients(losses, eps=0.5) == fzoo.update_coefficients(losses, 1e-3)
    scaled = fzoo.update_coefficients([10 * x for x in losses], eps=1e-3)
    assert scaled == pytest.approx(fzoo.update_coefficients(losses, eps=1e-3), rel=1e-12)
    reported = fzoo.step_losses(losses)
    assert (reported.loss, reported.loss_plus, reported.loss_minus) == (2.25, 5.75 / 3, 2.25)
    # every perturbed loss equal: sigma is 0, and the step does not move
    assert fzoo.update_coefficients([1.0, 1.0, 1.0, 0.5], eps=1e-3) == (0.0, 0.0, 0.0)


def test_spsa_reports_each_sides_mean_and_their_mean_as_the_loss():
    """The loss a step logs is (L+ + L-)/2, L(theta) to first order, not one side's."""
    spsa = ESTIMATORS["spsa"]
    losses = [2.0, 1.0, 4.0, 3.5]  # L+_0, L-_0, L+_1, L-_1
    reported = spsa.step_losses(losses)
    assert (reported.loss, reported.loss_plus, reported.loss_minus) == (2.625, 3.0, 2.25)
    assert spsa.update_coefficients(losses, eps=0.25) == (2.0, 1.0)


def test_a_fzoo_step_runs_its_passes_and_moves_theta_by_fzoos_update():
    lr, eps, n = 1e-3, 1e-4, 3
    before = tiny_opt(seed=2, **FLOAT64_TINY)
    reference = tiny_opt(seed=2, **FLOAT64_TINY).eval()
    batch = random_batch(before.config.vocab_size, pad="right", seed=2)
    config = ZOConfig(
        estimator="fzoo",
        num_queries=n,
        noise="rademacher",
        eps=eps,
        lr=lr,
        seed=4,
        device="cpu",
        noise_chunk=777,
        mode="offload",
        num_slots=2,
    )
    engine = ZOEngine(tiny_opt(seed=2, **FLOAT64_TINY), config)
    result = engine.step(batch)
    named = before.named_parameters(remove_duplicate=False)
    initial = {name: p.detach().clone() for name, p in named}

    def z(query):  # every parameter's z for the step's query, by name
        out = {}
        for layout, block_id in buckets_of(engine):
            flat = engine.noise.full(layout.numel, step=0, block_id=block_id, query=query)
            for entry in layout.entries:
                for name in entry.names:
                    out[name] = flat[entry.offset : entry.offset + entry.numel].view(entry.shape)
        return out

    def loss_at(shift):  # the model's own forward, its parameters set to theta + shift
        with torch.no_grad():
            for name, p in reference.named_parameters(remove_duplicate=False):
                p.copy_(initial[name] + shift.get(name, 0.0))
            logits = reference(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            labels = batch["labels"][:, 1:].reshape(-1)  # next-token loss, in float64
            return torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(labels.numel(), -1), labels, ignore_index=-100
            ).item()

    zs = [z(j) for j in range(n)]
    expected = [loss_at({k: eps * v for k, v in zs[j].items()}) for j in range(n)] + [loss_at({})]
    assert result.losses == pytest.approx(expected, rel=1e-12)
    assert result.loss == result.losses[-1]  # FZOO reports L(theta)
    # FZOO's update written out: theta - lr sum_j g_j z_j, g_j = (L_j - L_0) / (N sigma)
    sigma = torch.tensor(result.losses[:n], dtype=torch.float64).std(unbiased=False).item()
    g = [(loss - result.losses[-1]) / (n * sigma) for loss in result.losses[:n]]
    after = engine.named_parameters()
    for name, value in initial.items():
        step = sum(g[j] * zs[j][name] for j in range(n))
        torch.testing.assert_close(after[name], value - lr * step, rtol=0, atol=1e-15)
    assert any(not torch.equal(after[name], initial[name]) for name in initial)


@pytest.mark.parametrize(
    "options, message",
    [
        (
            dict(estimator="fzoo", num_queries=1),
            "estimator fzoo needs num_queries >= 2, got 1: sigma, the spread of its perturbed "
            "losses, is 0 for one; the command line's default for it is 8",
        ),
        (
            dict(estimator="fzoo", num_queries=8, dual_forward=True),
            "dual_forward batches each query's +eps and -eps passes, and fzoo's passes are "
            "one-sided; drop dual_forward (batch_queries batches fzoo's perturbed passes)",
        ),
        (
            dict(estimator="fzoo", num_queries=8, noise="legacy"),
            "noise legacy replays earlier versions' SPSA runs; fzoo draws rademacher (as in "
            "its paper) or gaussian",
        ),
        (dict(estimator="mezo"), "estimator must be one of spsa, fzoo, lozo, got 'mezo'"),
        (
            dict(estimator="lozo", noise="gaussian"),
            "estimator lozo perturbs along low-rank z, got noise gaussian: set noise lowrank "
            "(lozo's only noise; ZOConfig's noise is gaussian whatever the estimator), or use "
            "estimator spsa for gaussian z",
        ),
    ],
)
def test_a_pairing_an_estimator_cannot_honour_is_one_line(options, message):
    """From Python, ZOConfig's noise and num_queries default to gaussian and 1 whatever the
    estimator: "the default of estimator lozo" sent a notebook user after a default that
    ZOConfig does not have."""
    with pytest.raises(ValueError) as refused:
        ZOConfig(device="cpu", **options)
    assert str(refused.value) == message


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(estimator="fzoo", num_queries=1), "is 0 for one; its default is 8$"),
        (dict(estimator="fzoo", num_queries=8, noise="legacy"), r"rademacher \(its default\) or"),
        (dict(estimator="lozo", noise="gaussian"), r"lowrank \(the default of --estimator lozo\)"),
    ],
)
def test_the_command_line_names_the_estimators_own_defaults(options, message):
    """There --noise and --num-queries follow the estimator (``JobConfig.engine_config``)."""
    with named_as_flags(), pytest.raises(ValueError, match=message):
        ZOConfig(device="cpu", **options)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-queries", "1"], "--estimator fzoo needs --num-queries >= 2, got 1"),
        (["--peft", "lora-fa", "--dual-forward"], "drop --dual-forward"),
        (["--noise", "legacy"], "noise legacy replays earlier versions' SPSA runs"),
    ],
)
def test_the_job_refuses_them_before_building_anything(flags, message):
    job = resolve(["--estimator", "fzoo", *flags])
    check_job(job, LaunchEnv())
    with pytest.raises(ValueError, match=message):
        job.engine_config("cpu")


@pytest.mark.parametrize("queries", [2, 8])
def test_fzoo_moves_each_block_once_per_step_and_plans_a_hidden_state_per_pass(queries):
    model = tiny_opt(seed=0, num_hidden_layers=3)
    options = dict(device="cpu", mode="offload", num_slots=2, noise="rademacher")
    fzoo = ZOConfig(estimator="fzoo", num_queries=queries, **options)
    engine = ZOEngine(model, fzoo)
    moved = Counting(engine.store)
    for seed in range(2):
        engine.step(random_batch(model.config.vocab_size, seed=seed))
    assert moved.uploads == {0: 2, 1: 2, 2: 2}  # one upload per block per step, whatever N
    # N + 1 hidden states cross the blocks where SPSA's one query has 2; a pert pair
    # splits them (rank 0 takes the larger share)
    spsa = ZOConfig(**options)
    hidden = model.config.hidden_size * 4 * 12 * 4  # rows x tokens x fp32 bytes
    plan = {
        (name, pert): plan_memory(
            model, config, 1, False, batch=4, seq=12, place=RankPlace(pert=pert)
        )
        for name, config in (("fzoo", fzoo), ("spsa", spsa))
        for pert in (1, 2)
    }
    assert plan["fzoo", 1].activations - plan["spsa", 1].activations == (queries - 1) * hidden
    rank0 = (queries + 2) // 2  # of N + 1 passes, dealt round-robin
    assert plan["fzoo", 2].activations - plan["spsa", 2].activations == (rank0 - 1) * hidden


def test_lozo_is_spsa_along_low_rank_z_and_takes_that_noise_by_default():
    job = resolve(["--estimator", "lozo", "--lozo-rank", "1", "--lozo-interval", "3"])
    config = job.engine_config("cpu")
    assert (config.noise, config.num_queries, config.lozo_rank) == ("lowrank", 1, 1)
    # the same trajectory as SPSA with --noise lowrank: LOZO is that pairing, named
    spsa = resolve(["--noise", "lowrank", "--lozo-rank", "1", "--lozo-interval", "3"])
    paths = []
    for options in (config, spsa.engine_config("cpu")):
        model = tiny_opt(seed=0, num_hidden_layers=2)
        engine = ZOEngine(model, options)
        for step in range(4):  # across a V redraw (interval 3)
            result = engine.step(random_batch(model.config.vocab_size, seed=step))
        engine.flush()
        paths.append((result.projected_grads, engine.named_parameters()))
    (g_lozo, p_lozo), (g_spsa, p_spsa) = paths
    assert g_lozo == g_spsa and all(torch.equal(p_lozo[k], v) for k, v in p_spsa.items())
    with pytest.raises(ValueError, match="estimator lozo perturbs along low-rank z"):
        resolve(["--estimator", "lozo", "--noise", "rademacher"]).engine_config("cpu")


def test_a_diverged_lozo_step_is_described_by_spsas_two_sides():
    from distzo.engine import StepResult
    from distzo.job.divergence import diverged

    nan = float("nan")
    result = StepResult(5, nan, nan, 3.0, nan, 1e-3, 10, (nan,))
    for estimator, noise in (("spsa", "gaussian"), ("lozo", "lowrank")):
        message = str(diverged(result, ZOConfig(estimator=estimator, noise=noise), None))
        assert "(L+ nan, L- 3)" in message and "projected gradient nan" in message, message
    fzoo = str(
        diverged(result, ZOConfig(estimator="fzoo", noise="rademacher", num_queries=2), None)
    )
    assert "L(theta) 3" in fzoo and "update coefficients" in fzoo
