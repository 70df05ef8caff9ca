"""WSConv2d's formula and eps travel with its weights (``_extra_state``): a load computes the function the
weights were trained with, says so once per load when the config disagrees, and old state dicts (without
the entry) load strictly under the configured formula."""
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import normdense  # noqa: F401  (registers WSConv2d)
from normdense.layers.ws import WS_FORMULAS, WSConv2d
from tests.layers.test_ws import ws_transcription

FORMULAS = list(WS_FORMULAS)


@pytest.fixture
def warnings_logged(monkeypatch):
    """The lines WSConv2d sends to mmengine's print_log (imported when it logs), with their level."""
    import mmengine.logging
    lines = []
    monkeypatch.setattr(mmengine.logging, 'print_log',
                        lambda msg, logger=None, level=20: lines.append((msg, level)))
    return lines


def _conv(formula='paper', eps=1e-5, seed=0):
    torch.manual_seed(seed)
    conv = WSConv2d(3, 5, 3, padding=1, eps=eps, formula=formula).double()
    with torch.no_grad():
        conv.weight.mul_(3).add_(0.05)
    return conv


def _expected(conv, x, formula, eps):
    return F.conv2d(x, ws_transcription(conv.weight.detach(), eps, formula), conv.bias, padding=1)


def _model(formula, n=6):
    """A whole model: ConvModule-like stacks of WS convs of several shapes, under nested names."""
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Sequential(WSConv2d(3, 8, 3, padding=1, formula=formula), nn.ReLU()),
        *[nn.Sequential(WSConv2d(8, 8, 3, padding=1, bias=False, formula=formula), nn.ReLU()) for _ in range(n)],
        WSConv2d(8, 4, 1, formula=formula)).double()


@pytest.mark.parametrize('formula', FORMULAS)
@pytest.mark.parametrize('eps', [1e-5, 1e-2])
def test_state_dict_round_trip_carries_formula_and_eps(formula, eps):
    from normdense.layers.ws import decode_ws_state
    src = _conv(formula, eps)
    sd = src.state_dict()
    state = sd['_extra_state']
    assert state.dtype == torch.float64 and state.tolist() == [float(FORMULAS.index(formula)), eps]
    assert decode_ws_state(state) == (formula, eps)
    dst = WSConv2d(3, 5, 3, padding=1).double()  # configured: paper, 1e-5
    result = dst.load_state_dict(sd, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert (dst.formula, dst.eps) == (formula, eps)
    x = torch.randn(2, 3, 6, 5, dtype=torch.float64)
    torch.testing.assert_close(dst(x), _expected(src, x, formula, eps), rtol=1e-12, atol=1e-12)
    assert torch.equal(dst.state_dict()['_extra_state'], state)


def test_var_unbiased_weights_into_paper_config_compute_var_unbiased(warnings_logged):
    src = _conv('var_unbiased')
    dst = WSConv2d(3, 5, 3, padding=1).double()
    dst.load_state_dict(src.state_dict())
    x = torch.randn(2, 3, 7, 7, dtype=torch.float64)
    expected = _expected(src, x, 'var_unbiased', 1e-5)
    torch.testing.assert_close(dst(x), expected, rtol=1e-12, atol=1e-12)
    # what the configured formula would have computed is visibly different (the test can tell them apart)
    assert (_expected(src, x, 'paper', 1e-5) - expected).abs().max() > 1e-3 * expected.abs().max()
    assert len(warnings_logged) == 1


@pytest.mark.parametrize('loader', ['torch', 'mmengine'])
def test_whole_model_load_logs_one_line(loader, warnings_logged):
    from mmengine.runner.checkpoint import load_state_dict
    trained = _model('var_unbiased')
    sd = trained.state_dict()
    model = _model('paper')
    if loader == 'torch':
        model.load_state_dict(sd, strict=True)
    else:
        load_state_dict(model, sd, strict=True)
    assert {m.formula for m in model.modules() if isinstance(m, WSConv2d)} == {'var_unbiased'}
    assert len(warnings_logged) == 1, warnings_logged
    msg, level = warnings_logged[0]
    assert level == 30 and "'var_unbiased'" in msg and "'paper'" in msg and 'trained with' in msg
    assert '\n' not in msg
    x = torch.randn(1, 3, 6, 6, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), trained(x), rtol=1e-12, atol=1e-12)
    # a second load is a second event: one more line; a load that changes nothing says nothing
    if loader == 'torch':
        fresh = _model('paper')
        fresh.load_state_dict(sd)
        assert len(warnings_logged) == 2
        model.load_state_dict(sd)
        assert len(warnings_logged) == 2


