"""mmdeploy 1.3.1's torch2onnx with our ONNX Runtime deploy configs (configs/deploy/) on the demo DeepLabV3 and
the demo Mask R-CNN, with every norm of the switch (BN the control; BCN+WS is the demo config as written),
through normdense.deploy.mmdeploy (the compatibility shim torch >= 2.9 needs). Random weights with non-trivial
statistics and affines. Each .onnx passes onnx.checker and runs in plain ONNX Runtime (standard operators only):
the segmentor's logits equal the PyTorch model's (<= 1e-4 relative); the detector's sizeable top-20 detections
(boxes, scores, labels, masks) are found among ONNX Runtime's, against mmdeploy's rewritten PyTorch forward
(its post-processing is what the graph holds) with our layers in their own eval path."""
import os.path as osp

import pytest
import torch

pytest.importorskip('onnxruntime', reason='needs the [deploy] extra (make install installs it): not run')
pytest.importorskip('mmdeploy', reason='needs mmdeploy 1.3.1 (pip install --no-deps "mmdeploy==1.3.1" && pip '
                                       'install aenum multiprocess prettytable terminaltables six): not run')

from normdense.deploy import mmdeploy as md  # noqa: E402
from tests.deploy._tools import load_tool  # noqa: E402

pytestmark = pytest.mark.codebases

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
SEG = osp.join(ROOT, 'configs', 'demo', 'deeplabv3_r18-d8_bcn-ws_toy-voc.py')
DET = osp.join(ROOT, 'configs', 'demo', 'mask-rcnn_r18_fpn_bcn-ws_toy-coco.py')
SEG_DEPLOY = osp.join(ROOT, 'configs', 'deploy', 'segmentation_onnxruntime_static.py')
DET_DEPLOY = osp.join(ROOT, 'configs', 'deploy', 'instance-seg_onnxruntime_static.py')
NORMS = ('bn', 'bcn-ws', 'gn-ws', 'gn', 'gn-pn', 'iternorm', 'unitization')


def _randomize_(model, seed=0):
    """Every norm's statistics and affines off their initial values (what training leaves)."""
    from normdense.layers.iternorm import IterNorm
    g = torch.Generator().manual_seed(seed)

    def fill(t, lo, hi):
        t.copy_((torch.rand(t.shape, generator=g, dtype=torch.float64) * (hi - lo) + lo).to(t))

    ranges = dict(running_mean=(-0.5, 0.5), running_var=(0.3, 2.0), weight=(0.5, 1.5), bias=(-0.3, 0.3),
                  batch_weight=(0.5, 1.5), batch_bias=(-0.3, 0.3), alpha=(0.1, 0.9), proxy_beta=(-0.3, 0.3),
                  proxy_gamma=(-0.3, 0.3))
    with torch.no_grad():
        for m in model.modules():
            if not (hasattr(m, 'running_mean') or isinstance(m, torch.nn.GroupNorm) or hasattr(m, 'proxy_beta')):
                continue  # not a norm layer (convs have weights too)
            for name, (lo, hi) in ranges.items():
                t = getattr(m, name, None)
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    fill(t, lo, hi)
            if isinstance(m, IterNorm):
                d = m.running_wm.shape[-1]  # near the identity: 36 of them in a row must not blow up
                noise = torch.randn(m.running_wm.shape, generator=g, dtype=torch.float64).to(m.running_wm)
                m.running_wm.copy_(torch.eye(d).to(m.running_wm) + 0.1 * noise / d ** 0.5)
    return model


def _case(config, norm, tmp_path):
    """The demo config switched to ``norm`` (BCN+WS: as written), its randomized model (eval mode) and a
    checkpoint of it. The detector keeps 100 proposals (the demo: 300), which halves the RoI heads' time."""
    from mmengine.config import Config

    from normdense.deploy import build_model_from_config
    from normdense.norm_switch import switch_norm
    cfg = Config.fromfile(config)
    cfg.model.backbone.init_cfg = None  # the demo's pretrained backbone need not exist
    if norm != 'bcn-ws':
        switch_norm(cfg, norm)
    if cfg.model.get('test_cfg', {}).get('rpn'):
        cfg.model.test_cfg.rpn.max_per_img = 100
    torch.manual_seed(0)
    model = build_model_from_config(cfg)
    model.init_weights()
    _randomize_(model)
    checkpoint = str(tmp_path / 'trained.pth')
    torch.save(dict(state_dict=model.state_dict(), meta=dict()), checkpoint)
    return cfg, model.eval(), checkpoint


