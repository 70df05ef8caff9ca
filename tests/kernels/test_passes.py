"""The Triton passes of the StatNorm engine (normdense/kernels/passes.py, launched by triton.py) against float64 torch: per-(n, c)
moments, y, the coefficient gradients and dx, on odd shapes (HW in {1, 7, 13x17, 1001}; L below, at and just
above a multiple of the vector width V, flat sizes that are and are not a multiple of V), one or several
chunks per row (also with small tiles: many tiles and chunks per row), contiguous and channels_last inputs,
every output allocated NaN-filled, in float64, float32 and half precision."""
import pytest
import torch
import triton

from normdense.kernels import first_stage as F
from normdense.kernels import triton as P
from tests.kernels import passes as K
from normdense.kernels.backend import STATS_BATCH, STATS_ESTIMATE

SHAPES = [(2, 3, 1), (1, 8, 1), (1, 4, 7), (2, 4, 7), (2, 2, 8), (2, 4, 9), (2, 4, 17), (3, 2, 13 * 17),
          (2, 2, 1001)]
# (layout, chunks per row (None: the default choice, up to a chunk per tile), small tiles)
SPLITS = [('ncl', None, False), ('ncl', 1, False), ('ncl', 2, True), ('ncl', 3, True), ('ncl', None, True),
          ('cl', None, False), ('cl', 3, True)]
# small tiles on rows up to a few hundred positions (enough tiles per row; the interpreter stays quick)
CASES = [(shape, *sp) for shape in SHAPES for sp in SPLITS if not (sp[2] and shape[2] > 500)]
IDS = ['x'.join(map(str, shape)) + f'-{layout}-split{s}' + ('-small' if small else '')
       for shape, layout, s, small in CASES]
TOL = {torch.float64: 1e-12, torch.float32: 2e-5}


@pytest.fixture(autouse=True)
def nan_outputs(monkeypatch):
    """Every tensor the launchers allocate starts as NaN: an element a kernel forgets to write shows."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float('nan')) if t.is_floating_point() else t

    def nan_empty_like(*args, **kwargs):
        t = empty_like(*args, **kwargs)
        return t.fill_(float('nan')) if t.is_floating_point() else t

    new_empty = torch.Tensor.new_empty

    def nan_new_empty(self, *args, **kwargs):
        t = new_empty(self, *args, **kwargs)
        return t.fill_(float('nan')) if t.is_floating_point() else t
    monkeypatch.setattr(P.torch, 'empty', nan_empty)
    monkeypatch.setattr(P.torch, 'empty_like', nan_empty_like)
    monkeypatch.setattr(torch.Tensor, 'new_empty', nan_new_empty)


def small_tiles(monkeypatch):
    """Tiles of 64 positions (32 in float64; CL: 16 positions x up to 8 channels): rows of a few hundred
    positions take many tiles and chunks, with chunk starts off the rows' alignment."""
    monkeypatch.setattr(P, '_GEOMETRY', {})  # geometries are kept per shape: these tiles' apart
    monkeypatch.setattr(P, 'block_for', lambda dtype: 32 if dtype == torch.float64 else 64)
    monkeypatch.setattr(P, 'cl_blocks', lambda c, size: (min(triton.next_power_of_2(c), 8), 16))


def laid_out(x, layout):
    """x (N, C, L) as the passes get it: contiguous, or a channels_last map viewed as (N, C, HW)."""
    return x.contiguous() if layout == 'ncl' else x.transpose(1, 2).contiguous().transpose(1, 2)


def moments(x, s):
    part, n_split, chunk = K.moment_partials(x, split=s)
    if s is not None:  # s chunks of whole tiles, or fewer when s does not divide the tiles
        block, length = K.launch_config(x)['BLOCK'], x.shape[2]
        tiles = -(-length // block)
        assert chunk == -(-tiles // min(s, tiles)) * block and n_split == -(-length // chunk) <= s
    return F.stats(part, n_split, chunk, x.shape)[:2]


@pytest.mark.parametrize('shape,layout,s,small', CASES, ids=IDS)
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32, torch.bfloat16])
def test_moments(device, dtype, shape, layout, s, small, monkeypatch):
    if small:
        small_tiles(monkeypatch)
    torch.manual_seed(0)
    x = (torch.randn(shape, dtype=torch.float64) * 3 + 100).to(dtype).to(device)  # mean large against spread
    x[0, 0] = 0.1  # a constant row: v = 0 exactly, as ATen's kernels give
    x = laid_out(x, layout)
    m, v = moments(x, s)
    xd = x.double()
    assert m.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = TOL.get(dtype, 2e-5)
    torch.testing.assert_close(m.double(), xd.mean(2), rtol=tol, atol=0)
    torch.testing.assert_close(v.double(), xd.var(2, unbiased=False), rtol=tol * 100, atol=tol * 100)
    assert v[0, 0] == 0 and m[0, 0] == x[0, 0, 0].to(m.dtype)