def test_one_line_per_configured_loaded_pair(warnings_logged):
    trained = nn.Sequential(_model('var_unbiased', 2), _model('std_unbiased', 2))
    model = nn.Sequential(_model('paper', 2), _model('paper', 2))
    model.load_state_dict(trained.state_dict())
    assert len(warnings_logged) == 2
    assert sorted("'var_unbiased'" in m for m, _ in warnings_logged) == [False, True]


def test_old_state_dict_without_extra_state_loads_strictly_as_configured(warnings_logged, tmp_path):
    from mmengine.runner.checkpoint import load_checkpoint, load_state_dict

    from normdense.checkpoint import load_mismatch
    old = {k: v for k, v in _model('var_unbiased').state_dict().items() if not k.endswith('_extra_state')}
    assert len(old) < len(_model('paper').state_dict())
    for load in (lambda m: m.load_state_dict(old, strict=True),
                 lambda m: load_state_dict(m, old, strict=True)):
        model = _model('std_unbiased')
        result = load(model)
        if result is not None:
            assert not result.missing_keys and not result.unexpected_keys
        assert {m.formula for m in model.modules() if isinstance(m, WSConv2d)} == {'std_unbiased'}
    model = _model('std_unbiased')
    assert load_mismatch(model, old) == ([], [], [])
    path = tmp_path / 'old.pth'
    torch.save(dict(state_dict=old, meta={}), path)
    load_checkpoint(model, str(path), strict=True)
    assert not warnings_logged


def test_state_survives_state_dict_tools(tmp_path, warnings_logged):
    """A tensor, not a dict: .cpu(), .half(), weights-only torch.load, mmengine's weights_to_cpu."""
    from mmengine.runner.checkpoint import weights_to_cpu
    sd = _model('std_unbiased').state_dict()
    buf = io.BytesIO()
    torch.save(weights_to_cpu(sd), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    model = _model('paper')
    model.load_state_dict(loaded)
    assert {m.formula for m in model.modules() if isinstance(m, WSConv2d)} == {'std_unbiased'}
    # a half-precision copy rounds eps=1e-5; the same value, so the configured eps stays (no line for it)
    half = {k: v.half() for k, v in sd.items()}
    model = _model('std_unbiased')
    model.half().load_state_dict(half)
    assert {m.eps for m in model.modules() if isinstance(m, WSConv2d)} == {1e-5}
    assert len(warnings_logged) == 1  # the first load only


def test_malformed_state_is_a_clear_error():
    from normdense.layers.ws import ws_state
    conv = WSConv2d(3, 5, 3)
    sd = conv.state_dict()
    for bad, match in ((torch.tensor([3.0, 1e-5]), 'formula index'), (torch.tensor([0.5, 1e-5]), 'formula index'),
                       (torch.tensor([0.0, 0.0]), 'eps must be positive'), (torch.zeros(3), '2-element')):
        with pytest.raises(ValueError, match=f'_extra_state.*{match}'):
            conv.load_state_dict(dict(sd, _extra_state=bad))
    assert ws_state('var_unbiased', 1e-3).tolist() == [2.0, 1e-3]


def test_plain_conv_refuses_ws_state_strictly():
    """WS-trained weights in a plain conv compute another function: a strict load says so."""
    sd = WSConv2d(3, 5, 3).state_dict()
    with pytest.raises(RuntimeError, match='_extra_state'):
        nn.Conv2d(3, 5, 3).load_state_dict(sd, strict=True)
