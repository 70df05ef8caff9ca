"""BCN, GN+PN and Unitization on the Triton backend against the ATen backend (the fused engine path the layer
tests hold to the reference compositions): outputs, input and parameter gradients and buffers over several
training steps, a shared layer, eval; at most 6 launches per training step; the backend switch; the
fallback to ATen when a kernel fails to compile."""
import copy
import functools
import warnings

import pytest
import torch

from normdense.kernels import backend as B
from normdense.kernels import triton as P
from normdense.layers import BatchChannelNorm2d, Unitization2d
from tests.kernels.conftest import INTERPRETED
from tests.kernels.launches import count_launches
from tests.layers.test_fused import CASES, C, assert_same, make, run

def force_split(monkeypatch, split):
    """The Triton backend's passes given ``split`` chunks per row (their keyword); returns the list of the
    chunks per row each moments launch then took."""
    seen = []
    moments = P._moment_partials

    def moment_partials(x3, cl, _split=None, key=None):
        part = moments(x3, cl, split, key)
        seen.append(part[1].grid[1])
        return part
    monkeypatch.setattr(P, '_moment_partials', moment_partials)
    for name in ('_apply', '_sums', '_dx'):  # what TritonBackend calls
        monkeypatch.setattr(P, name, functools.partial(getattr(P, name), split=split))
    return seen


def pair(name, dtype=torch.float64, device='cpu'):
    aten, _ = make(name, dtype)
    tri = copy.deepcopy(aten)
    aten.backend, tri.backend = 'aten', 'triton'
    return tri.to(device), aten.to(device)


