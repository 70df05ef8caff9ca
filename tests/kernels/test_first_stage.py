"""The first stage's device functions (normdense/kernels/first_stage.py, through its standalone stats kernel)
against the ATen backend's torch first stage in float64, at sizes where the samples take several [BLOCK_N,
BLOCK_C] tiles and the channels several programs: every mode, with and without writing the buffers."""
import pytest
import torch

from normdense.kernels import first_stage as F
from normdense.kernels import aten
from normdense.kernels.aten import AtenBackend
from normdense.kernels.backend import STATS_BATCH, STATS_ESTIMATE, STATS_FIXED, STATS_NONE, StatsRequest
from normdense.layers import BatchChannelNorm2d, GroupProxyNorm, Unitization2d


def _aten(x, mode=STATS_NONE, stat_mean=None, stat_var=None, base=None, **kw):
    """(m, v, mean, var, moved, write) of the ATen backend's first stage of x; ``write(running_mean, running_var)``
    moves those buffers in place as the backend's apply does (``aten._write``)."""
    stats = AtenBackend.first_stage(x, StatsRequest(mode, stat_mean, stat_var, base, **kw))[1]

    def write(running_mean, running_var):
        request = stats.request._replace(stat_mean=running_mean, stat_var=running_var)
        aten._write(stats._replace(request=request), x.shape)
    return stats.m, stats.v, stats.mean, stats.var, stats.moved, write


def _values(upd, running_mean, running_var):
    """The buffers' new values from the ATen backend's writer (moving copies of them in place)."""
    rm, rv = running_mean.clone(), running_var.clone()
    upd(rm, rv)
    return torch.stack([rm, rv])


@pytest.mark.parametrize('mode,momentum,write', [
    (STATS_NONE, 0.1, False), (STATS_FIXED, 0.1, False), (STATS_ESTIMATE, 0.1, False),
    (STATS_ESTIMATE, 0.1, True), (STATS_BATCH, 0.1, False), (STATS_BATCH, 0.1, True), (STATS_BATCH, None, True)])
def test_stats_equal_aten(device, mode, momentum, write):
    torch.manual_seed(0)
    n, c, length = 11, 136, 5  # BLOCK_N = 4 at C = 136: three sample tiles, the last partial; two channel programs
    assert F.stat_blocks(c) == (4, 128)
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
    abase = base.clone()  # the reference on the CPU tensors
    want = _aten(x, base=abase, **dict(kw, stat_mean=stat_mean, stat_var=stat_var, nbt=nbt))
    for name, g, w in zip(['m', 'v', 'mean', 'var', 'moved'], got[:5], want[:5]):
        assert (g is None) == (w is None), name
        if g is not None:
            torch.testing.assert_close(g.cpu(), w, rtol=1e-12, atol=1e-12, msg=name)
    if write:
        torch.testing.assert_close(got[5].cpu(), _values(want[5], stat_mean, stat_var), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tbase.cpu(), abase, rtol=0, atol=0)


def _partials(x, chunk):
    """The moments kernel's partials of x (N, C, L) in chunks of ``chunk`` positions, from torch: (part, split,
    chunk) with part (split, 2, N*C) = each chunk's mean and centred sum of squares."""
    n, c, length = x.shape
    parts = []
    for s in range(0, length, chunk):
        xs = x[:, :, s:s + chunk]
        mu = xs.mean(2)
        parts.append(torch.stack([mu, (xs - mu[..., None]).pow(2).sum(2)]).view(2, n * c))
    return torch.stack(parts), len(parts), chunk


LAYERS = {  # C = 128 at N = 9: the map kernels take several sample blocks (BCN 4, Unitization 8), the first
    # stage three sample tiles (4)
    'bcn-estimate': (lambda: BatchChannelNorm2d(128, 16, mode='estimate'), STATS_ESTIMATE),
    'bcn-batch': (lambda: BatchChannelNorm2d(128, 16, mode='batch'), STATS_BATCH),
    'bcn-eval': (lambda: BatchChannelNorm2d(128, 16, mode='batch'), STATS_FIXED),
    'gnpn-relu': (lambda: GroupProxyNorm(128, 16), STATS_NONE),
    'unitization-batch': (lambda: Unitization2d(128), STATS_BATCH),
    'unitization-estimate': (lambda: Unitization2d(128, mode='estimate'), STATS_ESTIMATE),
}


@pytest.mark.parametrize('write', [True, False])
@pytest.mark.parametrize('name', sorted(LAYERS))
def test_first_stage_folded_into_the_map(device, name, write):
    """A layer's Triton map with the first stage folded in (``first=``: every program computes its own channels'
    statistics over all samples and writes m, v of its own samples; one program per channel writes moved,
    upd and base) against the ATen first stage followed by the layer's torch map, float64."""
    from normdense.kernels import bcn, unitization
    assert bcn._blocks(9, 128, 16)[2] == 4 and unitization._blocks(128)[0] == 8 and F.stat_blocks(128)[0] == 4
    make, mode = LAYERS[name]
    torch.manual_seed(1)
    layer = make().double()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    params = tuple(p.to(device) for p in layer._statnorm_params())
    n, c, length = 9, 128, 5
    x = torch.randn(n, c, length, dtype=torch.float64) * 2 + 1
    stat_mean, stat_var = torch.randn(c, dtype=torch.float64), torch.rand(c, dtype=torch.float64) + 0.5
    base = torch.stack([torch.randn(c, dtype=torch.float64), torch.rand(c, dtype=torch.float64) + 0.5])
    write = write and mode in (STATS_ESTIMATE, STATS_BATCH)
    kw = dict(rate=0.3, momentum=0.1, write=write, nbt=torch.tensor(2).to(device))
    part, split, chunk = _partials(x, 3)
    tbase = base.clone().to(device)
    first = F.FirstStage(part.to(device), split, chunk, x.shape, mode, stat_mean.to(device), stat_var.to(device),
                        tbase, **kw)
    count = n * length if mode == STATS_BATCH else None
    m, v, mean, var, moved, upd = first.outputs
    got = layer._coeff_maps(True)[0](m, v, mean, var, params, length, count, first=first)[0]
    abase = base.clone()
    want_stats = _aten(x, mode, stat_mean, stat_var, abase, **{**kw, 'nbt': torch.tensor(2)})
    wm, wv, wmean, wvar = want_stats[:4]
    want = layer._coeff_maps(False)[0](wm, wv, wmean, wvar, tuple(p.cpu() for p in params), length, count)[0]
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-10, atol=1e-10, msg=f'coefficient {i}')
    for name_, g, w in zip(["m", "v", "mean", "var", "moved"], first.outputs[:5], want_stats[:5]):
        if w is not None:
            torch.testing.assert_close(g.cpu(), w, rtol=1e-12, atol=1e-12, msg=name_)
    if write:
        torch.testing.assert_close(upd.cpu(), _values(want_stats[5], stat_mean, stat_var), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tbase.cpu(), abase, rtol=0, atol=0)
