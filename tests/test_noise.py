import pytest
import torch

from distzo.zo import NoiseSource, noise_seed


def test_seed_is_a_pure_function_of_its_coordinates():
    assert noise_seed(7, 3, 2, 1) == noise_seed(7, 3, 2, 1)
    seeds = {noise_seed(7, s, b, c) for s in range(4) for b in range(4) for c in range(4)}
    assert len(seeds) == 64
    assert all(0 <= s < 2**63 for s in seeds)
    # query 0 is the single-direction draw; every other query is a fresh coordinate
    assert noise_seed(7, 3, 2, 1, query=0) == noise_seed(7, 3, 2, 1)
    queries = {noise_seed(7, 3, 2, 1, query=q) for q in range(8)}
    assert len(queries | seeds) == 64 + 7


def test_a_chunk_does_not_depend_on_the_range_asked_for():
    src = NoiseSource(run_seed=5, chunk=10, device=torch.device("cpu"), dtype=torch.float32)
    full = src.full(35, step=2, block_id=1)
    for start, stop in [(0, 35), (3, 17), (10, 20), (31, 35), (9, 11)]:
        pieces = [(lo, hi, z.clone()) for lo, hi, z in src.chunks(start, stop, 35, 2, 1)]
        assert pieces[0][0] == start and pieces[-1][1] == stop
        got = torch.cat([z for _, _, z in pieces])
        assert torch.equal(got, full[start:stop])
    assert not torch.equal(full, src.full(35, step=3, block_id=1))
    assert not torch.equal(full, src.full(35, step=2, block_id=2))


def test_noise_is_standard_normal():
    z = NoiseSource(0, 1 << 12, torch.device("cpu"), torch.float64).full(200_000, 0, 0)
    assert abs(z.mean().item()) < 0.01
    assert abs(z.std().item() - 1) < 0.01


def test_perturb_and_update_follow_the_mezo_formulas():
    src = NoiseSource(3, chunk=16, device=torch.device("cpu"), dtype=torch.float64)
    theta = torch.randn(50, dtype=torch.float64)
    z = src.full(50, step=4, block_id=9)
    out = torch.empty(64, dtype=torch.float64)
    src.perturb_into(out, theta, -1e-3, step=4, block_id=9)
    torch.testing.assert_close(out[:50], theta - 1e-3 * z, rtol=0, atol=1e-15)
    src.perturb_into(out, theta, 0.0, step=4, block_id=9)
    assert torch.equal(out[:50], theta)

    lr, g, wd, decay_end = 0.1, 2.5, 0.01, 20
    updated = theta.clone()
    src.apply_update(updated, decay_end, lr, (g,), wd, step=4, block_id=9)
    expected = theta - lr * g * z
    expected[:decay_end] -= lr * wd * theta[:decay_end]
    torch.testing.assert_close(updated, expected, rtol=1e-13, atol=1e-15)


def test_a_multi_query_update_averages_the_directions():
    src = NoiseSource(3, chunk=16, device=torch.device("cpu"), dtype=torch.float64)
    theta = torch.randn(50, dtype=torch.float64)
    zs = [src.full(50, step=4, block_id=9, query=q) for q in range(3)]
    assert not torch.equal(zs[0], zs[1]) and not torch.equal(zs[1], zs[2])
    assert torch.equal(zs[0], src.full(50, step=4, block_id=9))
    out = torch.empty(50, dtype=torch.float64)
    src.perturb_into(out, theta, 1e-3, step=4, block_id=9, query=2)
    torch.testing.assert_close(out, theta + 1e-3 * zs[2], rtol=0, atol=1e-15)

    lr, grads, wd, decay_end = 0.1, (2.5, -1.0, 0.25), 0.01, 20
    updated = theta.clone()
    src.apply_update(updated, decay_end, lr, grads, wd, step=4, block_id=9)
    expected = theta - lr * sum(g * z for g, z in zip(grads, zs)) / 3
    expected[:decay_end] -= lr * wd * theta[:decay_end]  # decay once, not once per query
    torch.testing.assert_close(updated, expected, rtol=1e-13, atol=1e-15)


def test_bad_ranges_and_chunks_are_refused():
    with pytest.raises(ValueError, match="chunk"):
        NoiseSource(0, 0, torch.device("cpu"), torch.float32)
    src = NoiseSource(0, 4, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="outside"):
        list(src.chunks(0, 9, 8, 0, 0))
