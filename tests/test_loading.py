"""Loading weights: strict Runner loads (load_from, --resume, tools/test.py CHECKPOINT), one-line errors for
damaged checkpoints on every load path, URLs (https://, open-mmlab://) through mmengine's loaders and
torch.hub's cache from a loopback server, malicious pickles refused everywhere, and the GN+WS configs'
published backbones (open-mmlab://jhu/resnet50_gn_ws) key for key."""
import copy
import functools
import logging
import http.server
import importlib.util
import json
import os
import os.path as osp
import pickle
import random
import threading

import pytest
import torch
from mmengine.config import Config
from mmengine.runner import Runner

from normdense import jobs
from normdense.checkpoint import (CheckpointMismatchError, CheckpointReadError, UnsafeCheckpointError, load_mismatch,
                                  read_checkpoint)
from tests.pretrain_utils import ROOT, build_backbone, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures('single_thread')
TOY = osp.join(ROOT, 'tests', 'fixtures', 'toy_runner_config.py')
WS_BCN = dict(type='ResNet', depth=18, conv_cfg=dict(type='WSConv2d'), norm_cfg=dict(type='BCN', num_groups=32))


class Mkdir:
    """A pickle that runs code when unpickled (harmless: it creates a directory that the test looks for)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Download caches in tmp_path: torch.hub's (TORCH_HOME) and mmengine's (MMENGINE_HOME)."""
    monkeypatch.setenv('TORCH_HOME', str(tmp_path / 'torch_home'))
    monkeypatch.setenv('MMENGINE_HOME', str(tmp_path / 'mmengine_home'))
    return tmp_path / 'torch_home' / 'hub' / 'checkpoints'


