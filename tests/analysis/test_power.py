import torch
import torch.nn.functional as F

from normdense.analysis import POWER_TERMS, power_decomposition, power_summary


def literal_terms(y, c):
    """Eq. 5 of the PN paper for channel c, with explicit loops over inputs x and positions alpha."""
    N = y.shape[0]
    mus, sigmas = [], []
    for x in range(N):
        vals = y[x, c].flatten().tolist()
        m = sum(vals) / len(vals)
        mus.append(m)
        sigmas.append((sum((v - m) ** 2 for v in vals) / len(vals)) ** 0.5)
    mean = lambda a: sum(a) / len(a)  # noqa: E731
    var = lambda a: mean([t * t for t in a]) - mean(a) ** 2  # noqa: E731
    return [mean(mus) ** 2, var(mus), mean(sigmas) ** 2, var(sigmas)]


def test_terms_match_eq5_and_sum_to_power():
    torch.manual_seed(0)
    y = torch.randn(5, 3, 4, 4, dtype=torch.float64) * torch.rand(5, 3, 1, 1) + torch.randn(5, 3, 1, 1)
    terms = power_decomposition(y)
    for c in range(3):
        got = [terms[k][c].item() for k in POWER_TERMS]
        for g, e in zip(got, literal_terms(y, c)):
            assert abs(g - e) < 1e-10
    torch.testing.assert_close(terms['power'], (y ** 2).mean((0, 2, 3)), rtol=1e-12, atol=1e-12)


def test_bn_in_and_collapse_signatures():
    torch.manual_seed(0)
    x = torch.randn(16, 8, 6, 6) * torch.rand(1, 8, 1, 1) * 4 + torch.randn(16, 8, 1, 1)
    bn = power_summary(power_decomposition(F.batch_norm(x, None, None, training=True)))
    assert abs(bn['power'] - 1) < 1e-4 and bn['channel_imbalance'] < 1e-3  # PN paper Prop. 1, balanced
    assert abs(sum(bn[f'{k}_frac'] for k in POWER_TERMS) - 1) < 1e-9
    inorm = power_decomposition(F.instance_norm(x))
    # IN (PN paper Theorem 2): instance means 0 and stds 1 for every input -> no inter-x variability
    assert inorm['instance'].max() < 1e-10 and inorm['pixel_variability'].max() < 1e-8
    collapsed = torch.full((6, 2, 3, 3), 2.0)  # constant channel: all power at the dataset scale
    summary = power_summary(power_decomposition(collapsed))
    assert abs(summary['dataset_frac'] - 1) < 1e-12
