"""The StatNorm engine (normdense/layers/_statnorm.py, backends in normdense/kernels/): each layer's closed-form coefficient VJP against
autograd of its pure coefficient map (float64, every layer and mode), the activations' closed-form
derivatives, ATen operator counts per forward + backward, activations read in their own dtype, and no
import cycles in normdense/. (Equality of the fused layers with their reference compositions, gradcheck,
half precision, memory: tests/layers/test_fused.py.)"""
import ast
import os

import pytest
import torch
import torch.nn as nn

from benchmarks._timing import count_ops
from normdense.layers._statnorm import StatNorm2d
from normdense.layers._activations import PROXY_NORM_ACTIVATIONS, activation
from tests.layers.test_fused import CASES, C

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIRST_STAGE = {k for k in CASES if not k.startswith(('gnpn', 'lnpn'))}


def _random_layer(name, seed):
    torch.manual_seed(seed)
    layer = CASES[name]().double()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return layer


# 'batch' only where there is a first stage (GN+PN has no per-channel statistics)
VJP_CASES = [(name, kind) for name in sorted(CASES) for kind in ('fixed', 'batch')
             if kind == 'fixed' or name in FIRST_STAGE]


@pytest.mark.parametrize('name, kind', VJP_CASES, ids=[f'{n}-{k}' for n, k in VJP_CASES])
def test_coeff_vjp_equals_autograd_of_the_coefficient_map(name, kind):
    """coeff_vjp against torch.autograd.grad of coeff_map, float64, random moments, statistics, parameters
    and cotangents: 'fixed' first-stage statistics (running estimates / eval) and 'batch' ones (functions of
    the moments: their gradients dmean, dvar too)."""
    layer = _random_layer(name, 0)
    assert isinstance(layer, StatNorm2d)
    g = torch.Generator().manual_seed(1)
    n, positions = 3, 7

    def rnd(*shape, positive=False):
        t = torch.randn(*shape, generator=g, dtype=torch.float64)
        return (t.abs() + 0.2 if positive else t * 2 + 0.5).requires_grad_()

    m, v = rnd(n, C), rnd(n, C, positive=True)
    mean, var = (rnd(C), rnd(C, positive=True)) if name in FIRST_STAGE else (None, None)
    count = n * positions if kind == 'batch' else None
    params = [p.detach().clone().requires_grad_() if p is not None else None for p in layer._statnorm_params()]
    coeffs, res = layer._coeff_maps(False)[0](m, v, mean, var, params, positions, count)
    cotangents = [torch.randn(c.shape, generator=g, dtype=torch.float64) for c in coeffs]
    wants = kind == 'batch'
    leaves = [m, v] + ([mean, var] if wants else []) + [p for p in params if p is not None]
    live = [(c, t) for c, t in zip(coeffs, cotangents) if c.requires_grad]  # K = 1 without PN's scaling
    expected = torch.autograd.grad([c for c, _ in live], leaves, [t for _, t in live], allow_unused=True)
    with torch.no_grad():
        dm, dv, dmean, dvar, dparams = layer._coeff_maps(False)[1](res, cotangents, wants)
    got = [dm, dv] + ([dmean, dvar] if wants else []) + [d for d, p in zip(dparams, params) if p is not None]
    assert len(got) == len(expected)
    for i, (a, e) in enumerate(zip(got, expected)):
        if e is None:  # no dependence (e.g. K = 1 without PN's scaling)
            assert a is None or torch.count_nonzero(a) == 0, i
            continue
        torch.testing.assert_close(a, e, rtol=1e-11, atol=1e-12, msg=f'gradient {i} of {name} ({kind})')
    if not wants:
        assert dmean is None and dvar is None


