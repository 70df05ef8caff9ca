"""PretrainedBackbone: strict loading of converted backbones, the produced_by hint, and the conv type / WS
formula recorded in a converted checkpoint's meta."""
import pytest
import torch

from normdense.layers.ws import WSConv2d
from tests.pretrain_utils import build_backbone, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures('single_thread')

WS_BCN = dict(type='ResNet', depth=18, conv_cfg=dict(type='WSConv2d'), norm_cfg=dict(type='BCN', num_groups=32))
PLAIN_BCN = dict(WS_BCN, conv_cfg=None)


def _save(tmp_path, meta, cfg=WS_BCN, prefix='', name='ck.pth', ws_state=False, formula='paper'):
    """A backbone file; ``ws_state=False``: without the WS formulas in the weights (as converted before
    they were saved there: only the meta records them)."""
    source = build_backbone('mmdet', dict(cfg, conv_cfg=dict(cfg['conv_cfg'], formula=formula))
                            if cfg['conv_cfg'] else cfg)
    sd = {f'{prefix}{k}': v for k, v in source.state_dict().items() if ws_state or not k.endswith('_extra_state')}
    path = str(tmp_path / name)
    torch.save(dict(state_dict=sd, meta=meta), path)
    return path, source


def _formulas(model):
    return {m.formula for m in model.modules() if isinstance(m, WSConv2d)}


def test_missing_file_names_the_producing_command(tmp_path):
    cfg = dict(WS_BCN, init_cfg=dict(type='PretrainedBackbone', checkpoint=str(tmp_path / 'none.pth'),
                                     produced_by='python tools/convert_checkpoint.py A B --to mmdet'))
    with pytest.raises(FileNotFoundError, match='convert_checkpoint.py A B'):
        build_backbone('mmdet', cfg)


def test_recorded_ws_formula_is_applied(tmp_path):
    path, source = _save(tmp_path, dict(conv='WSConv2d', ws_formula='std_unbiased'))
    model = build_backbone('mmdet', WS_BCN, checkpoint=path)  # configured formula: 'paper'
    assert _formulas(model) == {'std_unbiased'}
    ours, theirs = model.state_dict(), source.state_dict()
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert k.endswith('_extra_state') or torch.equal(ours[k], theirs[k])


def test_formula_saved_in_the_weights_is_applied(tmp_path):
    """Converted by this version: the formula is in the weights, the meta need not say it."""
    path, source = _save(tmp_path, dict(epoch=3), ws_state=True, formula='var_unbiased')
    model = build_backbone('mmdet', WS_BCN, checkpoint=path)
    assert _formulas(model) == {'var_unbiased'}
    for a, b in zip(model.state_dict().values(), source.state_dict().values()):
        assert torch.equal(a, b)
    # WS-trained weights (known from the weights alone) into plain convs: a clear error, or left out on request
    with pytest.raises(ValueError, match="weight-standardized convs .*formula='var_unbiased'"):
        build_backbone('mmdet', PLAIN_BCN, checkpoint=path)
    cfg = dict(PLAIN_BCN, init_cfg=dict(type='PretrainedBackbone', checkpoint=path, check_conv=False))
    build_backbone('mmdet', cfg)


def test_conv_type_mismatch_raises(tmp_path):
    ws_path, _ = _save(tmp_path, dict(conv='WSConv2d', ws_formula='var_unbiased'), name='ws.pth', ws_state=True,
                       formula='var_unbiased')
    with pytest.raises(ValueError, match="formula='var_unbiased'"):
        build_backbone('mmdet', PLAIN_BCN, checkpoint=ws_path)
    plain_path, _ = _save(tmp_path, dict(conv='Conv2d', ws_formula=None), cfg=PLAIN_BCN, name='plain.pth')
    with pytest.raises(ValueError, match='plain convs'):
        build_backbone('mmdet', WS_BCN, checkpoint=plain_path)
    # opting out loads as configured
    cfg = dict(PLAIN_BCN, init_cfg=dict(type='PretrainedBackbone', checkpoint=ws_path, check_conv=False))
    build_backbone('mmdet', cfg)


def test_checkpoint_without_conv_meta_loads_as_configured(tmp_path):
    path, _ = _save(tmp_path, dict(epoch=3))
    model = build_backbone('mmdet', WS_BCN, checkpoint=path)
    assert _formulas(model) == {'paper'}


def test_prefix_and_strictness(tmp_path):
    path, _ = _save(tmp_path, {}, prefix='backbone.')
    cfg = dict(WS_BCN, init_cfg=dict(type='PretrainedBackbone', checkpoint=path, prefix='backbone.'))
    build_backbone('mmdet', cfg)
    with pytest.raises(ValueError, match='no keys under the prefix'):
        build_backbone('mmdet', dict(WS_BCN, init_cfg=dict(type='PretrainedBackbone', checkpoint=path,
                                                          prefix='model.')))
    with pytest.raises(RuntimeError, match='unexpected key'):  # strict: the prefixed keys do not fit
        build_backbone('mmdet', WS_BCN, checkpoint=path)
