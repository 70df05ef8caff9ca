"""tools/deploy.py --onnx on the packaged demo configs, one per codebase: the exported file, run in ONNX Runtime
by the test itself, equals the *unfused* trained model's eval output; a missing onnxruntime is one line."""
import os.path as osp

import pytest
import torch

from tests.deploy._tools import load_tool
from tests.deploy.test_fuse import _randomize_

pytest.importorskip('onnxruntime', reason='needs the [deploy] extra (make install installs it): not run')

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
DEMOS = {
    'mmseg': ('deeplabv3_r18-d8_bcn-ws_toy-voc.py', ['--opset', '17']),
    'mmdet': ('mask-rcnn_r18_fpn_bcn-ws_toy-coco.py', ['--opset', '11']),  # mmdeploy's default opset
    'mmpretrain': ('resnet18-w32_bcn-ws_toy-imagenet.py', ['--dynamo']),
}


def _tool():
    return load_tool('deploy')


def _trained_checkpoint(config, path):
    from mmengine.config import Config

    from normdense.deploy import build_model_from_config
    cfg = Config.fromfile(config)
    cfg.model.backbone.init_cfg = None  # the demo's pretrained backbone need not exist
    torch.manual_seed(0)
    model = build_model_from_config(cfg)
    model.init_weights()
    _randomize_(model)  # non-trivial statistics and affines, as training leaves them
    torch.save(dict(state_dict=model.state_dict(), meta=dict()), path)
    return model.eval()


@pytest.mark.codebases
@pytest.mark.parametrize('codebase', sorted(DEMOS))
def test_demo_config_exports_and_matches(codebase, tmp_path, capsys):
    if codebase == 'mmpretrain':
        pytest.importorskip('onnxscript', reason='--dynamo needs onnxscript: not run')
    from normdense.deploy.onnx import exportable, run_onnxruntime
    name, extra = DEMOS[codebase]
    config = osp.join(ROOT, 'configs', 'demo', name)
    model = _trained_checkpoint(config, tmp_path / 'trained.pth')
    out = tmp_path / 'model.onnx'
    _tool().main([config, str(tmp_path / 'trained.pth'), '--onnx', str(out), '--shape', '64', '96', *extra])
    printed = capsys.readouterr().out
    assert 'ONNX Runtime vs PyTorch: largest difference' in printed, printed
    x = torch.randn((1, 3, 64, 96), generator=torch.Generator().manual_seed(0))  # the tool's sample
    module, kind = exportable(model)
    with torch.no_grad():
        ref = module(x)
    ref = list(ref) if isinstance(ref, tuple) else [ref]
    got = run_onnxruntime(str(out), (x, ))
    assert len(got) == len(ref) and len(ref) >= (11 if codebase == 'mmdet' else 1)
    for r, g in zip(ref, got):
        assert g.shape == r.shape
        assert (g - r).abs().max() <= 1e-4 * r.abs().max(), (g - r).abs().max()


def test_missing_onnxruntime_is_one_line(tmp_path, monkeypatch, capsys):
    import sys

    from normdense.errors import run_tool
    monkeypatch.setitem(sys.modules, 'onnxruntime', None)
    config = osp.join(ROOT, 'configs', 'demo', DEMOS['mmseg'][0])
    tool = _tool()
    status = run_tool(lambda: tool.main([config, str(tmp_path / 'none.pth'), '--onnx', str(tmp_path / 'm.onnx')]),
                      prog='deploy.py')
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and len(err) == 1
    assert 'needs onnxruntime' in err[0] and 'normdense[deploy]' in err[0]


def test_out_or_onnx_required():
    with pytest.raises(SystemExit):
        _tool().parse_args(['c.py', 'ckpt.pth'])
