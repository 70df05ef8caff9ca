import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmcv.cnn import ConvModule, build_conv_layer

import normdense  # noqa: F401  (registers WSConv2d)
from normdense.layers.ws import WSConv2d, standardize_weight


def ws_transcription(weight, eps, formula):
    """Eq. 5 and 7 written out element by element in float64 (plus the two public-code variants)."""
    w = weight.double().reshape(weight.shape[0], -1)
    out = torch.empty_like(w)
    n = w.shape[1]
    for i in range(w.shape[0]):
        mu = sum(w[i, j].item() for j in range(n)) / n
        if formula == 'paper':
            sigma = math.sqrt(sum(w[i, j].item() ** 2 for j in range(n)) / n - mu ** 2 + eps)
        else:
            var_unbiased = sum((w[i, j].item() - mu) ** 2 for j in range(n)) / (n - 1)
            sigma = math.sqrt(var_unbiased) + eps if formula == 'std_unbiased' else math.sqrt(var_unbiased + eps)
        for j in range(n):
            out[i, j] = (w[i, j].item() - mu) / sigma
    return out.reshape(weight.shape)


@pytest.mark.parametrize('formula', ['paper', 'std_unbiased', 'var_unbiased'])
def test_matches_float64_transcription(formula):
    torch.manual_seed(0)
    weight = torch.randn(5, 3, 3, 3, dtype=torch.float64) * 0.3 + 0.1
    eps = 1e-3  # large enough that the three eps placements give visibly different results
    expected = ws_transcription(weight, eps, formula)
    torch.testing.assert_close(standardize_weight(weight, eps, formula), expected, rtol=1e-12, atol=1e-12)

    conv = WSConv2d(3, 5, 3, padding=1, bias=True, eps=eps, formula=formula).double()
    with torch.no_grad():
        conv.weight.copy_(weight)
    x = torch.randn(2, 3, 7, 6, dtype=torch.float64)
    torch.testing.assert_close(conv(x), F.conv2d(x, expected, conv.bias, padding=1), rtol=1e-12, atol=1e-12)


