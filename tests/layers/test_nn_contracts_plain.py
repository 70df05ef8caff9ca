"""The torch.nn module contracts that torch checks for its own layers (test/test_modules.py), for the plain layers
WSConv2d, IterNorm (newton, zca, recompute), EquiConv2d and ChannelAffine: factory kwargs, skip_init, meta init,
memory formats, gradgradcheck, pickling, vmap, batched gradients, parameter swapping, non-contiguous inputs and
torch.compile. nn.Conv2d and nn.BatchNorm2d run every test as controls, and where a layout or a refusal is
compared, the control of a layer is the torch module of its kind (``CONTROL``). The engine layers (BCN, GN+PN,
Unitization): test_nn_contracts.py."""
import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn

from normdense.layers import ChannelAffine, EquiConv2d, IterNorm, WSConv2d
from normdense.layers.iternorm import newton_whitening_matrix, zca_whitening_matrix

D = torch.float64
CONV = (3, 5, 3)  # in, out, kernel: conv layers see 3 channels, norm layers 5
CASES = {  # name: (class, args, kwargs)
    'Conv2d': (nn.Conv2d, CONV, dict(padding=1)),
    'BatchNorm2d': (nn.BatchNorm2d, (5, ), {}),
    'WSConv2d': (WSConv2d, CONV, dict(padding=1)),
    'IterNorm': (IterNorm, (5, ), dict(group_size=3, T=3)),  # two blocks: groups of 3 and 2
    'IterNorm-zca': (IterNorm, (5, ), dict(group_size=3, method='zca')),
    'IterNorm-recompute': (IterNorm, (5, ), dict(group_size=3, T=3, recompute=True)),
    'EquiConv2d': (EquiConv2d, CONV, dict(padding=1)),
    'ChannelAffine': (ChannelAffine, (5, ), {}),
}
CONTROL = {name: 'Conv2d' if cls.__name__.endswith('Conv2d') else 'BatchNorm2d'
           for name, (cls, _, _) in CASES.items()}
STATEFUL = ['BatchNorm2d', 'IterNorm', 'IterNorm-zca', 'IterNorm-recompute', 'EquiConv2d']  # running buffers
NAMES = list(CASES)
MODES = pytest.mark.parametrize('train', [True, False], ids=['train', 'eval'])


def build(name, **factory):
    cls, args, kwargs = CASES[name]
    return cls(*args, **kwargs, **factory)


def layer(name, train=True, seed=0):
    """A float64 layer with non-trivial parameters; in training as built (its first training call is the test's,
    where EquiConv2d checks its input once), for eval with running statistics from two training calls."""
    torch.manual_seed(seed)
    m = build(name, dtype=D)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.rand_like(p) * 0.2)
    if not train:
        with torch.no_grad():
            for s in (1, 2):
                m(data(name, seed=s))
    return m.train(train)


def data(name, n=2, seed=3, size=4):
    """Positive inputs (EquiNorm assumes post-ReLU inputs)."""
    channels = CASES[name][1][0]
    return torch.rand(n, channels, size, size, dtype=D, generator=torch.Generator().manual_seed(seed)) + 0.1


def floating_state(m):
    return {k: v for k, v in m.state_dict().items() if v.is_floating_point()}


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, msg=k)


def functional(m):
    """(x, *parameters) -> output, for gradcheck over the parameters too."""
    names = [n for n, _ in m.named_parameters()]
    return lambda x, *ps: torch.func.functional_call(m, dict(zip(names, ps)), (x, ))


# --- construction: factory kwargs, skip_init, meta init, reset_parameters -------------------------------------

@pytest.mark.parametrize('name', NAMES)
def test_factory_kwargs_place_every_parameter_and_buffer(name):
    m = build(name, device='cpu', dtype=D)
    assert {(t.dtype, t.device.type) for t in floating_state(m).values()} == {(D, 'cpu')}
    with torch.device('meta'):
        assert {t.device.type for t in build(name).state_dict().values()} == {'meta'}


@pytest.mark.parametrize('name', NAMES)
def test_skip_init(name):
    cls, args, kwargs = CASES[name]
    m = torch.nn.utils.skip_init(cls, *args, **kwargs, dtype=D)
    fresh = build(name, dtype=D)
    assert {t.device.type for t in m.state_dict().values()} == {'cpu'}
    assert [(k, v.shape, v.dtype) for k, v in m.state_dict().items()] == \
        [(k, v.shape, v.dtype) for k, v in fresh.state_dict().items()]


@pytest.mark.parametrize('name', NAMES)
def test_meta_init_to_empty_reset_parameters_equals_a_fresh_layer(name):
    """FSDP-style init: built on meta, materialized uninitialized, then reset_parameters draws what the
    constructor draws (same seed: the same tensors) and sets the buffers to their initial values."""
    torch.manual_seed(0)
    fresh = build(name)
    with torch.device('meta'):
        m = build(name)
    m.to_empty(device='cpu')
    torch.manual_seed(0)
    m.reset_parameters()
    assert_same_state(m, fresh)
    x = data(name).float()
    torch.testing.assert_close(m(x), fresh(x), rtol=0, atol=0)


