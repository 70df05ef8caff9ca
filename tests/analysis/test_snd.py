import pytest
import torch
import torch.nn as nn

from normdense.analysis import batch_standardize, module_snd, snd


def test_bn_snd_falls_as_batch_grows():
    """IterNorm paper Fig. 5a trend: Gaussian data of dimension 128, BN's SND decreases with the batch size."""
    g = torch.Generator().manual_seed(0)
    data = torch.randn(3000, 128, generator=g, dtype=torch.float64)
    values = [snd(batch_standardize, data, b, num_points=20, num_draws=10, generator=g) for b in (4, 16, 64, 256)]
    assert all(a > b for a, b in zip(values, values[1:])), values
    assert values[0] > 3 * values[-1]


def test_batch_independent_normalization_has_zero_snd():
    g = torch.Generator().manual_seed(0)
    data = torch.randn(500, 32, generator=g, dtype=torch.float64)

    def layer_norm(batch):  # per-sample statistics only
        return (batch - batch.mean(1, keepdim=True)) / batch.std(1, keepdim=True)

    assert snd(layer_norm, data, 8, num_points=5, num_draws=4, generator=g) < 1e-12


def test_eq10_estimator():
    """norm_fn = subtract the batch mean. With batch size 2 the output for x is (x - y) / 2 for the drawn
    partner y; each x has two equally likely partners, whose outputs lie D = |y1 - y2| / 2 apart, so
    Eq. 9 is D / 2: 0.5, 1.0 and 0.5 for the three points, 2/3 on average."""
    data = torch.tensor([[0.0], [2.0], [4.0]], dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    value = snd(lambda b: b - b.mean(0, keepdim=True), data, 2, num_points=3, num_draws=400, generator=g)
    assert abs(value - 2 / 3) < 0.02


def test_module_snd_bn_vs_gn_and_buffers_untouched():
    torch.manual_seed(0)
    samples = torch.randn(400, 16)
    bn = nn.BatchNorm2d(16)
    gn = nn.GroupNorm(4, 16)
    before = bn.running_mean.clone()
    assert module_snd(bn, samples, 4, num_points=8, num_draws=6) > 0.5
    assert bn.running_mean.equal(before) and bn.training
    assert module_snd(gn, samples, 4, num_points=8, num_draws=6) < 1e-5


def test_bad_arguments():
    data = torch.randn(10, 3)
    with pytest.raises(ValueError, match='batch_size'):
        snd(batch_standardize, data, 11)
    with pytest.raises(ValueError, match='num_draws'):
        snd(batch_standardize, data, 2, num_draws=1)
    with pytest.raises(ValueError, match='pool'):
        snd(batch_standardize, torch.randn(10), 2)