@pytest.fixture
def server(tmp_path):
    """A loopback HTTP server on a random port serving tmp_path/www; ``.requests`` lists the GET paths."""
    root = tmp_path / 'www'
    root.mkdir()
    requests = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            requests.append(self.path)
            super().do_GET()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(('127.0.0.1', 0), functools.partial(Handler, directory=str(root)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    httpd.root, httpd.requests = root, requests
    httpd.url = lambda name: f'http://127.0.0.1:{httpd.server_address[1]}/{name}'
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def damage(path, kind):
    data = open(path, 'rb').read()
    with open(path, 'wb') as f:
        f.write({'truncated': data[:len(data) // 2], 'random': random.Random(0).randbytes(4096), 'empty': b''}[kind])
    return str(path)


DAMAGE = ['truncated', 'random', 'empty']


def assert_cannot_read(err, path):
    msg = str(err.value)
    assert msg.startswith(f'cannot read checkpoint {path}') and '\n' not in msg, msg
    assert 'weights_only=False' not in msg


# --------------------------------------------------------------------------------------------------
# Runner loads: strict, with an explicit opt-in to a partial load
# --------------------------------------------------------------------------------------------------
def toy_cfg(tmp_path, **options):
    cfg = jobs.load_config(TOY, options, work_dir=str(tmp_path / 'work'))
    cfg.default_hooks.logger = None
    return cfg


def toy_checkpoint(tmp_path, name='toy.pth', edit=None):
    """The toy model's weights as a checkpoint (optionally edited), written to tmp_path/name."""
    runner = Runner.from_cfg(toy_cfg(tmp_path / 'build'))
    sd = {k: v.clone() for k, v in runner.model.state_dict().items()}
    for k in sd:
        if k.startswith('norm.running'):  # non-trivial estimates, so a load is visible
            sd[k] = torch.rand_like(sd[k]) + 0.5
    if edit:
        edit(sd)
    path = tmp_path / name
    torch.save(dict(state_dict=sd, meta=dict()), path)
    return str(path), sd


def run_test(tmp_path, checkpoint, allow_partial_load=False):
    cfg = toy_cfg(tmp_path)
    jobs.apply_test_args(cfg, checkpoint)
    jobs.apply_load_args(cfg, allow_partial_load=allow_partial_load)
    runner = jobs.build_runner(cfg)
    metrics = runner.test()
    return runner, metrics


def drop_estimates(sd):
    del sd['norm.running_mean'], sd['norm.running_var']


def widen_head(sd):
    sd['head.weight'] = torch.zeros(5, sd['head.weight'].shape[1])
    sd['head.bias'] = torch.zeros(5)


def extra_tensor(sd):
    sd['head.extra_scale'] = torch.ones(3)  # a tensor the model has no place for (another model's checkpoint)


@pytest.mark.parametrize('edit,named', [(drop_estimates, 'norm.running_mean'), (widen_head, 'head.weight'),
                                        (extra_tensor, 'unexpected keys 1 \\(head.extra_scale\\)')])
def test_test_tool_refuses_incomplete_checkpoint(tmp_path, edit, named):
    path, _ = toy_checkpoint(tmp_path, edit=edit)
    with pytest.raises(CheckpointMismatchError, match=named) as err:
        run_test(tmp_path, path)
    assert '\n' not in str(err.value) and '--allow-partial-load' in str(err.value)


def test_partial_load_is_opt_in_and_loud(tmp_path):
    path, sd = toy_checkpoint(tmp_path, edit=drop_estimates)
    cfg = toy_cfg(tmp_path)
    jobs.apply_test_args(cfg, path)
    jobs.apply_load_args(cfg, allow_partial_load=True)
    runner = jobs.build_runner(cfg)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    runner.logger.addHandler(handler)
    try:
        assert 'accuracy' in runner.test()
    finally:
        runner.logger.removeHandler(handler)
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING and 'PARTIAL LOAD' in r.getMessage()]
    assert len(warnings) == 1 and 'stay at their initialization: norm.running_mean, norm.running_var' in warnings[0]
    assert torch.equal(runner.model.conv.weight, sd['conv.weight'])  # what matched was loaded
    # the config key works as the flag does
    cfg = toy_cfg(tmp_path)
    cfg.allow_partial_load = True
    jobs.apply_load_args(cfg)
    assert cfg.custom_hooks[-1] == dict(type='StrictLoadHook', allow_partial=True)


def test_complete_checkpoint_loads(tmp_path):
    path, sd = toy_checkpoint(tmp_path)
    runner, _ = run_test(tmp_path, path)
    for k, v in sd.items():
        assert torch.equal(runner.model.state_dict()[k], v), k


def test_resume_and_load_from_are_strict(tmp_path):
    cfg = toy_cfg(tmp_path)
    jobs.apply_load_args(cfg)
    jobs.build_runner(cfg).train()
    ckpt = torch.load(tmp_path / 'work' / 'iter_2.pth')
    drop_estimates(ckpt['state_dict'])
    torch.save(ckpt, tmp_path / 'no_estimates.pth')
    for resume in (True, False):
        cfg = toy_cfg(tmp_path, **{'train_cfg.max_iters': 3})
        if resume:
            jobs.apply_train_args(cfg, resume=str(tmp_path / 'no_estimates.pth'))
        else:
            cfg.load_from = str(tmp_path / 'no_estimates.pth')
        jobs.apply_load_args(cfg)
        with pytest.raises(CheckpointMismatchError, match='norm.running_var'):
            jobs.build_runner(cfg).train()


def test_missing_local_checkpoint_is_one_line(tmp_path):
    cfg = toy_cfg(tmp_path)
    with pytest.raises(FileNotFoundError, match='checkpoint not found: /nonexistent.pth'):
        jobs.apply_test_args(cfg, '/nonexistent.pth')
    cfg.load_from = '/nonexistent.pth'
    with pytest.raises(FileNotFoundError, match='load_from checkpoint not found'):
        jobs.apply_load_args(cfg)
    jobs.apply_test_args(toy_cfg(tmp_path), 'https://example.invalid/x.pth')  # URLs: checked on download


# --------------------------------------------------------------------------------------------------
# Damaged and malicious checkpoints on every load path
# --------------------------------------------------------------------------------------------------
def convert_cli():
    spec = importlib.util.spec_from_file_location('convert_checkpoint_tool', osp.join(ROOT, 'tools',
                                                                                       'convert_checkpoint.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize('kind', DAMAGE)
def test_damaged_checkpoint_on_every_path(tmp_path, kind, capsys):
    path, _ = toy_checkpoint(tmp_path)
    damage(path, kind)
    with pytest.raises(CheckpointReadError) as err:  # tools/test.py CHECKPOINT
        run_test(tmp_path, path)
    assert_cannot_read(err, path)
    for resume in (True, False):  # --resume, load_from
        cfg = toy_cfg(tmp_path)
        if resume:
            jobs.apply_train_args(cfg, resume=path)
        else:
            cfg.load_from = path
        jobs.apply_load_args(cfg)
        with pytest.raises(CheckpointReadError) as err:
            jobs.build_runner(cfg).train()
        assert_cannot_read(err, path)
    with pytest.raises(CheckpointReadError) as err:  # PretrainedBackbone
        build_backbone('mmdet', WS_BCN, checkpoint=path)
    assert_cannot_read(err, path)
    assert convert_cli()([path, str(tmp_path / 'out.pth'), '--to', 'mmdet']) == 1  # convert_checkpoint.py
    # only the CLI's own lines: mmengine's logger can still hold an earlier test's closed capture stream
    # (then logging prints '--- Logging error ---' noise into this test's stderr)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith('error:')]
    assert len(errors) == 1 and errors[0].startswith(f'error: cannot read checkpoint {path}')
    from normdense.deploy.io import load_fused  # deploy
    with pytest.raises(CheckpointReadError) as err:
        load_fused(TOY, path)
    assert_cannot_read(err, path)


def test_malicious_pickle_is_refused_on_every_local_path(tmp_path, capsys):
    marker = tmp_path / 'pwned'
    path = str(tmp_path / 'evil.pth')
    torch.save(dict(state_dict={'conv.weight': torch.zeros(1)}, meta=Mkdir(marker)), path)
    attempts = [lambda: read_checkpoint(path), lambda: run_test(tmp_path, path),
                lambda: build_backbone('mmdet', WS_BCN, checkpoint=path)]
    for attempt in attempts:
        with pytest.raises(pickle.UnpicklingError) as err:
            attempt()
        assert isinstance(err.value, UnsafeCheckpointError) and 'posix.mkdir' in str(err.value)
    assert convert_cli()([path, str(tmp_path / 'out.pth'), '--to', 'mmdet']) == 1
    assert 'refused by the weights-only load' in capsys.readouterr().err
    assert not marker.exists()


# --------------------------------------------------------------------------------------------------
# URLs through mmengine's loaders and torch.hub's cache
# --------------------------------------------------------------------------------------------------
def test_pretrained_backbone_by_url_is_cached(tmp_path, server, cache):
    source = build_backbone('mmdet', WS_BCN)
    torch.save(dict(state_dict=source.state_dict(), meta={}), server.root / 'r18.pth')
    url = server.url('r18.pth')
    for _ in range(2):
        model = build_backbone('mmdet', WS_BCN, checkpoint=url)
        for (k, a), b in zip(model.state_dict().items(), source.state_dict().values()):
            assert torch.equal(a, b), k
    assert server.requests == ['/r18.pth']  # the second load came from the cache
    assert (cache / 'r18.pth').is_file()


def test_test_tool_by_url(tmp_path, server, cache):
    path, sd = toy_checkpoint(server.root, name='toy.pth')
    runner, metrics = run_test(tmp_path, server.url('toy.pth'))
    assert 'accuracy' in metrics and torch.equal(runner.model.norm.running_var, sd['norm.running_var'])
    run_test(tmp_path, server.url('toy.pth'))
    assert server.requests == ['/toy.pth']


def test_convert_checkpoint_by_url(tmp_path, server, cache, capsys):
    torchvision = pytest.importorskip('torchvision')
    torch.save(torchvision.models.resnet18().state_dict(), server.root / 'resnet18-tv.pth')
    main = convert_cli()
    for i in range(2):
        dst = tmp_path / 'ck' / f'r18-{i}.pth'
        assert main([server.url('resnet18-tv.pth'), str(dst), '--to', 'mmdet', '--from', 'torchvision']) == 0
        assert torch.load(dst)['meta']['source']['path'] == server.url('resnet18-tv.pth')
    assert server.requests == ['/resnet18-tv.pth']


def test_malicious_pickle_by_url_is_refused(tmp_path, server, cache):
    marker = tmp_path / 'pwned'
    torch.save(dict(state_dict={}, meta=Mkdir(marker)), server.root / 'evil.pth')
    url = server.url('evil.pth')
    with pytest.raises(UnsafeCheckpointError, match='refused'):
        read_checkpoint(url)
    with pytest.raises(UnsafeCheckpointError):
        build_backbone('mmdet', WS_BCN, checkpoint=url)
    with pytest.raises(UnsafeCheckpointError):
        run_test(tmp_path, url)
    from mmengine.runner import CheckpointLoader
    with pytest.raises(pickle.UnpicklingError):  # mmengine's own entry point, as an init_cfg Pretrained uses it
        CheckpointLoader.load_checkpoint(url)
    assert not marker.exists()


def test_damaged_download_names_url_and_cache(tmp_path, server, cache):
    (server.root / 'bad.pth').write_bytes(random.Random(0).randbytes(100))
    with pytest.raises(CheckpointReadError, match=r'cannot read checkpoint http://.*bad\.pth \(cached as .*bad\.pth\)'):
        read_checkpoint(server.url('bad.pth'))
    with pytest.raises(CheckpointReadError, match='download failed'):
        read_checkpoint(server.url('missing.pth'))


# --------------------------------------------------------------------------------------------------
# GN+WS configs: the WS authors' backbones that mmdet hosts (open-mmlab://jhu/resnet{50,101}_gn_ws)
# --------------------------------------------------------------------------------------------------
def jhu_layout_checkpoint(path, depth=50):
    """A checkpoint in the layout of open-mmlab://jhu/resnet50_gn_ws: what mmdet's ResNet with mmcv's ConvWS
    and GN(32) holds (mmdet's configs/gn+ws/ load it into exactly that model), random values, plus an
    ImageNet classifier head (fc.*) as a released classifier may carry."""
    reference = build_backbone('mmdet', dict(type='ResNet', depth=depth, conv_cfg=dict(type='ConvWS'),
                                             norm_cfg=dict(type='GN', num_groups=32, requires_grad=True)),
                               dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(v.shape, generator=g) * (0.1 if v.dim() > 1 else 0.5) + (1.0 if k.endswith('.weight') and
                                                                                v.dim() == 1 else 0.0)
          for k, v in reference.state_dict().items()}  # GN scales around 1, shifts around 0
    assert 'gn1.weight' in sd and 'layer1.0.gn3.bias' in sd and 'layer1.0.downsample.1.weight' in sd
    reference.load_state_dict(sd, strict=True)  # float32 values, held in float64
    torch.save(dict(state_dict=dict(sd, **{'fc.weight': torch.randn(10, 2048), 'fc.bias': torch.zeros(10)})), path)
    return reference, sd


def jhu_server(server, cache):
    """Point open-mmlab://jhu/resnet50_gn_ws at the loopback server (mmengine reads overrides of its
    open-mmlab name table from $MMENGINE_HOME/open_mmlab.json)."""
    home = cache.parent.parent.parent / 'mmengine_home'
    home.mkdir(parents=True, exist_ok=True)
    (home / 'open_mmlab.json').write_text(json.dumps({'jhu/resnet50_gn_ws': server.url('resnet50_gn_ws-15beedd8.pth')}))
    return server.root / 'resnet50_gn_ws-15beedd8.pth'


@pytest.mark.parametrize('config,scope', [
    ('mask_rcnn/mask-rcnn_r50_fpn_gn-ws_2x_coco.py', 'mmdet'),
    ('faster_rcnn/faster-rcnn_r50_fpn_gn-ws_1x_coco.py', 'mmdet'),
    ('deeplabv3/deeplabv3_r50-d16_gn-ws_voc12aug-513x513.py', 'mmseg')])
def test_gn_ws_configs_load_the_published_backbone(tmp_path, server, cache, config, scope):
    reference, sd = jhu_layout_checkpoint(jhu_server(server, cache))
    backbone_cfg = copy.deepcopy(Config.fromfile(osp.join(ROOT, 'configs', config)).model.backbone.to_dict())
    assert backbone_cfg['init_cfg']['checkpoint'] == 'open-mmlab://jhu/resnet50_gn_ws'
    assert backbone_cfg['conv_cfg'] == dict(type='WSConv2d', formula='std_unbiased')
    # PretrainedBackbone, strict, through open-mmlab:// -> http; float64 to compare the function below
    model = build_backbone(scope, backbone_cfg, dtype=torch.float64)
    assert load_mismatch(model, sd) == ([], [], [])
    for k, v in sd.items():
        assert torch.equal(model.state_dict()[k], v.double()), k
    assert server.requests == ['/resnet50_gn_ws-15beedd8.pth']
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        ours, theirs = model(x), reference(x)
    if scope == 'mmseg':  # output stride 16: layer4 is dilated, layers 1-3 are computed as in mmdet's ResNet
        ours, theirs = ours[:3], theirs[:3]
    for a, b in zip(ours, theirs):  # std_unbiased is mmcv's ConvWS (rounding aside: var_mean vs std)
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    model_paper = build_backbone(scope, dict(backbone_cfg, conv_cfg=dict(type='WSConv2d')), dtype=torch.float64)
    assert not torch.allclose(model_paper(x)[0], theirs[0], rtol=1e-4, atol=1e-4)  # the formula matters


def test_gn_ws_r101_configs_name_the_r101_weights():
    for config in ('mask_rcnn/mask-rcnn_r101_fpn_gn-ws_2x_coco.py', 'faster_rcnn/faster-rcnn_r101_fpn_gn-ws_1x_coco.py',
                   'deeplabv3/deeplabv3_r101-d16_gn-ws_voc12aug-513x513.py'):
        backbone = Config.fromfile(osp.join(ROOT, 'configs', config)).model.backbone
        assert backbone.depth == 101 and backbone.init_cfg.checkpoint == 'open-mmlab://jhu/resnet101_gn_ws'
        assert backbone.type == 'ResNet' and backbone.conv_cfg.formula == 'std_unbiased'


def test_bcn_ws_missing_backbone_names_the_authors_release_first(tmp_path):
    cfg = Config.fromfile(osp.join(ROOT, 'configs', 'mask_rcnn', 'mask-rcnn_r50_fpn_bcn-ws_2x_coco.py'))
    backbone_cfg = cfg.model.backbone.to_dict()
    backbone_cfg['init_cfg']['checkpoint'] = str(tmp_path / 'resnet50_bcn-ws_in1k.pth')
    with pytest.raises(FileNotFoundError) as err:
        build_backbone('mmdet', backbone_cfg)
    msg = str(err.value)
    assert '\n' not in msg and msg.index('--from authors') < msg.index('configs/imagenet/resnet50_bcn-ws_in1k.py')
    assert 'init_cfg=None' in msg
