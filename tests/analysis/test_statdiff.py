import math

import pytest
import torch
import torch.nn.functional as F

from normdense.analysis import statdiff, statdiff_from_moments


def eq35(means, stds):
    """Eq. 35 of the WS/BCN paper for one group, plain Python."""
    k = len(means)
    e_mu2 = sum(m * m for m in means) / k
    e_mu = sum(means) / k
    return math.sqrt(e_mu2 - e_mu ** 2) / (sum(stds) / k)


def test_matches_eq35_per_group():
    means = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, 1.5])
    stds = torch.tensor([1.0, 2.0, 0.5, 1.5, 1.0, 3.0])
    got = statdiff_from_moments(means, stds, num_groups=2)
    expected = [eq35(means[:3].tolist(), stds[:3].tolist()), eq35(means[3:].tolist(), stds[3:].tolist())]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_zero_for_bn_normalized_features():
    torch.manual_seed(0)
    x = torch.randn(8, 16, 6, 6) * torch.rand(1, 16, 1, 1) * 5 + torch.randn(1, 16, 1, 1) * 3
    y = F.batch_norm(x, None, None, training=True)
    assert statdiff(y, num_groups=4).abs().max() < 1e-6
    assert statdiff(y, num_groups=1).abs().max() < 1e-6


def test_positive_for_imbalanced_groups():
    """Crafted: group 0's channels share their statistics; group 1's channel means differ a lot."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, 10, 10, dtype=torch.float64)
    x[:, 4:] += torch.tensor([0.0, 3.0, -3.0, 6.0], dtype=torch.float64).view(1, 4, 1, 1)
    sd = statdiff(x, num_groups=2)
    assert sd[0] < 0.05
    assert sd[1] > 2.0  # std of the means (~3.35) over mean std (~1)
    # Eq. 35 from the same features directly
    means = x.mean((0, 2, 3))[4:].tolist()
    stds = x.transpose(0, 1).reshape(8, -1).std(1, correction=0)[4:].tolist()
    assert abs(sd[1].item() - eq35(means, stds)) < 1e-10


@pytest.mark.parametrize('groups', [0, 3, -1, 2.0])
def test_bad_groups(groups):
    with pytest.raises(ValueError, match='num_groups'):
        statdiff(torch.randn(2, 8, 3, 3), num_groups=groups)
