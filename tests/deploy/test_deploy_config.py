"""What tools/deploy.py makes of its config and arguments: every config tools/train.py takes (a norm switch in
each of its forms, mmseg:: names with --norm), one line for a checkpoint of another norm (tools/deploy.py,
tools/test.py's strict load, load_fused), the sample size of a non-square test resize, the --opset default its
help states, and normdense.deploy.io.switched_config of a switch that carries exclude and group settings."""
import os.path as osp
import re

import pytest
import torch

from tests.deploy._tools import load_tool

pytestmark = pytest.mark.codebases

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
SEG = osp.join(ROOT, 'configs', 'demo', 'deeplabv3_r18-d8_bcn-ws_toy-voc.py')
CITYSCAPES = 'mmseg::deeplabv3/deeplabv3_r18-d8_4xb2-80k_cityscapes-512x1024.py'


def _tool():
    return load_tool('deploy')


def _checkpoint(config, norm, path):
    """A checkpoint of ``config`` switched to ``norm`` (what tools/train.py CONFIG --norm NORM saves)."""
    from normdense.deploy.io import build_switched, switched_config
    torch.manual_seed(0)
    model = build_switched(*switched_config(config, norm))
    torch.save(dict(state_dict=model.state_dict(), meta=dict()), path)
    return str(path)


@pytest.fixture(scope='module')
def gn_pn_checkpoint(tmp_path_factory):
    return _checkpoint(SEG, 'gn-pn', tmp_path_factory.mktemp('gnpn') / 'gnpn.pth')


def _form_args(form, tmp_path):
    """(config, extra arguments) of the demo config switched to gn-pn in ``form``."""
    if form == 'norm':
        return SEG, ['--norm', 'gn-pn']
    if form == 'cfg-options':
        return SEG, ['--cfg-options', 'normdense_norm=gn-pn']
    path = tmp_path / 'switched.py'
    if form == 'in-config':  # what a user who writes the runner form in the config has
        path.write_text(f"_base_ = [{SEG!r}]\nrunner_type = 'NormSwitchRunner'\nnormdense_norm = 'gn-pn'\n")
    else:  # the model-type form
        path.write_text(f"_base_ = [{SEG!r}]\nmodel = dict(_delete_=True, type='NormSwitched', norm='gn-pn', "
                        'model={{_base_.model}})\n')
    return str(path), []


@pytest.mark.parametrize('form', ['norm', 'cfg-options', 'in-config', 'NormSwitched'])
def test_deploy_takes_a_switched_config_in_every_form(form, gn_pn_checkpoint, tmp_path, capsys):
    """A gn-pn checkpoint of the demo loads strictly and fuses, whichever way the config says gn-pn."""
    from normdense.deploy import load_fused
    config, extra = _form_args(form, tmp_path)
    out = tmp_path / 'fused.pth'
    _tool().main([config, gn_pn_checkpoint, str(out), *extra])
    assert 'replaced 11 norms without a conv' in capsys.readouterr().out
    assert torch.load(out, weights_only=True)['meta']['norm'] == 'gn-pn'
    fused = load_fused(config, str(out), norm='gn-pn' if config == SEG else None)
    assert sum(type(m) is torch.nn.GroupNorm for m in fused.modules()) == 11  # the GN+PN layers' GN stage


def test_deploy_takes_the_runner_form_with_onnx(gn_pn_checkpoint, tmp_path, capsys):
    """The acceptance's command: the config as written, the switch in --cfg-options, --onnx."""
    out = tmp_path / 'model.onnx'
    _tool().main([SEG, gn_pn_checkpoint, '--onnx', str(out), '--shape', '64', '64', '--cfg-options',
                  'normdense_norm=gn-pn'])
    printed = capsys.readouterr().out
    diff = float(printed.split('largest difference ')[1].split()[0])
    assert out.exists() and diff <= 1e-4, printed


def test_deploy_takes_a_package_name_with_norm(tmp_path, capsys):
    ckpt = _checkpoint(CITYSCAPES, 'gn-ws', tmp_path / 'gnws.pth')
    _tool().main([CITYSCAPES, ckpt, str(tmp_path / 'fused.pth'), '--norm', 'gn-ws'])
    assert 'made ' in capsys.readouterr().out


def _one_line(tool, argv, capsys, prog):
    from normdense.errors import run_tool
    status = run_tool(lambda: tool.main(argv), prog=prog)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and len(err) == 1, err
    return err[0]