@pytest.mark.parametrize('norm', NORMS)
def test_deeplabv3_exports_and_matches_in_onnxruntime(norm, tmp_path):
    """The graph is mmdeploy's rewrite of EncoderDecoder.predict: encode_decode, the logits resized to the input
    (with_argmax=False: the logits themselves, to compare numerically)."""
    from normdense.deploy.onnx import run_onnxruntime
    cfg, model, checkpoint = _case(SEG, norm, tmp_path)
    deploy = md.deploy_config(SEG_DEPLOY)
    deploy.onnx_config.input_shape = [64, 64]
    deploy.codebase_config.with_argmax = False
    path = md.export(deploy, cfg, checkpoint, str(tmp_path / 'work'))  # onnx.checker inside
    x = torch.randn((1, 3, 64, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model.encode_decode(x, [dict(img_shape=(64, 64))])
    got, = run_onnxruntime(path, [x])
    assert got.shape == ref.shape == (1, 6, 64, 64)
    scale = ref.abs().max()
    assert (got - ref).abs().max() <= 1e-4 * scale, ((got - ref).abs().max() / scale).item()


@pytest.mark.slow  # 12-18 s each, 100 s for the seven (mmdeploy's rewriter set-up is most of it)
@pytest.mark.parametrize('norm', NORMS)
def test_mask_rcnn_exports_and_runs_in_onnxruntime(norm, tmp_path):
    import onnx
    cfg, _, checkpoint = _case(DET, norm, tmp_path)
    deploy = md.deploy_config(DET_DEPLOY)
    deploy.onnx_config.input_shape = [128, 128]
    path = md.export(deploy, cfg, checkpoint, str(tmp_path / 'work'))
    ops = {(n.domain, n.op_type) for n in onnx.load(path).graph.node}
    assert {('', 'NonMaxSuppression'), ('', 'RoiAlign')} <= ops and all(d == '' for d, _ in ops)  # no custom ops
    names, ref, got = md.pytorch_and_onnxruntime(deploy, cfg, checkpoint, path)
    assert names == ['dets', 'labels', 'masks']
    assert [tuple(t.shape) for t in got] == [(1, 100, 5), (1, 100), (1, 100, 28, 28)]
    matched = md.match_detections(ref, got, top=20)
    assert matched['compared'] >= 10 and matched['matched'] == matched['compared'], matched


def _tool():
    return load_tool('mmdeploy_torch2onnx')


def test_tool_with_the_shipped_config(tmp_path, capsys):
    """The deploy config as shipped (with_argmax: labels; the demo's 80x80 test size) and config names looked up
    in normdense's configs, as `python -m normdense.tools mmdeploy_torch2onnx ...` passes them."""
    _, _, checkpoint = _case(SEG, 'bcn-ws', tmp_path)
    work = tmp_path / 'work'
    _tool().main(['deploy/segmentation_onnxruntime_static.py', 'demo/deeplabv3_r18-d8_bcn-ws_toy-voc.py', checkpoint,
                  '--work-dir', str(work), '--check'])
    printed = capsys.readouterr().out
    assert f'to {work / "end2end.onnx"}' in printed and 'output [1, 1, 80, 80]' in printed, printed
    # labels: equal wherever PyTorch's top two classes are not within float32 rounding of each other
    equal = float(printed.split('ONNX Runtime vs PyTorch: ')[1].split('%')[0])
    assert equal >= 99.5, printed


def test_a_checkpoint_of_another_norm_is_refused_in_one_line(tmp_path):
    """mmdeploy loads non-strictly: the tool checks first (here a BCN+WS checkpoint for the GN config)."""
    from normdense.checkpoint import CheckpointMismatchError
    from normdense.errors import known_error
    _, _, checkpoint = _case(SEG, 'bcn-ws', tmp_path)
    with pytest.raises(CheckpointMismatchError) as e:
        _tool().main([SEG_DEPLOY, SEG, checkpoint, '--norm', 'gn', '--work-dir', str(tmp_path / 'work')])
    message = known_error(e.value)
    assert message and '\n' not in message and 'does not match the model config' in message
    assert not (tmp_path / 'work').exists()  # refused before mmdeploy ran


def test_missing_mmdeploy_is_one_line(tmp_path, monkeypatch, capsys):
    import sys

    from normdense.errors import run_tool
    monkeypatch.setitem(sys.modules, 'mmdeploy', None)
    tool = _tool()
    status = run_tool(lambda: tool.main([SEG_DEPLOY, SEG, str(tmp_path / 'none.pth')]), prog='mmdeploy_torch2onnx.py')
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and len(err) == 1
    assert 'needs mmdeploy' in err[0] and 'pip install --no-deps "mmdeploy==1.3.1"' in err[0]


def test_model_config_takes_every_form_of_the_norm_switch():
    """mmdeploy builds cfg.model itself: the runner form (tools/train.py --norm) and the model-type form
    (NormSwitched) become the switched plain config."""
    from mmengine.config import Config
    runner_form = Config.fromfile(SEG)
    runner_form.runner_type, runner_form.normdense_norm = 'NormSwitchRunner', 'gn-pn'
    type_form = Config.fromfile(SEG)
    type_form.model = dict(type='NormSwitched', norm='gn-pn', model=type_form.model.to_dict())
    for cfg in (runner_form, type_form, md.model_config(SEG, norm='gn-pn')):
        model = md.model_config(cfg).model
        assert model.type == 'EncoderDecoder' and model.backbone.type == 'PNResNetV1c'
        assert model.backbone.norm_cfg.type == 'GNPN' and model.decode_head.norm_cfg.type == 'GNAuto'


def test_compat_shim_is_scoped():
    """Inside mmdeploy_compat: torch.onnx.export defaults to the TorchScript exporter, symbolic_opset9 has
    _cast_Long (mmdeploy's RoIAlign symbolic), and nothing of mmdeploy's is patched; outside, torch is as it was."""
    import inspect

    import torch.onnx.symbolic_opset9 as opset9
    from mmdeploy.core.rewriters import function_rewriter
    export, had_cast, lookup = torch.onnx.export, hasattr(opset9, '_cast_Long'), function_rewriter.get_frame_func
    dynamo_default = inspect.signature(export).parameters['dynamo'].default
    with md.mmdeploy_compat():
        assert hasattr(opset9, '_cast_Long')
        assert (torch.onnx.export is export) == (dynamo_default is False)
        assert function_rewriter.get_frame_func is lookup
    assert torch.onnx.export is export and hasattr(opset9, '_cast_Long') == had_cast
    assert function_rewriter.get_frame_func is lookup
