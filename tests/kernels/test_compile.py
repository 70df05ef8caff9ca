"""The Triton backend under torch.compile: a layer's call is one torch.library operator (normdense::statnorm,
its backward normdense::statnorm_backward), so Dynamo does not graph-break on the kernels, and the compiled
model computes what the eager Triton path does (outputs, gradients, buffers, estimate iterations)."""
import copy

import pytest
import torch
import torch._dynamo

from tests.layers.test_fused import CASES, C, assert_same, make, run

COMPILED_CASES = ['bcn-estimate', 'bcn-batch-channel-affine', 'gnpn-gelu', 'lnpn-silu-no-proxy-affine',
                  'unitization-batch-cumulative', 'unitization-estimate']


def triton_layer(name):
    layer, _ = make(name)
    layer.backend = 'triton'
    return layer


@pytest.mark.parametrize('train', [True, False])
@pytest.mark.parametrize('name', sorted(CASES))
def test_no_graph_break(name, train, device):
    layer = triton_layer(name).to(device).train(train)
    torch._dynamo.reset()
    x = torch.randn(2, C, 5, 6, dtype=torch.float64, device=device, requires_grad=True)
    explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count == 0, [str(b.reason).splitlines()[0] for b in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.parametrize('name', COMPILED_CASES)
def test_compiled_equals_eager(name, device):
    """torch.compile(fullgraph=True, backend='aot_eager') against the eager Triton path, float64: three
    training steps (estimates and running statistics move, the iteration ends at each backward) and eval."""
    eager = triton_layer(name).to(device)
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
    from normdense.layers import _statnorm_compile as op
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