def test_a_checkpoint_of_another_norm_is_one_line(gn_pn_checkpoint, tmp_path, capsys, monkeypatch):
    """The config as written (BCN+WS) with a gn-pn checkpoint: one short line naming both norms and the fix,
    no key lists and no partial load's advice; --debug (NORMDENSE_DEBUG) adds the keys."""
    from normdense.checkpoint import CheckpointMismatchError, check_load
    from normdense.deploy.io import build_switched, switched_config
    line = _one_line(_tool(), [SEG, gn_pn_checkpoint, str(tmp_path / 'fused.pth')], capsys, 'deploy.py')
    assert 'holds gn-pn layers and the config builds bcn-ws: pass --norm gn-pn' in line, line
    assert 'allow-partial-load' not in line and 'missing keys' not in line and len(line) < 300, line
    # tools/test.py's strict load (StrictLoadHook -> check_load): the same line
    model = build_switched(*switched_config(SEG))
    state = torch.load(gn_pn_checkpoint, weights_only=True)
    with pytest.raises(CheckpointMismatchError) as info:
        check_load(model, state, 'ckpt.pth')
    message = str(info.value)
    assert message.startswith('checkpoint ckpt.pth holds gn-pn layers and the config builds bcn-ws: pass --norm '
                              'gn-pn') and 'allow-partial-load' not in message and len(message) < 300, message
    monkeypatch.setenv('NORMDENSE_DEBUG', '1')
    with pytest.raises(CheckpointMismatchError, match='missing keys'):
        check_load(model, state, 'ckpt.pth')


def test_load_fused_of_another_norm_is_one_line(gn_pn_checkpoint, tmp_path, capsys):
    from normdense.checkpoint import CheckpointMismatchError
    from normdense.deploy import load_fused
    out = tmp_path / 'fused.pth'
    _tool().main([SEG, gn_pn_checkpoint, str(out), '--norm', 'gn-pn'])
    with pytest.raises(CheckpointMismatchError) as info:
        load_fused(SEG, str(out))
    message = str(info.value)
    assert '\n' not in message and 'holds gn-pn layers and the config builds bcn-ws' in message, message
    assert "norm='gn-pn'" in message and len(message) < 300


def test_opset_default_is_what_the_help_says(capsys):
    tool = _tool()
    with pytest.raises(SystemExit):
        tool.parse_args(['--help'])
    text = ' '.join(capsys.readouterr().out.split())
    stated = re.search(r'--opset OPSET .*?\(default (\d+);', text)
    assert stated, text
    args = tool.parse_args(['c.py', 'k.pth', '--onnx', 'm.onnx'])
    assert args.opset == int(stated.group(1))


def test_sample_size_of_a_non_square_resize():
    """mmdet's test Resize(scale=(1333, 800)) is (w, h): the sample image is 800 x 1344 (H x W, rounded up to 32)."""
    from mmengine.config import Config

    from normdense.deploy.onnx import sample_size
    cfg = Config(dict(test_dataloader=dict(dataset=dict(pipeline=[
        dict(type='LoadImageFromFile'), dict(type='Resize', scale=(1333, 800), keep_ratio=True)]))))
    assert sample_size(cfg) == (800, 1344)
    cfg.crop_size = (512, 1024)  # mmseg's (h, w)
    assert sample_size(cfg) == (512, 1024)


@pytest.mark.parametrize('form', ['runner', 'NormSwitched'])
@pytest.mark.parametrize('groups', [dict(num_groups=8), dict(channels_per_group=16)])
def test_switched_config_keeps_exclude_and_groups(form, groups):
    """A switch that excludes the decode head and sets the groups: the head keeps its BCN, the backbone gets
    the switch with those groups (mmdeploy.model_config: the config mmdeploy builds)."""
    from mmengine.config import Config

    from normdense.deploy.mmdeploy import model_config
    spec = dict(norm='gn-ws', exclude=['decode_head'], **groups)
    cfg = Config.fromfile(SEG)
    if form == 'runner':
        cfg.runner_type, cfg.normdense_norm = 'NormSwitchRunner', spec
    else:
        cfg.model = dict(type='NormSwitched', model=cfg.model.to_dict(), **spec)
    model = model_config(cfg).model
    assert model.type == 'EncoderDecoder'
    assert model.decode_head.norm_cfg.type == 'BCN' and model.decode_head.norm_cfg.num_groups == 16
    norm = model.backbone.norm_cfg
    assert norm.type == 'GNAuto' and model.backbone.conv_cfg.type == 'WSConv2d'
    assert {k: norm[k] for k in groups} == groups