@pytest.mark.parametrize('name', NAMES)
def test_load_state_dict_assign_into_a_meta_layer(name):
    source = layer(name, train=False)
    with torch.device('meta'):
        m = build(name, dtype=D)
    m.load_state_dict(source.state_dict(), assign=True)
    assert_same_state(m, source)
    torch.testing.assert_close(m.eval()(data(name)), source.eval()(data(name)), rtol=0, atol=0)


@pytest.mark.parametrize('name', STATEFUL)
def test_reset_parameters_resets_running_statistics(name):
    """As nn.BatchNorm2d's: after reset_parameters the buffers hold their initial values."""
    m = layer(name, train=False)
    m.reset_parameters()
    fresh = build(name, dtype=D)
    for (k, v), (_, v0) in zip(m.named_buffers(), fresh.named_buffers()):
        torch.testing.assert_close(v, v0, rtol=0, atol=0, msg=k)


# --- memory formats and non-contiguous inputs ------------------------------------------------------------------

@pytest.mark.parametrize('name', NAMES)
@pytest.mark.parametrize('where', ['input', 'module'])
@MODES
def test_channels_last_layout_as_torch_and_values_unchanged(name, where, train):
    """channels_last input, or a channels_last module (m.to(memory_format=...)) on a contiguous input: the output
    has the strides of the torch control's output, and the values of the contiguous computation."""
    outputs = {}
    for n in (name, CONTROL[name]):
        m, ref = layer(n, train), layer(n, train)
        x = data(n)
        if where == 'input':
            y = m(x.to(memory_format=torch.channels_last))
        else:
            y = m.to(memory_format=torch.channels_last)(x)
        outputs[n] = y
        torch.testing.assert_close(y, ref(x), msg=n)
    assert outputs[name].stride() == outputs[CONTROL[name]].stride()


@pytest.mark.parametrize('name', ['IterNorm', 'IterNorm-zca', 'ChannelAffine'])
def test_channels_last_3d_layout_as_batchnorm3d(name):
    x = torch.rand(2, 5, 3, 2, 2, dtype=D).to(memory_format=torch.channels_last_3d)
    assert layer(name)(x).stride() == nn.BatchNorm3d(5, dtype=D)(x).stride()


@pytest.mark.parametrize('name', NAMES)
@MODES
def test_non_contiguous_input(name, train):
    m, ref = layer(name, train), layer(name, train)
    x = data(name, n=4).transpose(2, 3)[::2].requires_grad_()
    x0 = x.detach().contiguous().requires_grad_()
    assert not x.is_contiguous()
    y, y0 = m(x), ref(x0)
    torch.testing.assert_close(y, y0)
    g = torch.rand_like(y0)
    torch.testing.assert_close(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(y0, x0, g)[0])


# --- autograd: gradgradcheck, batched gradients -------------------------------------------------------------

@pytest.mark.parametrize('name', NAMES)
@MODES
def test_gradcheck_and_gradgradcheck_float64(name, train):
    """Over the input and the parameters, every mode (IterNorm's recompute included)."""
    m = layer(name, train)
    x = data(name, size=2).requires_grad_()
    args = (x, *[p.detach().clone().requires_grad_() for p in m.parameters()])
    assert torch.autograd.gradcheck(functional(m), args, fast_mode=True)
    assert torch.autograd.gradgradcheck(functional(m), args, fast_mode=True)


@pytest.mark.parametrize('coupled', [True, False])
def test_whitening_matrices_gradgradcheck(coupled):
    xc = torch.rand(2, 3, 6, dtype=D)
    xc = (xc - xc.mean(2, keepdim=True)).requires_grad_()
    assert torch.autograd.gradgradcheck(lambda t: newton_whitening_matrix(t, 1e-3, 3, coupled), (xc, ))
    if coupled:
        assert torch.autograd.gradgradcheck(lambda t: zca_whitening_matrix(t, 1e-3), (xc, ))


@pytest.mark.parametrize('name', NAMES)
@MODES
def test_batched_gradients_and_vectorized_jacobian(name, train):
    m = layer(name, train)
    x = data(name, n=1, size=2).requires_grad_()
    y = m(x)
    grads = torch.rand(3, *y.shape, dtype=D)
    batched, = torch.autograd.grad(y, x, grads, is_grads_batched=True, retain_graph=True)
    looped = torch.stack([torch.autograd.grad(y, x, g, retain_graph=True)[0] for g in grads])
    torch.testing.assert_close(batched, looped)
    jv = torch.autograd.functional.jacobian(layer(name, train), x.detach(), vectorize=True)
    jl = torch.autograd.functional.jacobian(layer(name, train), x.detach())
    torch.testing.assert_close(jv, jl)


# --- torch.func.vmap --------------------------------------------------------------------------------------------

@pytest.mark.parametrize('name', NAMES)
def test_vmap_over_samples_in_eval(name):
    m = layer(name, train=False)
    x = data(name, n=3)
    y = torch.func.vmap(lambda xi: m(xi.unsqueeze(0)).squeeze(0))(x)
    torch.testing.assert_close(y, m(x))


