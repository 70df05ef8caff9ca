"""mmdet, mmseg and mmpretrain are optional: a detection-only or segmentation-only environment imports
normdense and builds its configs' models, and what needs a missing codebase fails with one line naming the
extra. Each environment is a subprocess whose import system refuses the missing codebases, as an
environment without them would (ModuleNotFoundError, which the codebases' own optional imports expect)."""
import json
import os.path as osp
import subprocess
import sys

import pytest

from normdense import codebases

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
DET_CONFIG = 'configs/demo/mask-rcnn_r18_fpn_bcn-ws_toy-coco.py'
SEG_CONFIG = 'configs/demo/deeplabv3_r18-d8_bcn-ws_toy-voc.py'

BLOCKER = '''
import sys
class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
            raise ModuleNotFoundError(f'No module named {{name!r}}', name=name)
sys.meta_path.insert(0, _NotInstalled())
'''


def run_without(blocked, body):
    """Run ``body`` in a fresh interpreter where the ``blocked`` top-level packages cannot be imported;
    it prints one JSON line, returned parsed."""
    code = BLOCKER.format(blocked=set(blocked)) + body
    out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


BUILD = '''
import json
import normdense
from normdense import jobs, registry
from normdense.codebases import MissingCodebase
imported_at_import = sorted(m for m in ('mmdet', 'mmseg', 'mmpretrain') if m in sys.modules)
cfg = jobs.load_config({config!r})
registry_module = __import__(cfg.default_scope + '.registry', fromlist=['MODELS'])
model = registry_module.MODELS.build(cfg.model)
pn = registry.MODELS.build(dict(type='PNResNet', depth=18, base_channels=8, stem_channels=8,
                                norm_cfg=dict(type='GNPN', num_groups=4)))
try:
    jobs.load_config({other!r})
    other = None
except MissingCodebase as e:
    other = str(e)
print(json.dumps(dict(imported=imported_at_import, model=type(model).__name__,
                      pn_base=[c.__module__ for c in type(pn).__mro__ if c.__name__ == 'ResNet'],
                      bcn=sum(type(m).__name__ == 'BatchChannelNorm2d' for m in model.modules()),
                      other=other)))
'''


def test_detection_only_environment():
    r = run_without({'mmseg', 'mmpretrain'}, BUILD.format(config=DET_CONFIG, other=SEG_CONFIG))
    assert 'mmseg' not in r['imported'] and 'mmpretrain' not in r['imported']
    assert r['model'] == 'MaskRCNN' and r['bcn'] > 0
    assert r['pn_base'] == ['mmdet.models.backbones.resnet']  # PNResNet on mmdet's ResNet
    assert '\n' not in r['other'] and "pip install 'normdense[seg]'" in r['other']


def test_segmentation_only_environment():
    r = run_without({'mmdet', 'mmpretrain'}, BUILD.format(config=SEG_CONFIG, other=DET_CONFIG))
    assert 'mmdet' not in r['imported'] and 'mmpretrain' not in r['imported']
    assert r['model'] == 'EncoderDecoder' and r['bcn'] > 0
    assert r['pn_base'] == ['mmseg.models.backbones.resnet']
    assert '\n' not in r['other'] and "pip install 'normdense[det]'" in r['other']


def test_no_codebase_at_all():
    """torch + mmengine + mmcv only: every layer registers; PNResNet says which extra it needs."""
    r = run_without({'mmdet', 'mmseg', 'mmpretrain'}, '''
import json
import normdense
from mmengine.registry import MODELS
from normdense.codebases import MissingCodebase
layer = MODELS.build(dict(type='BCN', num_features=8, num_groups=4))
try:
    MODELS.build(dict(type='PNResNet', depth=18))
    error = None
except MissingCodebase as e:
    error = str(e)
print(json.dumps(dict(imported=sorted(m for m in ('mmdet', 'mmseg', 'mmpretrain') if m in sys.modules),
                      layer=type(layer).__name__, error=error)))
''')
    assert r['imported'] == [] and r['layer'] == 'BatchChannelNorm2d'
    assert '\n' not in r['error'] and "'normdense[seg]' or 'normdense[det]'" in r['error']


def test_missing_base_config_codebase_is_one_line(tmp_path, monkeypatch):
    """A `mmseg::` base of a codebase that is not installed: mmengine raises from inside its parser,
    read_config names the extra."""
    import mmengine.config.config as mm_config
    real = mm_config.is_installed
    monkeypatch.setattr(mm_config, 'is_installed', lambda package: package != 'mmsegmentation' and real(package))
    config = tmp_path / 'cfg.py'
    config.write_text("_base_ = 'mmseg::deeplabv3/deeplabv3_r50-d8_4xb4-20k_voc12aug-512x512.py'\n")
    with pytest.raises(codebases.MissingCodebase) as e:
        codebases.read_config(str(config))
    assert str(e.value) == (f"config {config} needs mmsegmentation (mmseg), which is not installed: "
                            "pip install 'normdense[seg]' (or pip install mmsegmentation)")