@pytest.mark.parametrize('name', sorted(PROXY_NORM_ACTIVATIONS))
def test_activation_backward_equals_autograd(name):
    act = activation(name, PROXY_NORM_ACTIVATIONS[name][1])
    z = (torch.linspace(-8, 8, 401, dtype=torch.float64) + 1e-3).requires_grad_()
    out = act.forward(z)
    grad = torch.randn(z.shape, dtype=torch.float64)
    expected, = torch.autograd.grad(out, z, grad)
    torch.testing.assert_close(act.backward(grad, z.detach(), out.detach()), expected, rtol=1e-12, atol=1e-12)


# Non-view ATen operators per training forward + backward (float32, after a warm-up call). The issue's
# target is 20 (nn.GroupNorm: 4); these are the counts reached, so that launch-count regressions fail here.
OP_BUDGET = {  # BCN estimate: 60 before num_batches_tracked, whose count is one add_ per iteration (issue 37)
    'bcn-estimate': 61, 'bcn-estimate-channel-affine': 61, 'bcn-batch': 71, 'bcn-batch-channel-affine': 71,
    'gnpn-relu': 78, 'gnpn-relu-no-scaling': 68, 'gnpn-gelu': 80, 'gnpn-leaky-no-scaling': 68,
    'lnpn-silu-no-proxy-affine': 72, 'unitization-batch': 70, 'unitization-batch-cumulative': 67,
    'unitization-estimate': 54, 'unitization-keras': 70, 'unitization-fixed-n': 70,
}


@pytest.mark.parametrize('name', sorted(CASES))
def test_operator_count_per_forward_backward(name):
    torch.manual_seed(0)
    layer = CASES[name]().train()
    x = torch.randn(2, C, 9, 11, requires_grad=True)
    dy = torch.randn(2, C, 9, 11)

    def step():
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        layer(x).backward(dy)

    step()
    ops = count_ops(step)
    gn = nn.GroupNorm(4, C)
    gn_ops = count_ops(lambda: gn(x).backward(dy))
    assert gn_ops <= 8
    assert ops <= OP_BUDGET[name], f'{name}: {ops} ATen ops per forward + backward (budget {OP_BUDGET[name]})'


@pytest.mark.parametrize('name', sorted(CASES))
def test_half_activations_read_in_their_own_dtype(name):
    """bf16 / fp16 x with float32 parameters (as under autocast): no float32 copy of the activation is made
    in forward or backward; every activation-sized tensor is in x's dtype."""
    from torch.utils._python_dispatch import TorchDispatchMode
    torch.manual_seed(0)
    layer = CASES[name]().train()
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(2, C, 16, 16).to(dtype).requires_grad_()  # larger than the (C, 200) proxy samples
        big = []

        class Watch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in (out if isinstance(out, (tuple, list)) else (out, )):
                    if isinstance(t, torch.Tensor) and t.numel() >= x.numel():
                        big.append((func.__name__, t.dtype))
                return out

        with Watch():
            y = layer(x)
            y.backward(torch.ones_like(y))
        assert y.dtype == dtype and x.grad.dtype == dtype
        assert big and all(d == dtype for _, d in big), big