@pytest.mark.parametrize('name', NAMES)
@MODES
def test_vmap_over_an_ensemble(name, train):
    """stack_module_state + functional_call, each member on its own batch: outputs and parameter gradients
    (vmap of torch.func.grad) as each member's, and in training each member's batched buffers move as its own."""
    members = [layer(name, train, seed=s) for s in (0, 1)]
    eager = [copy.deepcopy(mb) for mb in members]
    params, buffers = torch.func.stack_module_state(members)
    base = copy.deepcopy(members[0]).to('meta')
    xs = torch.stack([data(name, seed=s) for s in (3, 4)])

    def loss(p, b, x):
        y = torch.func.functional_call(base, (p, b), (x, ))
        return (y * torch.linspace(-1, 1, y.numel(), dtype=D).view_as(y)).sum(), y

    grads, y = torch.func.vmap(torch.func.grad(loss, has_aux=True))(params, buffers, xs)
    for i, mb in enumerate(eager):
        out = mb(xs[i])
        torch.testing.assert_close(y[i], out)
        torch.autograd.backward(out, torch.linspace(-1, 1, out.numel(), dtype=D).view_as(out))
        for k, v in mb.named_parameters():
            torch.testing.assert_close(grads[k][i], v.grad, msg=k)
        for k, v in mb.named_buffers():
            torch.testing.assert_close(buffers[k][i], v, msg=k)


@pytest.mark.parametrize('name', NAMES)
def test_vmap_over_samples_in_training(name):
    """Layers that update running statistics in place refuse unbatched buffers, as nn.BatchNorm2d does; the
    others give the per-sample-batch outputs."""
    m = layer(name)
    x = data(name, n=3)
    run = lambda: torch.func.vmap(lambda xi: m(torch.stack([xi, xi.flip(1)])))(x)  # noqa: E731
    if name in STATEFUL:
        with pytest.raises(RuntimeError, match='got a batched tensor'):
            run()
    else:
        torch.testing.assert_close(run(), torch.stack([m(torch.stack([xi, xi.flip(1)])) for xi in x]))


# --- copies, pickling, conversion -------------------------------------------------------------------------------

@pytest.mark.parametrize('name', NAMES)
def test_pickle_save_and_deepcopy_after_a_forward(name):
    m = layer(name)
    m(data(name).requires_grad_()).sum().backward()
    buffer = io.BytesIO()
    torch.save(m, buffer)
    buffer.seek(0)
    copies = [pickle.loads(pickle.dumps(m)), torch.load(buffer, weights_only=False), copy.deepcopy(m)]
    x = data(name, seed=9)
    for c in copies:
        assert_same_state(c, m)
        torch.testing.assert_close(c.eval()(x), copy.deepcopy(m).eval()(x), rtol=0, atol=0)


@pytest.fixture
def swap_params():
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


@pytest.mark.parametrize('name', NAMES)
def test_swap_module_params_to_float64(name, swap_params):
    """With swapping on, .to(float64) keeps the Parameter objects (swaps their contents). While a training
    output holds the graph torch refuses, for its controls at .to ("Couldn't swap"); where the forward saved no
    parameter (EquiConv2d) the swap goes through and that graph's backward raises ("poisoned by swap_tensors")."""
    m = build(name).train()
    ref = build(name, dtype=D)
    ref.load_state_dict(m.state_dict())
    ids = [id(p) for p in m.parameters()]
    m.to(D)
    assert [id(p) for p in m.parameters()] == ids
    assert {t.dtype for t in floating_state(m).values()} == {D}
    x = data(name)
    torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)
    m = build(name).train()
    y = m(x.float().requires_grad_())
    with pytest.raises(RuntimeError, match='[Ss]wap'):
        m.to(D)
        y.sum().backward()


# --- torch.compile --------------------------------------------------------------------------------------------

@pytest.mark.parametrize('name', NAMES)
@MODES
def test_compile_fullgraph_matches_eager(name, train):
    """One graph (fullgraph=True), the first training call included; outputs, gradients and buffers as eager's
    over two steps. aot_eager: Dynamo and AOTAutograd, as inductor sees them, without compiling C++."""
    torch._dynamo.reset()
    m = layer(name, train)
    ref = copy.deepcopy(m)
    compiled = torch.compile(m, fullgraph=True, backend='aot_eager')
    for seed in (4, 5):
        x = data(name, seed=seed).requires_grad_()
        x0 = x.detach().clone().requires_grad_()
        y, y0 = compiled(x), ref(x0)
        torch.testing.assert_close(y, y0)
        y.backward(torch.ones_like(y))
        y0.backward(torch.ones_like(y0))
        torch.testing.assert_close(x.grad, x0.grad)
        for (k, p), (_, p0) in zip(m.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.grad, p0.grad, msg=k)
        for (k, b), (_, b0) in zip(m.named_buffers(), ref.named_buffers()):
            torch.testing.assert_close(b, b0, msg=k)
    torch._dynamo.reset()
