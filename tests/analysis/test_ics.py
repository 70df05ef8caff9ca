import pytest
import torch

from normdense.analysis import em_distance, f_nC, feature_samples, ics_moment_bound, wasserstein_1d


def test_wasserstein_1d_exact():
    a = torch.randn(50, 3, dtype=torch.float64)
    b = torch.randn(50, 3, dtype=torch.float64) * 2 + 1
    # equal sizes: mean distance of the sorted samples
    expected = (a.sort(0).values - b.sort(0).values).abs().mean(0)
    torch.testing.assert_close(wasserstein_1d(a, b), expected, rtol=1e-12, atol=1e-12)
    # unequal sizes, known values
    torch.testing.assert_close(wasserstein_1d(torch.tensor([0.0]), torch.tensor([0.0, 1.0])),
                               torch.tensor([0.5], dtype=torch.float64))
    torch.testing.assert_close(wasserstein_1d(torch.tensor([0.0, 1.0, 2.0]), torch.tensor([1.0, 5.0])),
                               torch.tensor([2.0], dtype=torch.float64))  # integral |F_a - F_b|
    # translation
    c = torch.randn(37, 1, dtype=torch.float64)
    torch.testing.assert_close(wasserstein_1d(c, c + 0.7), torch.tensor([0.7], dtype=torch.float64))


def f_literal(x, n, C):
    """Eq. 7 for one sample x (list of d numbers)."""
    d = len(x)
    total = 0.0
    for xi in x:
        if abs(xi) <= C:
            total += xi ** n
        elif xi < -C:
            total += (-C) ** n
        else:
            total += C ** n
    return total / (n * C ** (n - 1) * d ** 0.5)


@pytest.mark.parametrize('n', [2, 3, 4])
def test_f_nC_matches_eq7(n):
    x = torch.randn(5, 4, dtype=torch.float64) * 2
    got = f_nC(x, n, 1.5)
    expected = torch.tensor([f_literal(row.tolist(), n, 1.5) for row in x], dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_moment_bound_is_a_lower_bound():
    g = torch.Generator().manual_seed(0)
    # 1-D: the exact EM distance of the empirical distributions is known
    for _ in range(5):
        a = torch.randn(300, 1, generator=g, dtype=torch.float64) * 1.5
        b = torch.randn(200, 1, generator=g, dtype=torch.float64) ** 3
        w = wasserstein_1d(a, b).item()
        for n in (2, 3, 4):
            for C in (None, 0.5, 3.0):
                assert 0 <= ics_moment_bound(a, b, n=n, C=C) <= w + 1e-12
    # d-dim translation by delta: the EM distance is ||delta||
    x = torch.randn(400, 6, generator=g, dtype=torch.float64)
    delta = torch.tensor([1.0, -2.0, 0.5, 0.0, 0.3, 1.0], dtype=torch.float64)
    for n in (2, 3, 4):
        assert ics_moment_bound(x + delta, x, n=n) <= delta.norm().item()
    assert ics_moment_bound(x, x.clone()) == 0.0


def test_em_distance_estimators():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, 4, generator=g, dtype=torch.float64)
    delta = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    marginal = em_distance(x + delta, x)
    assert abs(marginal - delta.abs().mean().item()) < 1e-9           # each marginal is shifted by |delta_i|
    assert abs(em_distance(x + delta, x, reduction='max') - 2.0) < 1e-9
    sliced = em_distance(x + delta, x, method='sliced', num_projections=256, generator=g)
    assert 0 < sliced <= delta.norm().item()                          # lower bound of the joint distance
    assert em_distance(x, x.clone()) == 0.0
    with pytest.raises(ValueError, match='method'):
        em_distance(x, x, method='critic')
    with pytest.raises(ValueError, match='same d'):
        em_distance(x, x[:, :3])


def test_feature_samples_and_bad_orders():
    x = torch.arange(2 * 3 * 2 * 2, dtype=torch.float32).view(2, 3, 2, 2)
    s = feature_samples(x)
    assert s.shape == (8, 3) and s[1].tolist() == x[0, :, 0, 1].tolist()
    assert feature_samples(x, max_samples=5).shape == (5, 3)
    with pytest.raises(ValueError, match='n >= 2'):
        f_nC(s, 1, 1.0)
    with pytest.raises(ValueError, match='C > 0'):
        f_nC(s, 2, 0.0)
