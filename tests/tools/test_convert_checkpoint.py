"""tools/convert_checkpoint.py: the CLI contract, the demo chain (toy pretraining with tools/train.py ->
convert -> the detection demo's backbone loads it strictly), partial conversions, the hash-suffixed file
and the stable symlink."""
import hashlib
import importlib.util
import os
import os.path as osp
import subprocess
import sys

import pytest
import torch
from mmengine.config import Config

from tests.pretrain_utils import ROOT, TOY_CONFIG, build_backbone, make_toy_imagenet, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures('single_thread')
TOOL = osp.join(ROOT, 'tools', 'convert_checkpoint.py')
DEMO_DET = osp.join(ROOT, 'configs', 'demo', 'mask-rcnn_r18_fpn_bcn-ws_toy-coco.py')
ENV = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=ROOT)


def run(*args, cwd):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=600, env=ENV)


def cli():
    spec = importlib.util.spec_from_file_location('convert_checkpoint_tool', TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def sha8(path):
    return hashlib.sha256(open(path, 'rb').read()).hexdigest()[:8]


def test_help(tmp_path):
    out = run(TOOL, '--help', cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for flag in ('--to', '--from', '--allow-partial', '--ws-formula', '--norm', 'mmpretrain,authors,torchvision'):
        assert flag in out.stdout


@pytest.mark.slow
def test_demo_chain_train_convert_load(tmp_path):
    """What the detection demo runs: toy pretraining through tools/train.py, conversion with the CLI, then
    the demo's Mask R-CNN backbone loads the result strictly."""
    data = make_toy_imagenet(tmp_path / 'toy_imagenet', num_train=10, num_val=4, size=64)
    work = tmp_path / 'work_dirs' / 'toy'
    trained = run(osp.join(ROOT, 'tools', 'train.py'), TOY_CONFIG, '--work-dir', str(work), '--cfg-options',
                  'train_cfg.max_iters=2', 'train_cfg.val_interval=2', 'default_hooks.checkpoint.interval=2',
                  'train_dataloader.batch_size=2', f'train_dataloader.dataset.data_root={data}',
                  f'val_dataloader.dataset.data_root={data}', f'test_dataloader.dataset.data_root={data}',
                  cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert 'accuracy/top1' in trained.stdout + trained.stderr
    dst = tmp_path / 'checkpoints' / 'resnet18-w32_bcn-ws_toy.pth'
    out = run(TOOL, str(work / 'iter_2.pth'), str(dst.relative_to(tmp_path)), '--to', 'mmdet', cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert 'complete: every target key mapped' in out.stdout
    assert dst.is_symlink()
    final = osp.realpath(dst)
    assert osp.dirname(final) == osp.realpath(dst.parent)  # relative link next to the file
    assert osp.basename(final) == f'resnet18-w32_bcn-ws_toy-{sha8(final)}.pth'
    ckpt = torch.load(dst)
    assert not any(k.startswith('backbone.') for k in ckpt['state_dict'])
    meta = ckpt['meta']
    assert (meta['conv'], meta['ws_formula'], meta['norm'], meta['target']) == ('WSConv2d', 'paper', 'BCN', 'mmdet')
    assert meta['source']['format'] == 'mmpretrain' and meta['source']['iter'] == 2
    assert meta['backbone'] == dict(type='ResNet', depth=18, stem_channels=32, base_channels=32,
                                    conv_cfg=dict(type='WSConv2d'),
                                    norm_cfg=dict(type='BCN', num_groups=16, mode='estimate'))
    if osp.isfile(DEMO_DET):
        det = Config.fromfile(DEMO_DET)
        backbone_cfg = det.model.backbone.to_dict()
        backbone_cfg.pop('init_cfg', None)
        build_backbone('mmdet', backbone_cfg, checkpoint=str(dst))  # strict


def _torchvision_checkpoint(tmp_path, drop=()):
    torchvision = pytest.importorskip('torchvision')
    sd = torchvision.models.resnet18().state_dict()
    for key in drop:
        del sd[key]
    path = str(tmp_path / 'resnet18-tv.pth')
    torch.save(sd, path)
    return path


def test_partial_conversion_is_refused_without_flag(tmp_path, capsys):
    src = _torchvision_checkpoint(tmp_path, drop=['layer3.0.conv1.weight'])
    main = cli()
    dst = tmp_path / 'ck' / 'r18.pth'
    assert main([src, str(dst), '--to', 'mmseg', '--from', 'torchvision']) == 1
    captured = capsys.readouterr()
    assert 'layer3.0.conv1.weight' in captured.out + captured.err and '--allow-partial' in captured.err
    assert not dst.parent.exists() or not os.listdir(dst.parent)
    assert main([src, str(dst), '--to', 'mmseg', '--from', 'torchvision', '--allow-partial']) == 0
    assert 'strict=False' in capsys.readouterr().out
    meta = torch.load(dst)['meta']
    assert meta['partial'] is True and meta['not_mapped']['missing'] == ['layer3.0.conv1.weight']


def test_symlink_is_updated_and_regular_files_are_kept(tmp_path, capsys):
    src = _torchvision_checkpoint(tmp_path)
    main = cli()
    dst = tmp_path / 'ck' / 'r18.pth'
    assert main([src, str(dst), '--to', 'mmdet', '--norm', 'bcn', '--ws-formula', 'paper']) == 0
    first = osp.realpath(dst)
    assert main([src, str(dst), '--to', 'mmdet', '--norm', 'bn', '--ws-formula', 'none']) == 0
    second = osp.realpath(dst)
    assert first != second and osp.isfile(first)  # old file kept, link moved
    assert torch.load(dst)['meta']['norm'] == 'BN'
    assert main([src, str(dst), '--to', 'mmdet', '--dry-run']) == 0
    assert osp.realpath(dst) == second
    regular = tmp_path / 'ck' / 'plain.pth'
    regular.write_bytes(b'x')
    assert main([src, str(regular), '--to', 'mmdet']) == 1
    assert 'not a symlink' in capsys.readouterr().err and regular.read_bytes() == b'x'
    assert main([str(tmp_path / 'missing.pth'), str(dst), '--to', 'mmdet']) == 1