@pytest.mark.parametrize('split', [None, 1])
@pytest.mark.parametrize('name', sorted(CASES))
def test_triton_equals_aten_over_training_steps(device, name, split, monkeypatch):
    """float64: three training steps (HW 1 to 1001; the first and last with a layer shared by two inputs, an FPN
    head), then eval; the Triton kernels really ran (launches counted). Rows in chunks of a tile (the default
    here: 1001 positions in 2 chunks) or in one chunk (``split`` 1)."""
    seen = force_split(monkeypatch, split)
    tri, aten = pair(name, device=device)
    for i, shapes in enumerate([[(3, C, 5, 6), (1, C, 1, 3)], [(2, C, 13, 17)], [(2, C, 1, 1), (1, C, 7, 143)]]):
        torch.manual_seed(10 + i)
        xs = [(torch.randn(s, dtype=torch.float64) * 2 + 1).to(device) for s in shapes]
        with count_launches() as n:
            got = run(tri, xs)
        assert n['triton'] >= 6 * len(xs), n['names']
        assert_same(got, run(aten, xs))
        for layer in (tri, aten):
            with torch.no_grad():
                for p in layer.parameters():
                    p.sub_(0.1 * p.grad)
                    p.grad = None
    assert max(seen) == (2 if split is None else 1), seen
    tri.eval(), aten.eval()
    x = (torch.randn(2, C, 4, 4, dtype=torch.float64) - 0.5).to(device)
    assert_same(run(tri, [x]), run(aten, [x]))
    with torch.no_grad():
        torch.testing.assert_close(tri(x), aten(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('name', sorted(CASES))
def test_at_most_6_launches_per_training_step(device, name, dtype, monkeypatch):
    """Forward + backward of one training call: Triton launches plus any other operator (each a launch on a
    GPU) <= 6, with rows split into chunks: moments, the map with the first stage folded in, apply; sums,
    the VJP adding the chunks' sums as it loads them, dx. In bf16 too (``model.bfloat16()``: the parameter
    gradients are written in the parameters' dtype, no cast)."""
    tri, _ = pair(name, dtype, device)
    x = torch.randn(2, C, 40, 80, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(2, C, 40, 80, device=device, dtype=dtype)
    tri(x).backward(dy)  # the first call of an estimate layer opens its iteration; caches warm
    for t in [x, *tri.parameters()]:
        t.grad = None
    with monkeypatch.context() as mp:
        seen = force_split(mp, 2)  # 2 chunks of 2 tiles (the default: 4 of one)
        with count_launches() as n:
            tri(x).backward(dy)
    assert seen == [2], seen
    total = n['triton'] + n['aten']
    assert total <= 6, f"{name}: {total} launches ({n['names']} + ATen {n['ops']})"
    assert all(p.grad.dtype == p.dtype for p in tri.parameters() if p.requires_grad)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize('name', ['bcn-estimate', 'bcn-batch', 'gnpn-relu', 'unitization-batch'])
def test_float32_and_half(device, name, dtype):
    """float32 parameters, x in float32 / bf16 / fp16 (as under autocast): the Triton and ATen backends agree
    within the input dtype's rounding."""
    tri, aten = pair(name, torch.float32, device)
    torch.manual_seed(7)
    x = (torch.randn(2, C, 9, 11, device=device) * 2 + 1).to(dtype)
    a, b = run(tri, [x]), run(aten, [x])
    tol = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    assert a['outs'][0].dtype == b['outs'][0].dtype and a['xgrads'][0].dtype == dtype
    assert_same(a, b, rtol=tol, atol=tol)


def test_activation_checkpoint_recomputation(device):
    """An estimate-mode layer under torch.utils.checkpoint: the recomputation repeats the forward's values and
    moves nothing, on the Triton backend as on ATen."""
    tri, aten = pair('bcn-estimate', device=device)
    x = (torch.randn(2, C, 5, 5, dtype=torch.float64) + 1).to(device)
    results = []
    for layer in (tri, aten):
        xi = x.clone().requires_grad_()
        y = torch.utils.checkpoint.checkpoint(layer, xi, use_reentrant=False)
        (y * y).sum().backward()
        results.append((y.detach(), xi.grad, layer.running_mean.clone(), layer.running_var.clone()))
    for u, v in zip(*results):
        torch.testing.assert_close(u, v, rtol=1e-10, atol=1e-10)


# --- the switch -------------------------------------------------------------------------------------------------
def test_backend_choice(monkeypatch):
    from normdense.layers.bcn import BatchChannelNorm2d
    x = torch.randn(1, 8, 2, 2)
    layer = BatchChannelNorm2d(8, 4)
    monkeypatch.delenv(B.ENV, raising=False)
    assert B.selected_backend(layer, x) == 'aten'  # auto: Triton for CUDA tensors only
    monkeypatch.setenv(B.ENV, 'triton')
    monkeypatch.setattr(B, 'interpreted', lambda: True)
    assert B.selected_backend(layer, x) == 'triton'  # under the interpreter, CPU tensors too
    monkeypatch.setattr(B, 'interpreted', lambda: False)
    with pytest.raises(RuntimeError, match="backend='triton' runs on CUDA tensors"):
        B.selected_backend(layer, x)
    layer.backend = 'aten'  # the layer's option wins over the environment
    assert B.selected_backend(layer, x) == 'aten'
    layer.backend = None
    monkeypatch.setenv(B.ENV, 'cuda')
    with pytest.raises(ValueError, match='NORMDENSE_BACKEND=.cuda.: choose one of auto|aten|triton'):
        B.selected_backend(layer, x)
    with pytest.raises(ValueError, match='backend must be one of'):
        BatchChannelNorm2d(8, 4, backend='gpu')
    monkeypatch.setenv(B.ENV, 'auto')
    monkeypatch.setattr(B, '_STATE', {'triton': 'triton does not import (ImportError: x)', 'broken': None})
    layer.backend = 'triton'
    with pytest.raises(RuntimeError, match="backend='triton' needs triton: triton does not import"):
        B.selected_backend(layer, x)


@pytest.mark.parametrize('x_dtype', [torch.float64, torch.float32])
@pytest.mark.parametrize('where', ['forward', 'backward'])
@pytest.mark.parametrize('name', ['bcn-estimate', 'unitization-batch'])
def test_compile_failure_falls_back_to_aten_with_one_warning(device, name, where, x_dtype, monkeypatch):
    """Under 'auto' (simulated for these tensors): a kernel that does not compile -> one RuntimeWarning, the
    ATen backend for the call and the rest of the process; the state moves exactly once; a forced 'triton'
    raises instead. float32 x with the float64 layer: x converted for the plan, dy too on the way to ATen."""
    from triton.compiler.errors import CompilationError
    tri, aten = pair(name, device=device)
    tri.backend = None
    monkeypatch.setattr(B, '_STATE', {'triton': '', 'broken': None})
    monkeypatch.setattr(B, 'backend_name', lambda option, x: 'aten' if B._STATE['broken'] else 'triton')
    failing = {'forward': P._apply_kernel, 'backward': P._sums_kernel}[where]
    kernel_cls = type(failing)
    original = kernel_cls.run

    def run_or_fail(self, *args, **kwargs):
        if self is failing:
            raise CompilationError('normdense_test', None, 'simulated failure')
        return original(self, *args, **kwargs)
    monkeypatch.setattr(kernel_cls, 'run', run_or_fail)
    x = (torch.randn(2, C, 5, 6, dtype=torch.float64) + 1).to(device, x_dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        got = run(tri, [x])
        again = run(tri, [x])  # the process stays on ATen: no second warning
    ours = [w for w in caught if 'failed to compile' in str(w.message)]
    assert len(ours) == 1 and issubclass(ours[0].category, RuntimeWarning)
    assert_same(got, run(aten, [x]))
    assert_same(again, run(aten, [x]))
    tri.backend = 'triton'
    monkeypatch.setattr(B, 'backend_name', lambda option, x: 'triton')
    with pytest.raises(CompilationError):
        run(tri, [x])


@pytest.mark.slow  # ~40-80 s on 2 cores: the self-check's step (2x64x37x45, four layers) in the interpreter
def test_self_check_triton_step(device, monkeypatch):
    """``python -m normdense.self_check``'s GPU step (here on the interpreter's CPU tensors): None when the
    kernels match the ATen backend, one line naming the layer when they do not."""
    from normdense.self_check import triton_step_problem
    assert triton_step_problem(device) is None
    original = P._apply

    def off(*args, **kwargs):  # the output pass 1 % off
        return original(*args, **kwargs).mul_(1.01)
    monkeypatch.setattr(P, '_apply', off)
    problem = triton_step_problem(device)
    assert problem.startswith('BCN estimate: the Triton kernels differ from the ATen backend on ') and '\n' not in problem


@pytest.mark.slow  # 28-31 s on 2 shared cores: two interpreters importing the stack
def test_sync_stats_two_processes(device, tmp_path, monkeypatch):
    """Two gloo processes, ``sync_stats``: BCN batch / estimate and Unitization estimate on the Triton backend
    equal the ATen backend on each rank over two steps (outputs, input and parameter gradients, buffers),
    with a rank whose batch is empty on the reference path pairing its all-reduces with the kernels' rank."""
    from tests.layers.two_ranks import run_two_ranks
    if device == 'cpu':  # the workers' CPU tensors in the interpreter; on a GPU both ranks share it, compiled
        monkeypatch.setenv('TRITON_INTERPRET', '1')
    ranks = run_two_ranks(tmp_path, 'tests.kernels.dist_triton_worker', device)
    for r in ranks:
        names = {key.split('/')[0] for key in r}
        assert len(names) == 4
        for name in names:
            aten, tri = r[f'{name}/aten'], r[f'{name}/triton']
            assert aten.pop('triton_launches') == 0
            # >= 5 kernels a step: moments, stats, apply, sums, dx (synced batch statistics: torch maps)
            assert tri.pop('triton_launches') >= (0 if name.endswith('empty') and r is ranks[0] else 10)
            assert aten.keys() == tri.keys()
            for key in aten:
                torch.testing.assert_close(tri[key], aten[key], rtol=1e-10, atol=1e-10, msg=f'{name} {key}')
    for key in ranks[0]:  # the statistics are identical across ranks
        if key.endswith('/triton'):
            for n in ('running_mean', 'running_var'):
                torch.testing.assert_close(ranks[0][key][n], ranks[1][key][n], rtol=0, atol=0)


@pytest.mark.parametrize('path', ['aten', 'triton', 'reference'])
@pytest.mark.parametrize('mode', ['estimate', 'batch'])
def test_bcn_counts_num_batches_tracked_as_unitization(device, mode, path):
    """num_batches_tracked on every StatNorm layer with statistics (issue 37), counted alike by BCN and
    Unitization on both backends and the reference path: estimate mode once per iteration (a layer shared by
    several calls of one iteration counts 1), batch mode once per training call; eval counts nothing."""
    kw = dict(update_rate=0.1) if mode == 'estimate' else {}
    layers = [BatchChannelNorm2d(8, num_groups=4, mode=mode, **kw), Unitization2d(8, mode=mode, **kw)]
    torch.manual_seed(0)
    for layer in layers:
        layer.to(device)
        if path == 'reference':
            layer.fused = False
        else:
            layer.backend = path
        for calls in (2, 1, 3):
            sum(layer(torch.randn(2, 8, 3, 3, device=device)).sum() for _ in range(calls)).backward()
        with torch.no_grad():
            layer.eval()(torch.randn(2, 8, 3, 3, device=device))
    expected = 3 if mode == 'estimate' else 6
    assert [int(layer.num_batches_tracked) for layer in layers] == [expected, expected]


@pytest.mark.skipif(not INTERPRETED, reason='fakes a second device on CPU tensors: needs the interpreter')
@pytest.mark.parametrize('name', ['bcn-estimate', 'bcn-batch', 'gnpn-relu', 'unitization-batch'])
def test_every_launch_on_the_tensors_device(name, monkeypatch):
    """x on a second device (faked: CPU tensors that report cuda:1, a recording torch.cuda.device) with device 0
    current: every Triton launch of the forward and of the backward runs with x's device current (Triton
    launches on the current device and its current stream), and device 0 is current again afterwards."""
    from triton.runtime.interpreter import InterpretedFunction
    current = [0]
    seen = []

    class FakeDevice:
        def __init__(self, device):
            self.index = torch.device(device).index

        def __enter__(self):
            self.prev, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.prev

    launch = InterpretedFunction.run

    def record(self, *args, **kwargs):
        seen.append(current[0])
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(B, '_device_of', lambda t: torch.device('cuda', 1))
    monkeypatch.setattr(B, 'current_device', lambda: current[0])
    monkeypatch.setattr(torch.cuda, 'device', FakeDevice)
    monkeypatch.setattr(InterpretedFunction, 'run', record)
    tri, _ = pair(name, torch.float32)
    x = torch.randn(2, C, 6, 5, requires_grad=True)
    tri(x).sum().backward()
    assert len(seen) >= 6, seen  # forward and backward launches
    assert set(seen) == {1}, seen
    assert current[0] == 0


@pytest.mark.parametrize('name', ['bcn-estimate', 'bcn-batch', 'gnpn-relu', 'unitization-batch'])
def test_channels_last_and_autocast_without_hidden_passes(device, name):
    """A bf16 channels_last x under autocast (float32 parameters): a training step launches the Triton kernels
    only (no copy of x or dy, no cast of dy: every other operator would be a pass over the activation), y and
    dx come back channels_last in x's dtype, and they equal the contiguous input's."""
    tri, _ = pair(name, torch.float32, device)
    ref = copy.deepcopy(tri)
    torch.manual_seed(3)
    x = (torch.randn(2, C, 5, 7, device=device) * 2 + 1).bfloat16()
    dy = torch.randn(2, C, 5, 7, device=device).bfloat16()
    xl = x.to(memory_format=torch.channels_last).requires_grad_()
    dyl = dy.to(memory_format=torch.channels_last)
    with torch.autocast(device, dtype=torch.bfloat16):
        tri(xl).backward(dyl)  # warm: an estimate layer's first iteration, caches fill
        for t in [xl, *tri.parameters()]:
            t.grad = None  # else the step's gradients are added to these: ATen adds
        with count_launches() as n:
            y = tri(xl)
            y.backward(dyl)
    assert n['aten'] == 0, n['ops']
    assert y.dtype == torch.bfloat16 and y.is_contiguous(memory_format=torch.channels_last)
    assert xl.grad.is_contiguous(memory_format=torch.channels_last)
    xc = x.clone().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        ref(xc).backward(dy)
        xc.grad = None
        yc = ref(xc)
        yc.backward(dy)
    torch.testing.assert_close(y.float(), yc.float(), rtol=0.02, atol=0.02)
    torch.testing.assert_close(xl.grad.float(), xc.grad.float(), rtol=0.02, atol=0.02)


def small_coefficient_tiles(monkeypatch):
    """The BCN and GN+PN coefficient kernels given tiles of 32 elements (their ``tile``; 512 by default)."""
    from normdense.kernels import bcn, proxy_norm
    for module in (bcn, proxy_norm):
        for name in ('coeff_map', 'coeff_vjp'):
            monkeypatch.setattr(module, name, functools.partial(getattr(module, name), tile=32))


@pytest.mark.slow  # 25-40 s each on 2 cores: three steps of 24 samples in the interpreter
@pytest.mark.parametrize('name', ['bcn-estimate', 'bcn-batch-channel-affine', 'gnpn-gelu',
                                  'lnpn-silu-no-proxy-affine', 'unitization-batch', 'unitization-batch-cumulative'])
def test_large_batch_sums_in_sample_blocks(device, name, monkeypatch):
    """Many samples (N = 24 with the coefficient kernels' tiles lowered to 32 elements, as N = 384 with the
    default 512): the layer's VJP runs on sample blocks as well as channel blocks (``kernels.common.BlockSums``)
    and dx sums their partial parameter gradients (and dmean, dvar) in its own launch: float64 equal to ATen,
    at most 6 launches, the same bits as the first (cache-filling) run; with an input that needs no gradient
    (no dx) torch sums them."""
    from normdense.kernels import common as S
    small_coefficient_tiles(monkeypatch)
    blocks = []
    init = S.BlockSums.__init__

    def spy(self, sb, *args):
        blocks.append(sb)
        init(self, sb, *args)

    monkeypatch.setattr(S.BlockSums, '__init__', spy)
    tri, aten = pair(name, device=device)
    torch.manual_seed(4)
    x = (torch.randn(24, C, 2, 1, dtype=torch.float64) * 2 + 1).to(device)
    dy = torch.randn_like(x)

    def step(layer):
        xg = x.clone().requires_grad_()
        with count_launches() as n:
            y = layer(xg)
            y.backward(dy)
        return n, [y.detach(), xg.grad] + [p.grad for p in layer.parameters()] + list(layer.buffers())

    # three Triton steps (was five): the first one fills the caches (GN+PN's quantiles) and is the second one's
    # twin for the bits; the ATen step is the reference of the second one (the step a separate run() compared)
    _, cold = step(copy.deepcopy(tri))  # each step from the same state: an estimate layer moves its estimates
    layer, ref = copy.deepcopy(tri), copy.deepcopy(aten)
    n, warm = step(layer)
    assert n['triton'] + n['aten'] <= 6, f"{n['names']} + ATen {n['ops']}"
    assert blocks and min(blocks) > 1, blocks  # several sample blocks: the second stage ran
    for a, b in zip(cold, warm):  # deterministic: a fixed order of the sums, no atomics
        assert torch.equal(a, b)
    _, want = step(ref)
    assert len(warm) == len(want)
    for i, (a, b) in enumerate(zip(warm, want)):  # y, dx, parameter gradients, buffers
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f'output {i}')

    for m in (layer, ref):  # x needs no gradient: the parameter gradients only
        for p in m.parameters():
            p.grad = None
        m(x).backward(dy)
    for (name_t, p_t), p_a in zip(layer.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p_t.grad, p_a.grad, rtol=1e-10, atol=1e-10, msg=name_t)


def test_large_batch_sums_without_enough_dx_programs(device, monkeypatch):
    """dx whose programs cannot take a block of the partials' columns each (forced here: blocks of 0 columns)
    leaves the second stage to torch: the same gradients as ATen."""
    small_coefficient_tiles(monkeypatch)
    monkeypatch.setattr(P, '_dx', functools.partial(P._dx, finish_block=0))  # what TritonBackend.dx launches
    tri, aten = pair('bcn-batch', device=device)
    torch.manual_seed(5)
    x = (torch.randn(24, C, 2, 1, dtype=torch.float64) * 2 + 1).to(device)
    with count_launches() as n:
        got = run(tri, [x])
    assert '_dx_kernel' in n['names']
    assert_same(got, run(aten, [x]))


@pytest.mark.parametrize('name', ['bcn-estimate', 'unitization-batch'])
def test_moment_partials_not_kept_to_backward(device, name):
    """The Function keeps the first stage's record to backward (its outputs, its launch geometry), not the moments'
    partials: (SPLIT, 2, N C), up to an eighth of x's size for channels_last maps with few positions."""
    tri, _ = pair(name, device=device)
    x = torch.randn(2, C, 5, 6, dtype=torch.float64, device=device).to(memory_format=torch.channels_last)
    y = tri(x.requires_grad_())
    first = y.grad_fn.stats.first
    assert first is not None and first.geometry is not None
    assert first.fold is None
    y.sum().backward()
