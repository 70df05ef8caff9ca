"""On a GPU, the kept launches against the normal ones, bitwise: a layer's second training step (every launch kept:
the compiled kernels' own launchers called with the rows of stacked buffers by address, ``kernels/launch.py``)
against the same step of a copy made before it, run after the launch caches were cleared (every launch through
``kernel[grid]``, which binds views). No launch-counting hook is set (a hook turns the kept path off); the test
counts with ``launch.counting()`` instead. Every declared engine case (tests/engine_cases.py), float32 and bfloat16
x, NCL and channels_last, then eval. Without a GPU: reported as not run (the interpreter keeps nothing)."""
import copy

import pytest
import torch

pytest.importorskip('triton')
from normdense.kernels import launch as L  # noqa: E402
from tests.engine_cases import engine_cases  # noqa: E402

pytestmark = pytest.mark.cuda


def _step(layer, x, dy):
    """(y, dx, the parameters' gradients, the buffers) of one training step, then an eval call's output."""
    x = x.detach().requires_grad_()
    layer.train()
    y = layer(x)
    y.backward(dy)
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    buffers = [b.clone() for b in layer.buffers()]
    layer.eval()
    with torch.no_grad():
        y_eval = layer(x)
    return [y, x.grad, *grads, *buffers, y_eval]


@pytest.mark.parametrize('layout', ['ncl', 'cl'])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_kept_launches_equal_normal_launches_bitwise(dtype, layout):
    torch.manual_seed(0)
    x = torch.randn(2, 64, 13, 17, device='cuda').to(dtype)
    if layout == 'cl':
        x = x.to(memory_format=torch.channels_last)
    dy = torch.randn_like(x)
    for name, make in engine_cases(64, 8, backend='triton').items():
        layer = make().cuda()
        _step(layer, x, dy)  # compiles and keeps every launch under this shape's keys
        fresh = copy.deepcopy(layer)  # the same state and configuration (so the same plan and keys)
        with L.counting() as kept:
            got = _step(layer, x, dy)
        torch.cuda.synchronize()
        assert kept[0] > 0 and kept[1] == 0, f'{name}: {kept[1]} of {kept[0]} launches were not kept'
        L.clear()  # the copy's launches go through kernel[grid] (compiled already: no recompilation)
        with L.counting() as normal:
            want = _step(fresh, x, dy)
        torch.cuda.synchronize()
        assert normal[0] == normal[1] == kept[0], (name, normal, kept)
        for i, (a, b) in enumerate(zip(got, want)):
            assert a.dtype == b.dtype and a.shape == b.shape, (name, i)
            assert torch.equal(a, b), f'{name} {dtype} {layout}: output {i} differs, max ' \
                                      f'{(a.double() - b.double()).abs().max().item():.3g}'
