"""The engine's layers (BCN, GN+PN, Unitization) keep torch.nn's module contracts on both backends (Triton under
its interpreter here), with torch's own layers as controls where that makes a test's meaning plain: double
backward (a gradient penalty, gradgradcheck), torch.func (vmap in eval, batched gradients), device/dtype
arguments (meta init, ``to_empty``, ``skip_init``), pickling after a forward, channels_last in and out, and
``module.to`` with ``swap_module_params_on_conversion``. docs/compatibility.md has the table."""
import functools
import io
import pickle

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call, grad, vmap

from normdense.layers.bcn import BatchChannelNorm2d
from normdense.layers.proxy_norm import GroupProxyNorm
from normdense.layers.unitization import Unitization2d
from tests.layers.test_fused import randomized
from tests.layers.two_ranks import run_two_ranks

C = 4
CASES = {
    'bcn-estimate': functools.partial(BatchChannelNorm2d, C, 2, update_rate=0.3),
    'bcn-batch': functools.partial(BatchChannelNorm2d, C, 2, mode='batch'),
    'gnpn-relu': functools.partial(GroupProxyNorm, C, 2),
    'gnpn-gelu': functools.partial(GroupProxyNorm, C, 2, act='gelu'),  # phi'' != 0
    'unitization-batch': functools.partial(Unitization2d, C),
    'unitization-estimate': functools.partial(Unitization2d, C, mode='estimate', update_rate=0.3),
}
BACKEND_CASES = [(n, b) for b in ('aten', 'triton') for n in CASES]


@pytest.fixture(autouse=True)
def _needs_triton(request):
    if 'triton' in request.node.name:
        pytest.importorskip('triton', reason='needs triton: not run')


def make(name, backend='aten', fused=True, seed=0, **kwargs):
    """A float64 layer of ``name`` with parameters and statistics away from their initial values."""
    torch.manual_seed(seed)
    return randomized(CASES[name](backend=backend, fused=fused, **kwargs).double())


def penalty_grads(layer, seed=1):
    """The gradients of a gradient penalty through conv -> layer (WGAN-GP / R1 style): |d<y, w>/d conv.weight|^2,
    differentiated by conv.weight and the layer's parameters."""
    torch.manual_seed(seed)
    conv = nn.Conv2d(3, C, 3, padding=1).double()
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    y = layer(conv(x))
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=y.dtype)
    g, = torch.autograd.grad((y * w).sum(), conv.weight, create_graph=True)
    g.pow(2).sum().backward()
    return [conv.weight.grad] + [p.grad for p in layer.parameters()]


def assert_same_grad(a, b):
    """Equal gradients, where None (not in the graph) equals zeros: from torch 2.14 F.group_norm's double backward
    connects its bias, so the reference's bias gets zeros where the engine's (and torch 2.12's) get None."""
    if a is None or b is None:
        assert all(t is None or not t.any() for t in (a, b)), (a, b)
    else:
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize('name,backend', BACKEND_CASES)
def test_gradient_penalty_matches_the_reference(name, backend):
    """Silently wrong before (conv.weight.grad off by a relative 0.9-1.9, or None): the backward's gradients were
    not differentiable, so the penalty lost every path through them."""
    fused, ref = penalty_grads(make(name, backend)), penalty_grads(make(name, backend, fused=False))
    assert fused[0] is not None, 'the penalty lost its path through the layer\'s gradient'
    for a, b in zip(fused, ref):  # None: a parameter the penalty does not depend on (the last bias)
        assert_same_grad(a, b)


@pytest.mark.parametrize('name,backend', BACKEND_CASES)
def test_first_order_gradients_with_create_graph_equal_the_closed_form(name, backend):
    """The differentiable backward (create_graph) and the closed-form one give the same first-order gradients."""
    out = []
    for create_graph in (False, True):
        layer = make(name, backend)
        x = torch.randn(2, C, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2),
                        requires_grad=True)
        y = layer(x)
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=y.dtype)
        out.append(torch.autograd.grad((y * w).sum(), [x, *layer.parameters()], create_graph=create_graph))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize('training', [True, False], ids=['train', 'eval'])
