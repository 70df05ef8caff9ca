"""The first stage's device functions (normdense/kernels/first_stage.py, through its standalone stats kernel)
against the ATen backend's torch first stage in float64, at sizes where the samples take several [BLOCK_N,
BLOCK_C] tiles and the channels several programs: every mode, with and without writing the buffers."""
import pytest
import torch

from normdense.kernels import first_stage as F
from normdense.kernels.aten import STATS_BATCH, STATS_ESTIMATE, STATS_FIXED, STATS_NONE, AtenBackend


def _values(upd, running_mean, running_var):
    """The buffers' new values from the ATen backend's writer (a closure moving them in place)."""
    rm, rv = running_mean.clone(), running_var.clone()
    upd(rm, rv)
    return torch.stack([rm, rv])


@pytest.mark.parametrize('mode,momentum,write', [
    (STATS_NONE, 0.1, False), (STATS_FIXED, 0.1, False), (STATS_ESTIMATE, 0.1, False),
    (STATS_ESTIMATE, 0.1, True), (STATS_BATCH, 0.1, False), (STATS_BATCH, 0.1, True), (STATS_BATCH, None, True)])
def test_stats_equal_aten(device, mode, momentum, write):
    torch.manual_seed(0)
    n, c, length = 11, 136, 5  # BLOCK_N = 8 at C = 136: two sample tiles, the second partial; two channel programs
    assert F.stat_blocks(c) == (8, 128)
    x = torch.randn(n, c, length, dtype=torch.float64) * 2 + 5
    stat_mean, stat_var = torch.randn(c, dtype=torch.float64), torch.rand(c, dtype=torch.float64) + 0.5
    base = torch.stack([torch.randn(c, dtype=torch.float64), torch.rand(c, dtype=torch.float64) + 0.5])
    nbt = torch.tensor(4)
    # one chunk per row: the moments kernel's partials, (mean, centred sum of squares), from torch
    mu = x.mean(2)
    part = (torch.stack([mu, (x - mu[..., None]).pow(2).sum(2)]).view(1, 2, n * c).to(device), 1, length)
    kw = dict(mode=mode, stat_mean=stat_mean.to(device), stat_var=stat_var.to(device), rate=0.3,
              momentum=momentum, write=write, nbt=nbt.to(device))
    tbase = base.clone().to(device)
    got = F.stats(*part, x.shape, base=tbase, **kw)
    abase = base.clone()
    want = AtenBackend.stats(AtenBackend.moments(x), x.shape, base=abase, **kw)
    for name, g, w in zip(['m', 'v', 'mean', 'var', 'moved'], got[:5], want[:5]):
        assert (g is None) == (w is None), name
        if g is not None:
            torch.testing.assert_close(g.cpu(), w, rtol=1e-12, atol=1e-12, msg=name)
    if write:
        torch.testing.assert_close(got[5].cpu(), _values(want[5], stat_mean, stat_var), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tbase.cpu(), abase, rtol=0, atol=0)
