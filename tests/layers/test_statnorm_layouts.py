"""BCN, GN+PN and Unitization on inputs that are not NCHW-contiguous: channels_last (AMP training, mmcv's
``channels_last`` option) and the permuted views a transformer backbone hands a CNN decode head (SegFormer's
tokens -> NCHW) and maps with H and W swapped in memory (neither layout: the Triton passes read a copy). Forward and
gradients equal those of the contiguous input, in float64, on both backends."""
import pytest
import torch

from normdense.layers import BatchChannelNorm2d, GroupProxyNorm, Unitization2d, set_update_rate

LAYERS = {
    'bcn-batch': lambda: BatchChannelNorm2d(16, num_groups=4, mode='batch'),
    'bcn-estimate': lambda: BatchChannelNorm2d(16, num_groups=4, mode='estimate'),
    'gnpn': lambda: GroupProxyNorm(16, num_groups=4),
    'unitization': lambda: Unitization2d(16, mode='estimate'),
}


def _layouts(x):
    return {'channels_last': x.contiguous(memory_format=torch.channels_last),
            'permuted': x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2),
            'transposed': x.transpose(2, 3).contiguous().transpose(2, 3),
            'strided': torch.cat([x, x], dim=3)[..., :x.shape[3]]}


@pytest.mark.parametrize('name', list(LAYERS))
@pytest.mark.parametrize('training', [True, False])
@pytest.mark.parametrize('backend', ['aten', 'triton'])
def test_non_contiguous_input_equals_contiguous(name, training, backend):
    torch.manual_seed(0)
    x = torch.randn(2, 16, 5, 6, dtype=torch.float64)
    w = torch.randn(2, 16, 5, 6, dtype=torch.float64)
    results = {}
    w_layouts = dict(_layouts(w), contiguous=w)
    for layout, xi in [('contiguous', x)] + list(_layouts(x).items()):
        torch.manual_seed(1)
        layer = LAYERS[name]().double().train(training)
        layer.backend = backend
        if training:
            set_update_rate(layer, 0.1)
        xi = xi.detach().requires_grad_()
        y = layer(xi)
        y.backward(w_layouts[layout])  # dy in the input's layout, as a channels_last network gives it
        results[layout] = (y.detach(), xi.grad, {k: b.clone() for k, b in layer.state_dict().items()})
    ref_y, ref_g, ref_state = results['contiguous']
    for layout, (y, g, state) in results.items():
        torch.testing.assert_close(y, ref_y, rtol=1e-12, atol=1e-12, msg=f'{layout}: output')
        torch.testing.assert_close(g, ref_g, rtol=1e-12, atol=1e-12, msg=f'{layout}: grad')
        for k in ref_state:
            torch.testing.assert_close(state[k], ref_state[k], rtol=1e-12, atol=1e-12, msg=f'{layout}: {k}')
