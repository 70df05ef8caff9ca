"""The StatNorm layers under torch.compile, on either backend: a layer's call is one torch.library operator
(normdense::statnorm, its backward normdense::statnorm_backward; normdense/kernels/torch_op.py), so Dynamo does
not graph-break on the kernels or the estimate bookkeeping, and the compiled model computes what the eager path
does (outputs, gradients, buffers, estimate iterations)."""
import copy

import pytest
import torch
import torch._dynamo

from tests.layers.test_fused import CASES, C, assert_same, make, run

COMPILED_CASES = ['bcn-estimate', 'bcn-batch-channel-affine', 'gnpn-gelu', 'lnpn-silu-no-proxy-affine',
                  'unitization-batch-cumulative', 'unitization-estimate']


def triton_layer(name, backend='triton'):
    layer, _ = make(name)
    layer.backend = backend
    return layer


@pytest.mark.parametrize('backend', ['aten', 'triton'])
@pytest.mark.parametrize('train', [True, False])
@pytest.mark.parametrize('name', sorted(CASES))
def test_no_graph_break(name, train, backend, device):
    layer = triton_layer(name, backend).to(device).train(train)
    torch._dynamo.reset()
    x = torch.randn(2, C, 5, 6, dtype=torch.float64, device=device, requires_grad=True)
    explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count == 0, [str(b.reason).splitlines()[0] for b in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.parametrize('backend', ['aten', 'triton'])
@pytest.mark.parametrize('name', COMPILED_CASES)
def test_compiled_equals_eager(name, backend, device):
    """torch.compile(fullgraph=True, backend='aot_eager') against the eager path, float64: three training steps
    (estimates and running statistics move, the iteration ends at each backward) and eval."""
    eager = triton_layer(name, backend).to(device)
    twin = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend='aot_eager', fullgraph=True)
    for step in range(3):
        torch.manual_seed(step)
        xs = [(torch.randn(2, C, 5, 6, dtype=torch.float64) + 1).to(device)]
        got = run(compiled, xs)
        for key in ('pgrads', 'buffers'):
            got[key] = {k.replace('_orig_mod.', ''): v for k, v in got[key].items()}
        assert_same(got, run(eager, xs))
    eager.eval(), twin.eval()
    x = torch.randn(2, C, 4, 4, dtype=torch.float64, device=device)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-12, atol=1e-12)


def test_forward_without_backward_frees_what_it_kept(device):
    """A compiled training forward whose graph is dropped without a backward (e.g. a loss never used) does not
    keep its activation: the operator's pending entry goes with the graph."""
    import gc
    from normdense.kernels import torch_op as op
    layer = triton_layer('bcn-batch').to(device)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend='aot_eager', fullgraph=True)
    x = torch.randn(2, C, 5, 6, dtype=torch.float64, device=device, requires_grad=True)
    before = len(op._PENDING)
    y = compiled(x)
    assert len(op._PENDING) == before + 1
    del y
    gc.collect()
    assert len(op._PENDING) == before
    compiled(x).sum().backward()  # and a graph with its backward runs it
    assert len(op._PENDING) == before and x.grad is not None


@pytest.mark.slow  # inductor compiles C++ for the conv and the loss: ~40 s on 2 CPU cores
@pytest.mark.parametrize('compiler', ['aot_eager', 'inductor'])
def test_compiled_training_step_on_the_aten_path(compiler):
    """torch.compile(step, fullgraph=True) of a model's training step (conv, BCN estimate, GN+PN, Unitization;
    the loss; backward and SGD outside) equals eager over several steps, float64 (before the engine redesign
    Dynamo stopped at 'torch.* op returned non-Tensor')."""
    import torch.nn as nn
    from normdense.layers import BatchChannelNorm2d, GroupProxyNorm, Unitization2d
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Conv2d(3, C, 3, padding=1), BatchChannelNorm2d(C, 4, update_rate=0.1, backend='aten'),
                          GroupProxyNorm(C, 4, act='gelu', backend='aten'),
                          Unitization2d(C, momentum=None, backend='aten')).double()
    twin = copy.deepcopy(eager)
    models = {'eager': eager, 'compiled': twin}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in models.items()}
    steps = {k: (lambda m: lambda x: m(x).square().mean())(m) for k, m in models.items()}
    torch._dynamo.reset()
    steps['compiled'] = torch.compile(steps['compiled'], backend=compiler, fullgraph=True)
    tol = 0 if compiler == 'aot_eager' else 1e-12  # inductor reorders the conv's and the loss's sums
    for step in range(3):
        x = torch.randn(2, 3, 6, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        losses = {}
        for k in models:
            losses[k] = steps[k](x)
            losses[k].backward()
            opts[k].step()
            opts[k].zero_grad()
        torch.testing.assert_close(losses['compiled'], losses['eager'], rtol=tol, atol=tol)
        for (name, a), b in zip(eager.state_dict().items(), twin.state_dict().values()):
            torch.testing.assert_close(b, a, rtol=tol, atol=tol, msg=name)


@pytest.mark.slow  # inductor compiles the graph's C++: ~15 s a layout on 2 CPU cores
@pytest.mark.parametrize('layout', ['channels_last', 'hw_swapped'])
def test_inductor_asserts_hold_for_non_contiguous_inputs(layout):
    """Under inductor the operators' outputs have the strides their fake kernels declare (inductor asserts them):
    a channels_last map and a map with H and W swapped in memory, forward and backward equal eager (both failed
    with inductor's stride assertion before)."""
    from normdense.layers import BatchChannelNorm2d
    torch.manual_seed(0)
    layer = BatchChannelNorm2d(C, 4, mode='batch', backend='aten').double()
    twin = copy.deepcopy(layer)
    x = torch.randn(2, C, 5, 6, dtype=torch.float64)
    x = x.contiguous(memory_format=torch.channels_last) if layout == 'channels_last' else \
        x.transpose(2, 3).contiguous().transpose(2, 3)
    w = torch.randn(x.shape, dtype=torch.float64)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: twin(t), backend='inductor')
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    (layer(xa) * w).sum().backward()
    y = compiled(xb)
    (y * w).sum().backward()
    torch.testing.assert_close(y, layer(x.clone()), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-12, atol=1e-12)
    for a, b in zip(layer.parameters(), twin.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12)