def coefficients(n, c, dtype, device, act):
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(2, n, c, generator=g, dtype=torch.float64)
    k, l_ = torch.rand(n, c, generator=g, dtype=torch.float64) + 0.5, torch.randn(n, c, generator=g, dtype=torch.float64)
    coeffs = (a, b) if act is None else (a, b, k, l_)
    return tuple(t.to(dtype).to(device) for t in coeffs)


ACTS = [None, 'relu']


def act_ref(name):
    return {'relu': torch.relu}[name]


@pytest.mark.parametrize('shape,layout,s,small', CASES, ids=IDS)
@pytest.mark.parametrize('act', ACTS)
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_apply_sums_dx(device, dtype, act, shape, layout, s, small, monkeypatch):
    """y, the coefficient gradients and dx of the passes against the formulas of the engine's docstring; y
    and dx in x's layout."""
    from normdense.kernels.activations import act_args
    if small:
        small_tiles(monkeypatch)
    torch.manual_seed(2)
    n, c, length = shape
    x = (torch.randn(shape, dtype=torch.float64) * 2 + 1).to(dtype).to(device)
    dy = laid_out(torch.randn(shape, dtype=torch.float64).to(dtype).to(device), layout)
    x[-1, -1] = -0.7  # constant row: A is taken as 0 there
    x = laid_out(x, layout)
    m, v = moments(x, s)
    coeffs = coefficients(n, c, m.dtype, device, act)
    spec = None if act is None else act_args(act, {})
    y = K.apply(x, m, v, coeffs, spec, split=s)
    grads = K.sums(x, dy, m, v, coeffs, spec, split=s)
    xd, dyd = x.double(), dy.double()
    md, live = m.double().unsqueeze(2), (v > 0).unsqueeze(2)
    a, b = (t.double().unsqueeze(2) for t in coeffs[:2])
    t = xd - md
    z = torch.where(live, a, 0) * t + b
    tol = TOL[dtype]
    if act is None:
        want_y, g = z, dyd
        want = [(g * t).sum(2), g.sum(2)]
    else:
        k, l_ = (t_.double().unsqueeze(2) for t_ in coeffs[2:])
        phi = act_ref(act)
        want_y = k * phi(z) + l_
        zr = z.detach().requires_grad_()
        h, = torch.autograd.grad(phi(zr), zr, dyd)
        g = k * h
        want = [(g * t).sum(2), g.sum(2), (dyd * phi(z)).sum(2), dyd.sum(2)]
    torch.testing.assert_close(y.double(), want_y, rtol=tol, atol=tol)
    assert y.stride() == x.stride()
    assert len(grads) == len(want)
    for got, w in zip(grads, want):
        torch.testing.assert_close(got.double(), w, rtol=tol * 10, atol=tol * 10 * length)
    dm, dv = torch.randn(2, n, c, dtype=torch.float64).to(m.dtype).to(device)
    dx = K.dx(x, dy, m, v, coeffs, dm, dv, grads[1], spec, split=s)
    c0 = (dm.double() - coeffs[0].double() * grads[1].double()).unsqueeze(2) / length
    c1 = torch.where(live, 2 * dv.double().unsqueeze(2) / length, 0)
    want_dx = a * g + c1 * t + c0
    torch.testing.assert_close(dx.double(), want_dx, rtol=tol * 10, atol=tol * 10)
    assert dx.stride() == x.stride()
    # the chunks' partials, added by the kernels that read them: the same values, no merge
    parts = K.sums(x, dy, m, v, coeffs, spec, merged=False, split=s)
    dx_parts = K.dx(x, dy, m, v, coeffs, dm, dv, parts[1], spec, split=s)
    assert all(p.dim() == 3 and p.shape[1:] == (n, c) for p in parts)
    if s is not None:  # the chunks of ``split``, as moments' (sums and dx were given it too)
        assert parts[0].shape[0] == P.split_for(1, length, K.launch_config(x)['BLOCK'], s)[0]
    for got, p in zip(grads, parts):
        torch.testing.assert_close(p.sum(0), got, rtol=tol, atol=tol * length)
    torch.testing.assert_close(dx_parts, dx, rtol=tol, atol=tol)