@pytest.mark.parametrize('name,backend', BACKEND_CASES)
def test_gradgradcheck(name, backend, training):
    """Second derivatives by finite differences of the first, float64, input and parameters (Triton: the input,
    in fast mode: a launch costs the interpreter 10-40 ms); estimate mode at r = 0 in training (each call otherwise
    moves the estimates: not a function to difference)."""
    kwargs = dict(update_rate=0.0) if 'estimate' in name else {}
    layer = make(name, backend, **kwargs).train(training)
    shape = (2, C, 1, 2) if backend == 'triton' else (2, C, 2, 2)
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4), requires_grad=True)
    names = [n for n, _ in layer.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_(backend == 'aten') for p in layer.parameters())

    def f(x, *ps):
        return functional_call(layer, dict(zip(names, ps)), (x, ))
    assert torch.autograd.gradgradcheck(f, (x, *params), fast_mode=backend == 'triton')


def test_gradgradcheck_controls_pass_and_a_once_differentiable_function_fails():
    """The check has teeth: torch's layers pass it; a backward that drops its second-order paths (what the engine's
    did, once_differentiable) fails it."""
    x = torch.randn(2, C, 1, 2, dtype=torch.float64, requires_grad=True)
    for control in (nn.GroupNorm(2, C), nn.BatchNorm2d(C)):
        assert torch.autograd.gradgradcheck(control.double(), (x, ))

    class Detached(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.pow(3)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, dy):
            x, = ctx.saved_tensors
            return 3 * x.pow(2) * dy
    assert not torch.autograd.gradgradcheck(Detached.apply, (x, ), raise_exception=False)


def test_gradient_penalty_with_sync_stats_across_two_ranks(tmp_path):
    """Batch-mode BCN with ``sync_stats`` (the all-reduced batch statistics): the penalty's gradients equal the
    reference composition's on each of two gloo processes with unequal batches."""
    for rank in run_two_ranks(tmp_path, 'tests.layers.dist_penalty_worker'):
        assert rank['fused'][0] is not None
        for a, b in zip(rank['fused'], rank['reference']):
            assert_same_grad(a, b)