def _compile_training_bcn_and_query_exporting():
    """torch.compile of a training BCN runs its training engine (no 'exports in eval mode only' ExportError), and
    exporting() evaluated inside a compiled function is False."""
    from normdense.kernels.backend import exporting
    layer = triton_layer('bcn-estimate', 'aten').train()
    torch._dynamo.reset()
    x = torch.randn(2, C, 5, 6, dtype=torch.float64, requires_grad=True)
    compiled = torch.compile(layer, backend='aot_eager', fullgraph=True)
    compiled(x).sum().backward()  # the training engine ran: the estimates moved, no ExportError
    assert x.grad is not None and not exporting()
    torch._dynamo.reset()
    assert torch.compile(lambda t: t + exporting(), backend='aot_eager', fullgraph=True)(torch.zeros(1)).item() == 0


# The emulation below needs a torch whose is_compiling() reads False in a function Dynamo runs at trace time
# instead of tracing it (assume_constant_result): 2.5 (is_exporting) to 2.12. From torch 2.13 (measured: 2.13.0,
# 2.14.1) is_compiling() reads True there too, so an is_exporting() that reads it says True while compiling on
# any correct code: the emulation no longer stands for the old Dynamo, and the test would fail on nothing.
EMULATION_TORCH = '2.5 <= torch < 2.13'
_TORCH = torch.torch_version.TorchVersion(torch.__version__.split('+')[0])


@pytest.mark.skipif(not ('2.5' <= _TORCH < '2.13'),
                    reason=f'emulates the Dynamo of torch < 2.12 (pytorch#176347) on {EMULATION_TORCH} only; '
                           f'torch {torch.__version__} ' + ('has no torch.compiler.is_exporting' if _TORCH < '2.5' else
                                                            'runs trace-time functions with is_compiling() True, so '
                                                            'the emulation does not hold')
                           + ' (test_compile_is_not_taken_for_export_here runs instead)')
def test_compile_is_not_taken_for_export(monkeypatch):
    """torch.compile of a training BCN is not mistaken for an export (which would raise 'exports in eval mode
    only'): before torch 2.12 Dynamo folded torch.compiler.is_exporting() to True while compiling
    (pytorch#176347). Emulated here on torch 2.5-2.12 by an is_exporting() that reads is_compiling(), which
    Dynamo folds to True when it traces it; exporting() must evaluate it instead."""
    monkeypatch.setattr(torch.compiler, 'is_exporting', lambda: torch.compiler.is_compiling())
    _compile_training_bcn_and_query_exporting()


def test_compile_is_not_taken_for_export_here():
    """The same on this torch's own Dynamo, without the emulation: on every torch."""
    _compile_training_bcn_and_query_exporting()


def test_unpickled_layer_compiles():
    """A layer loaded with pickle (torch.load of a whole model) is reachable by the compile operator: layers
    register when created, copied or unpickled, since Dynamo before torch 2.12 cannot hand a module to a function
    run at trace time."""
    import pickle
    from normdense.kernels import torch_op
    layer = pickle.loads(pickle.dumps(triton_layer('bcn-batch', 'aten')))
    assert torch_op._LAYERS.get(f'{type(layer).__name__}@{id(layer):x}') is layer  # before any trace
    torch._dynamo.reset()
    x = torch.randn(2, C, 5, 6, dtype=torch.float64)
    torch.testing.assert_close(torch.compile(layer, backend='aot_eager', fullgraph=True)(x), layer(x))