def test_formulas_differ_and_standardize():
    w = torch.randn(4, 8, 3, 3, dtype=torch.float64)
    outs = {f: standardize_weight(w, 1e-2, f) for f in ('paper', 'std_unbiased', 'var_unbiased')}
    assert not torch.allclose(outs['paper'], outs['var_unbiased'])
    assert not torch.allclose(outs['std_unbiased'], outs['var_unbiased'])
    flat = standardize_weight(w, 0.0, 'paper').reshape(4, -1)
    torch.testing.assert_close(flat.mean(1), torch.zeros(4, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(flat.var(1, correction=0), torch.ones(4, dtype=torch.float64))


def test_gradcheck_float64():
    torch.manual_seed(1)
    conv = WSConv2d(2, 3, 3, stride=2, padding=1, groups=1).double()
    x = torch.randn(1, 2, 5, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda inp, w: F.conv2d(inp, standardize_weight(w), conv.bias, 2, 1),
                                    (x, conv.weight))
    grouped = WSConv2d(4, 4, 3, padding=1, groups=2, formula='var_unbiased').double()
    assert torch.autograd.gradcheck(lambda inp: grouped(inp), (torch.randn(1, 4, 4, 4, dtype=torch.float64,
                                                                              requires_grad=True),))


def test_train_and_eval_are_identical():
    conv = WSConv2d(3, 4, 3)
    x = torch.randn(2, 3, 8, 8)
    y_train = conv.train()(x)
    torch.testing.assert_close(conv.eval()(x), y_train)


def test_state_dict_round_trip_and_plain_conv_keys():
    conv = WSConv2d(3, 4, 3, formula='var_unbiased').double()
    plain = nn.Conv2d(3, 4, 3)
    # a plain conv's keys plus the formula and eps (see tests/layers/test_ws_state.py)
    assert list(conv.state_dict()) == list(plain.state_dict()) + ['_extra_state']
    other = WSConv2d(3, 4, 3).double()  # configured 'paper': the loaded state switches it
    other.load_state_dict(conv.state_dict())
    assert other.formula == 'var_unbiased'
    x = torch.randn(1, 3, 6, 6, dtype=torch.float64)
    expected = F.conv2d(x, ws_transcription(conv.weight.detach(), 1e-5, 'var_unbiased'), conv.bias)
    torch.testing.assert_close(other(x), expected, rtol=1e-12, atol=1e-12)


def test_half_precision_weights_standardized_in_fp32():
    # A small-fan-in fp16 weight's variance (~1e-6) sits in fp16's subnormal range: standardizing in fp16
    # loses the unit variance by percents, the fp32 path keeps it.
    torch.manual_seed(0)
    w16 = (torch.randn(4, 16, 3, 3) * 1e-3).half()
    out = standardize_weight(w16, eps=1e-12)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    torch.testing.assert_close(out, standardize_weight(w16.float(), eps=1e-12))
    ones = torch.ones(4)
    torch.testing.assert_close(out.var((1, 2, 3), correction=0), ones, atol=1e-5, rtol=0)
    centred = w16 - w16.mean((1, 2, 3), keepdim=True)
    naive = centred / ((centred * centred).mean((1, 2, 3), keepdim=True) + 1e-12).sqrt()
    assert (naive.float().var((1, 2, 3), correction=0) - ones).abs().max() > 1e-3


@pytest.mark.parametrize('formula', ['paper', 'std_unbiased', 'var_unbiased'])
def test_autocast_bfloat16_standardizes_in_fp32(formula):
    """Under autocast the weight is standardized in fp32 (round-off of the float64 transcription); only
    the convolution runs in bfloat16, so the output is the bfloat16 conv of the exactly standardized weight.
    The tolerances are round-off: a wrong formula (sqrt(72/71) - 1 = 0.7 % here) fails both checks."""
    torch.manual_seed(0)
    conv = WSConv2d(8, 8, 3, padding=1, formula=formula)
    x = torch.randn(1, 8, 10, 10)
    expected_w = ws_transcription(conv.weight.detach(), conv.eps, formula)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        w = conv.standardized_weight()
        y = conv(x)
    assert w.dtype == torch.float32 and y.dtype == torch.bfloat16
    torch.testing.assert_close(w.double(), expected_w, rtol=1e-6, atol=1e-6)
    # the same bfloat16 operands convolved in float64: differs only by accumulation order and the final
    # rounding to bfloat16 (half an ulp, 2**-9 relative)
    ref = F.conv2d(x.bfloat16().double(), expected_w.bfloat16().double(), conv.bias.bfloat16().double(), padding=1)
    err = (y.double() - ref).abs()
    assert (err <= 2 ** -8 * ref.abs() + 1e-3 * ref.abs().max()).all(), err.max()


def test_bad_formula_rejected_at_build():
    with pytest.raises(ValueError, match='formula'):
        WSConv2d(3, 4, 3, formula='nope')
    with pytest.raises(ValueError, match='formula'):
        build_conv_layer(dict(type='WSConv2d', formula='nope'), 3, 4, 3)


def test_std_unbiased_matches_mmcv_convws():
    torch.manual_seed(0)
    ours = build_conv_layer(dict(type='WSConv2d', formula='std_unbiased'), 3, 6, 3, padding=1)
    theirs = build_conv_layer(dict(type='ConvWS'), 3, 6, 3, padding=1)
    # mmcv's ConvWS keeps no formula in its state (it is always std_unbiased): leave ours out
    theirs.load_state_dict({k: v for k, v in ours.state_dict().items() if k != '_extra_state'})
    x = torch.randn(2, 3, 9, 9, dtype=torch.float64)
    ours, theirs = ours.double(), theirs.double()
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-12, atol=1e-12)
    expected = F.conv2d(x, ws_transcription(ours.weight.detach(), 1e-5, 'std_unbiased'), ours.bias, padding=1)
    torch.testing.assert_close(ours(x), expected, rtol=1e-12, atol=1e-12)


def test_conv_module_and_registry():
    module = ConvModule(4, 8, 3, padding=1, conv_cfg=dict(type='WSConv2d'), norm_cfg=dict(type='GN', num_groups=4))
    assert isinstance(module.conv, WSConv2d) and module.conv.bias is None  # ConvModule drops the bias before a norm
    assert module(torch.randn(1, 4, 5, 5)).shape == (1, 8, 5, 5)


def test_convert_conv_swaps_and_excludes():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Sequential(nn.Conv2d(4, 4, 1)), nn.Linear(2, 2))
    ref_weight = model[0].weight.detach().clone()
    out = WSConv2d.convert_conv(model, formula='var_unbiased', exclude=lambda name, conv: name == '2.0')
    assert out is model
    assert type(model[0]) is WSConv2d and model[0].formula == 'var_unbiased'
    assert type(model[2][0]) is nn.Conv2d and type(model[3]) is nn.Linear
    torch.testing.assert_close(model[0].weight, ref_weight)
    x = torch.randn(1, 3, 6, 6, dtype=torch.float64)
    expected = F.conv2d(x, ws_transcription(ref_weight, 1e-5, 'var_unbiased'), model[0].bias.double())
    torch.testing.assert_close(model[0].double()(x), expected, rtol=1e-12, atol=1e-12)
    assert type(WSConv2d.convert_conv(nn.Conv2d(2, 2, 1))) is WSConv2d