# --- torch.func ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize('name,backend', BACKEND_CASES)
def test_vmap_in_eval_equals_the_batched_call(name, backend):
    layer = make(name, backend).eval()
    x = torch.randn(3, C, 3, 3, dtype=torch.float64)
    y = vmap(lambda xi: layer(xi.unsqueeze(0)).squeeze(0))(x)
    torch.testing.assert_close(y, layer(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('name', sorted(CASES))
def test_vmap_in_training(name):
    """GN+PN has no statistics (train = eval): vmapped per sample. The others update buffers in place, which vmap
    cannot batch: a one-line error that says what to do (torch refuses nn.BatchNorm2d so too)."""
    layer = make(name).train()
    x = torch.randn(3, C, 3, 3, dtype=torch.float64)
    per_sample = vmap(lambda xi: layer(xi.unsqueeze(0)).squeeze(0))
    if not layer._FIRST_STAGE:
        torch.testing.assert_close(per_sample(x), torch.cat([layer(x[i:i + 1]) for i in range(3)]))
        return
    with pytest.raises(RuntimeError, match=r'vmap in training mode.*call \.eval\(\)'):
        per_sample(x)
    with pytest.raises(RuntimeError):  # the control
        vmap(lambda xi: nn.BatchNorm2d(C).double()(xi.unsqueeze(0)))(x)


@pytest.mark.parametrize('name,backend', BACKEND_CASES)
def test_batched_gradients_equal_a_loop(name, backend):
    """``autograd.grad(is_grads_batched=True)`` (and ``jacobian(vectorize=True)``, which uses it), in training."""
    layer = make(name, backend)
    x = torch.randn(2, C, 2, 2, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    cot = torch.randn((3, ) + y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(5))
    inputs = [x, *layer.parameters()]
    batched = torch.autograd.grad(y, inputs, cot, is_grads_batched=True, retain_graph=True)
    for i in range(3):
        for b, e in zip(batched, torch.autograd.grad(y, inputs, cot[i], retain_graph=True)):
            torch.testing.assert_close(b[i], e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize('name', sorted(CASES))
def test_per_sample_gradients_in_eval(name):
    """vmap(grad(...)) over samples: per-sample parameter gradients, each equal to a one-sample backward."""
    layer = make(name).eval()
    params = {n: p.detach() for n, p in layer.named_parameters()}
    x = torch.randn(3, C, 2, 2, dtype=torch.float64)

    def loss(p, xi):
        return functional_call(layer, p, (xi.unsqueeze(0), )).pow(2).sum()
    per_sample = vmap(grad(loss), in_dims=(None, 0))(params, x)
    for i in range(3):
        layer.zero_grad()
        layer(x[i:i + 1]).pow(2).sum().backward()
        for n, p in layer.named_parameters():
            torch.testing.assert_close(per_sample[n][i], p.grad, rtol=1e-10, atol=1e-12)


# --- construction: device and dtype, meta init, skip_init -------------------------------------------------------
@pytest.mark.parametrize('name', sorted(CASES))
def test_device_and_dtype_arguments(name):
    layer = CASES[name](dtype=torch.float64, device='cpu')
    assert all(p.dtype == torch.float64 for p in layer.parameters())
    assert all(b.dtype in (torch.float64, torch.long) for b in layer.buffers())
    half = CASES[name](dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    # estimates stay float32 as under .half() (the dtype policy); batch mode's statistics take the dtype
    for b, moved in zip(half.buffers(), CASES[name]().bfloat16().buffers()):
        assert b.dtype == moved.dtype


@pytest.mark.parametrize('name', sorted(CASES))
def test_meta_init_to_empty_and_reset_parameters_give_a_fresh_layer(name):
    with torch.device('meta'):
        layer = CASES[name]()
    assert all(t.is_meta for t in layer.state_dict().values())
    layer.to_empty(device='cpu')
    layer.reset_parameters()
    fresh = CASES[name]()
    assert layer.state_dict().keys() == fresh.state_dict().keys()
    for k, v in fresh.state_dict().items():
        assert torch.equal(layer.state_dict()[k], v), k
    x = torch.randn(2, C, 3, 3)
    torch.testing.assert_close(layer(x), fresh(x))


@pytest.mark.parametrize('name', sorted(CASES))
def test_load_state_dict_assign_into_a_meta_layer(name):
    source = make(name)
    with torch.device('meta'):
        layer = CASES[name]()
    layer.load_state_dict(source.state_dict(), assign=True)
    x = torch.randn(2, C, 3, 3, dtype=torch.float64)
    torch.testing.assert_close(layer.eval()(x), source.eval()(x))


@pytest.mark.parametrize('name', sorted(CASES))
def test_skip_init(name):
    layer = torch.nn.utils.skip_init(type(CASES[name]()), *CASES[name].args, dtype=torch.float64,
                                     **CASES[name].keywords)
    assert all(p.dtype == torch.float64 and not p.is_meta for p in layer.parameters())


# --- pickling, layouts, moving --------------------------------------------------------------------------------
@pytest.mark.parametrize('name,backend', BACKEND_CASES)
def test_pickle_and_torch_save_after_a_forward(name, backend):
    layer = make(name, backend)
    x = torch.randn(2, C, 3, 3, dtype=torch.float64)
    layer(x.requires_grad_()).sum().backward()
    copy = pickle.loads(pickle.dumps(layer))
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for other in (copy, loaded):
        torch.testing.assert_close(other.eval()(x.detach()), layer.eval()(x.detach()), rtol=0, atol=0)
        layer.train()


@pytest.mark.parametrize('training', [True, False], ids=['train', 'eval'])
@pytest.mark.parametrize('name,backend', BACKEND_CASES)
def test_channels_last_in_channels_last_out(name, backend, training):
    """As nn.BatchNorm2d and nn.GroupNorm: a channels_last input gives a channels_last output, the same values."""
    x = torch.randn(2, C, 3, 5, dtype=torch.float64)
    xc = x.contiguous(memory_format=torch.channels_last)
    for control in (nn.BatchNorm2d(C).double(), nn.GroupNorm(2, C).double()):
        assert control.train(training)(xc).is_contiguous(memory_format=torch.channels_last)
    y = make(name, backend).train(training)(x)
    yc = make(name, backend).train(training)(xc.requires_grad_())
    assert yc.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(yc, y, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('name', sorted(CASES))
def test_to_with_swapped_parameters_after_a_step(name):
    """``module.to`` under ``set_swap_module_params_on_conversion(True)`` with the step's output still alive (as
    torch's layers: the backward's state must not pin the parameters)."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        for layer in (nn.GroupNorm(2, C), CASES[name]()):
            y = layer(torch.randn(2, C, 3, 3, requires_grad=True))
            y.sum().backward()
            layer.to(torch.float64)
            assert all(p.dtype == torch.float64 for p in layer.parameters())
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