def _module_imports():
    """{module: modules of normdense it imports} from the source (function-level imports included)."""
    base = os.path.join(ROOT, 'normdense')
    paths = {}
    for dirpath, _, files in os.walk(base):
        for f in files:
            if f.endswith('.py'):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, '.')
                paths[name[:-len('.__init__')] if name.endswith('.__init__') else name] = path
    graph = {}
    for mod, path in paths.items():
        package = mod if path.endswith('__init__.py') else mod.rsplit('.', 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level == 0:
                    target = node.module
                else:
                    target = package
                    for _ in range(node.level - 1):
                        target = target.rsplit('.', 1)[0]
                    target = f'{target}.{node.module}' if node.module else target
                if node.module is not None:
                    deps.add(target)
                deps.update(f'{target}.{a.name}' for a in node.names)
        graph[mod] = {d for d in deps if d in paths and d != mod}
    return graph


def test_no_import_cycles_in_normdense():
    graph = _module_imports()
    assert 'normdense.layers._statnorm' in graph and graph['normdense.layers.bcn']
    cycles, state = [], {}

    def visit(mod, stack):
        state[mod] = 'open'
        for dep in sorted(graph[mod]):
            if state.get(dep) == 'open':
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[mod] = 'done'

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
    assert not cycles, cycles


def test_backends_import_nothing_above_them():
    """Arrows point down: layers -> _statnorm -> kernels; nothing in normdense/kernels/ imports a layer."""
    graph = _module_imports()
    kernels = [m for m in graph if m.startswith('normdense.kernels')]
    assert {'normdense.kernels.aten', 'normdense.kernels.triton', 'normdense.kernels.torch_op'} <= set(kernels)
    for mod in kernels:
        assert all(d.startswith('normdense.kernels') for d in graph[mod]), (mod, graph[mod])
    engine = graph['normdense.layers._statnorm']
    assert not any(m.endswith(('bcn', 'proxy_norm', 'unitization')) for m in engine), engine


# --- plans: what the engine keeps per layer between calls ------------------------------------------------------
PLAN_CASES = [(name, backend) for name in ('bcn-estimate', 'gnpn-relu', 'unitization-batch')
              for backend in ('aten', 'triton')]


def _plan_layer(name, backend):
    if backend == 'triton':
        pytest.importorskip('triton', reason='needs triton: not run')
    torch.manual_seed(0)
    layer = CASES[name](backend=backend)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return layer


@pytest.mark.parametrize('name,backend', PLAN_CASES)
def test_a_moved_layer_plans_anew(name, backend):
    """``.double()`` on a layer that ran in float32: its float32 input is then computed in float64 (the dtype
    policy), as a layer built in float64 computes it, not with the plan made before the move."""
    x = torch.randn(2, C, 3, 3)
    layer = _plan_layer(name, backend)
    layer(x.requires_grad_()).sum().backward()
    fresh = _plan_layer(name, backend)
    fresh.load_state_dict(layer.state_dict())
    layer.double()
    fresh.double()
    torch.testing.assert_close(layer(x.detach()), fresh(x.detach()), rtol=0, atol=0)
    for a, b in zip(layer.buffers(), fresh.buffers()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize('name,backend', PLAN_CASES)
def test_a_layer_pickled_before_plans_existed_runs(name, backend):
    """An object state without ``_plans`` (pickled by an older normdense): unpickled, it plans on its first call."""
    layer = _plan_layer(name, backend)
    state = layer.__getstate__()
    del state['_plans']
    old = type(layer).__new__(type(layer))
    old.__setstate__(state)
    x = torch.randn(2, C, 3, 3)
    torch.testing.assert_close(old.eval()(x), layer.eval()(x), rtol=0, atol=0)


def test_library_imports_point_down():
    """No library module reads the package root (its ``__init__`` sits above every module: ``from . import NAME`` of
    a name that is not a module) and the checkpoint helpers do not import the norm switch (a config-level tool
    above them): the two that did."""
    graph = _module_imports()
    assert 'normdense.norm_switch' not in graph['normdense.checkpoint']
    assert 'normdense.norms' in graph['normdense.checkpoint']
    readers = []
    for mod in graph:
        if mod == 'normdense':
            continue
        path = os.path.join(ROOT, *mod.split('.')) + ('/__init__.py' if mod.count('.') == 0 else '.py')
        if not os.path.exists(path):
            path = os.path.join(ROOT, *mod.split('.'), '__init__.py')
        package = mod if path.endswith('__init__.py') else mod.rsplit('.', 1)[0]
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and node.module is None:
                target = package
                for _ in range(node.level - 1):
                    target = target.rsplit('.', 1)[0]
                if target == 'normdense':
                    readers += [f'{mod}: {a.name}' for a in node.names if f'normdense.{a.name}' not in graph]
            elif isinstance(node, ast.ImportFrom) and node.module == 'normdense' and node.level == 0:
                readers += [f'{mod}: {a.name}' for a in node.names if f'normdense.{a.name}' not in graph]
    assert not readers, readers