def reference(x, dy, m, v, coeffs, dm, dv):
    """float64 y, [sum_l g t, sum_l g] and dx (no activation) of the passes' formulas."""
    xd, dyd = x.double(), dy.double()
    t = xd - m.double().unsqueeze(2)
    a, b = (c.double().unsqueeze(2) for c in coeffs)
    y = torch.where((v > 0).unsqueeze(2), a, 0) * t + b
    gsum = dyd.sum(2)
    c0 = (dm.double() - coeffs[0].double() * gsum).unsqueeze(2) / x.shape[2]
    c1 = torch.where((v > 0).unsqueeze(2), 2 * dv.double().unsqueeze(2) / x.shape[2], 0)
    return y, [(dyd * t).sum(2), gsum], a * dyd + c1 * t + c0


def close_in(got, want, dtype):
    """got (dtype) within 2 ulp of want (the interpreter truncates float32 -> bf16)."""
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    assert ((got.double() - want).abs() <= 2 * ulp * want.abs().clamp(min=1e-3) + 1e-6).all()


@pytest.mark.parametrize('layout', ['ncl', 'cl'])
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_half_inputs_read_and_written_in_their_dtype(device, dtype, layout):
    """Half x: float32 moments and coefficients, y and dx in x's dtype and layout, within one rounding of the
    float32 result (the interpreter truncates float32 -> bf16: 2 ulp allowed)."""
    torch.manual_seed(3)
    x = laid_out(torch.randn(2, 8, 13 * 17).to(dtype).to(device), layout)
    dy = laid_out(torch.randn(2, 8, 13 * 17).to(dtype).to(device), layout)
    m, v = moments(x, 2)
    coeffs = coefficients(2, 8, torch.float32, device, None)
    y = K.apply(x, m, v, coeffs)
    dm, dv = torch.randn(2, 2, 8, device=device)
    grads = K.sums(x, dy, m, v, coeffs)
    dx = K.dx(x, dy, m, v, coeffs, dm, dv, grads[1])
    assert y.dtype == dx.dtype == dtype and grads[0].dtype == torch.float32
    assert y.stride() == dx.stride() == x.stride()
    want_y, want_grads, want_dx = reference(x, dy, m, v, coeffs, dm, dv)
    close_in(y, want_y, dtype)
    for got, w in zip(grads, want_grads):
        torch.testing.assert_close(got.double(), w, rtol=2e-5, atol=2e-5 * x.shape[2])
    close_in(dx, want_dx, dtype)


@pytest.mark.parametrize('dy_layout', ['ncl', 'cl'])
@pytest.mark.parametrize('layout', ['ncl', 'cl'])
def test_dy_in_its_own_dtype_and_layout(device, layout, dy_layout):
    """A float32 dy for a bf16 x (autocast's backward) is read as float32, not rounded to bf16 (the sums to
    float32 accuracy), in either layout (taken into x's); dx is bf16 in x's layout."""
    torch.manual_seed(6)
    x = laid_out(torch.randn(2, 8, 13 * 17).to(torch.bfloat16).to(device), layout)
    dy = laid_out((torch.randn(2, 8, 13 * 17) * (1 + 2 ** -12)).to(device), dy_layout)  # not bf16 values
    m, v = moments(x, 2)
    coeffs = coefficients(2, 8, torch.float32, device, None)
    dm, dv = torch.randn(2, 2, 8, device=device)
    grads = K.sums(x, dy, m, v, coeffs, split=2)
    dx = K.dx(x, dy, m, v, coeffs, dm, dv, grads[1], split=2)
    _, want_grads, want_dx = reference(x, dy, m, v, coeffs, dm, dv)
    for got, w in zip(grads, want_grads):
        torch.testing.assert_close(got.double(), w, rtol=1e-5, atol=1e-5)
    assert dx.dtype == torch.bfloat16 and dx.stride() == x.stride()
    close_in(dx, want_dx, torch.bfloat16)


@pytest.mark.parametrize('layout', ['ncl', 'cl'])
@pytest.mark.parametrize('out_dtype', [torch.bfloat16, torch.float16])
def test_float32_x_half_y(device, out_dtype, layout):
    """apply's out_dtype: a half y of a float32 x (computed in float32), in x's layout."""
    torch.manual_seed(7)
    x = laid_out((torch.randn(2, 8, 7 * 9) * 2 + 1).to(device), layout)
    m, v = moments(x, None)
    coeffs = coefficients(2, 8, torch.float32, device, None)
    y = K.apply(x, m, v, coeffs, out_dtype=out_dtype)
    assert y.dtype == out_dtype and y.stride() == x.stride()
    close_in(y, reference(x, x, m, v, coeffs, m, v)[0], out_dtype)


def test_vector_variants(device):
    """The launchers pick the 16-byte vector variant (V = 16 / element size) at every FPN shape (C = 256, N = 1
    or 2, P2-P7) in every dtype and both layouts, with channels_last read as it is (no copy); V = 1 only where
    the flat size (NCL) or C (CL) is not a multiple of V; SMALL for L < V."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        width = 16 // torch.empty(0, dtype=dtype).element_size()
        for n in (1, 2):
            for hw in (200 * 304, 100 * 152, 50 * 76, 25 * 38, 13 * 19, 7 * 10):
                for layout in ('ncl', 'cl'):
                    x = laid_out(torch.empty(n, 256, hw, dtype=dtype, device='meta'), layout)
                    assert P.as_read(x) is x
                    plan = K.launch_config(x, x)
                    want = (width, False, layout == 'cl')
                    assert (plan['V'], plan['SMALL'], plan['CL']) == want, (dtype, n, hw, layout)
    f32 = torch.float32
    assert K.launch_config(torch.empty(1, 8, 1, dtype=f32))['SMALL'] and K.launch_config(torch.empty(1, 8, 1, dtype=f32))['V'] == 4
    assert K.launch_config(torch.empty(2, 3, 1, dtype=f32))['V'] == 1  # 6 elements
    assert K.launch_config(laid_out(torch.empty(2, 6, 5, dtype=f32), 'cl'))['V'] == 1  # C = 6
    assert K.launch_config(torch.empty(2, 8, 5, dtype=torch.bfloat16), torch.empty(2, 8, 5))['V'] == 8  # float32 dy


@pytest.mark.parametrize('layout', ['ncl', 'cl'])
def test_batch_statistics_and_tracking(device, layout):
    """STATS_BATCH: the batch mean / biased variance per channel; the running statistics' new values
    (momentum and cumulative) as nn.BatchNorm tracks them, written only by the apply kernel."""
    torch.manual_seed(4)
    x = laid_out((torch.randn(3, 5, 7 * 9, dtype=torch.float64) * 2 + 3).to(device), layout)
    rm, rv = torch.randn(5, dtype=torch.float64, device=device), torch.rand(5, dtype=torch.float64, device=device) + 1
    nbt = torch.tensor(4, device=device)
    for momentum in (0.1, None):
        part, s, chunk = K.moment_partials(x, split=2)
        m, v, mean, var, _, upd = F.stats(part, s, chunk, x.shape, STATS_BATCH, rm, rv, momentum=momentum,
                                          write=True, nbt=nbt)
        flat = x.transpose(0, 1).reshape(5, -1)
        torch.testing.assert_close(mean, flat.mean(1), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(var, flat.var(1, unbiased=False), rtol=1e-12, atol=1e-12)
        w = 0.1 if momentum else 1 / 5
        torch.testing.assert_close(upd[0], rm + w * (flat.mean(1) - rm), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(upd[1], rv + w * (flat.var(1) - rv), rtol=1e-12, atol=1e-12)
    before = rm.clone()
    y = K.apply(x, m, v, coefficients(3, 5, torch.float64, device, None), write=(upd, rm, rv), nbt=nbt)
    assert torch.isfinite(y).all() and nbt.item() == 5
    torch.testing.assert_close(rm, upd[0], rtol=0, atol=0)
    torch.testing.assert_close(rv, upd[1], rtol=0, atol=0)
    assert not torch.equal(rm, before)


def test_estimate_statistics(device):
    """STATS_ESTIMATE: Algorithm 1 steps 1-4 (arXiv:1903.10520) from the estimates: batch mean, second moment
    around the estimate, both moved by r; the starting estimates copied into base when the call writes."""
    torch.manual_seed(5)
    x = (torch.randn(2, 6, 11, dtype=torch.float64) + 2).to(device)
    rm, rv = torch.randn(6, dtype=torch.float64, device=device), torch.rand(6, dtype=torch.float64, device=device) + 1
    base = torch.empty(2, 6, dtype=torch.float64, device=device)
    part, s, chunk = K.moment_partials(x)
    m, v, mean, var, moved, upd = F.stats(part, s, chunk, x.shape, STATS_ESTIMATE, rm, rv, base, rate=0.3,
                                          write=True)
    flat = x.transpose(0, 1).reshape(6, -1)
    mu, second = flat.mean(1), ((flat - rm[:, None]) ** 2).mean(1)
    torch.testing.assert_close(moved, torch.stack([mu, second]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mean, rm + 0.3 * (mu - rm), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(var, rv + 0.3 * (second - rv), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(upd, torch.stack([mean, var]))
    torch.testing.assert_close(base, torch.stack([rm, rv]))
    # a later call of the iteration reads base instead of the buffers
    rm2 = rm + 5
    _, _, mean2, _, _, upd2 = F.stats(part, s, chunk, x.shape, STATS_ESTIMATE, rm2, rv, base, rate=0.3)
    torch.testing.assert_close(mean2, mean) and upd2 is None
