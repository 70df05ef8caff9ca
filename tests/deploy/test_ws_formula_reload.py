"""The WS formula the weights were trained with survives every load path (issue 25, item 3).

A BCN+WS backbone converted from the authors' layout (their BCN code standardizes with
``'var_unbiased'``) is fine-tuned under a config that says ``conv_cfg=dict(type='WSConv2d')`` (the
``'paper'`` default, as ``configs/_base_/norms/bcn-ws.py``): PretrainedBackbone switches the convs to
the recorded formula for training. The Runner's checkpoint must carry it, so that a reload
(``load_checkpoint``), ``tools/test.py`` (Runner ``load_from``, no ``init_weights``), ``--resume`` and
``tools/deploy.py`` evaluate the function that was trained, not the config's.
"""
import copy
import importlib.util
import os.path as osp

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.config import Config
from mmengine.model import BaseModel
from mmengine.registry import MODELS

import normdense  # noqa: F401
from normdense.layers.ws import WSConv2d
from tests.pretrain_utils import quiet, single_thread  # noqa: F401  (fixture)

pytest.importorskip('torchvision')
pytest.importorskip('mmdet')
pytestmark = pytest.mark.usefixtures('single_thread')

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))


@MODELS.register_module(force=True)
class WSFormulaToyClassifier(BaseModel):
    """An mmdet ResNet (as configured) + a pooled linear head, trainable by the Runner on the toy dataset."""

    def __init__(self, backbone, num_classes=3, init_cfg=None):
        super().__init__(init_cfg=init_cfg)
        import mmdet.models  # noqa: F401  (registers mmdet.ResNet)
        self.backbone = MODELS.build(backbone)
        self.head = nn.Linear(512, num_classes)

    def features(self, x):
        return self.backbone(x)[-1]

    def forward(self, inputs, labels=None, mode='tensor'):
        x = torch.stack(inputs) if isinstance(inputs, (list, tuple)) else inputs
        logits = self.head(self.features(x).mean((2, 3)))
        if mode == 'loss':
            labels = torch.stack(labels) if isinstance(labels, (list, tuple)) else labels
            return dict(loss=F.cross_entropy(logits, labels))
        if mode == 'predict':
            return [dict(pred=p, label=l) for p, l in zip(logits.argmax(1), labels)]
        return logits


def _converted_backbone(tmp_path, with_state):
    """The authors' BCN+WS ResNet-18 (micro-batch estimate variant) converted for mmdet; ``with_state=False``
    writes the file as converters did before the weights carried the formula (only meta['ws_formula'])."""
    from normdense.convert.backbone import convert_backbone, save_backbone_checkpoint
    from tests.convert.test_backbone import authors_checkpoint, authors_resnet18
    conv = convert_backbone(authors_checkpoint(authors_resnet18('bcn', inner='bn', estimate=True)), 'mmdet')
    assert conv.complete, conv.report()
    assert conv.spec.conv_cfg == dict(type='WSConv2d', formula='var_unbiased')
    saved = [k for k in conv.state_dict if k.endswith('._extra_state')]
    if with_state:  # one per conv
        assert len(saved) == sum(k.endswith(('conv1.weight', 'conv2.weight', 'downsample.0.weight'))
                                 for k in conv.state_dict)
    for k in saved if not with_state else ():
        del conv.state_dict[k]
    path = str(tmp_path / 'resnet18_bcn-ws_authors.pth')
    save_backbone_checkpoint(conv, path)
    return path, conv.backbone_cfg


def _config(tmp_path, backbone_file, backbone_cfg):
    backbone = dict(backbone_cfg, type=f'mmdet.{backbone_cfg["type"]}', out_indices=(3, ),
                    conv_cfg=dict(type='WSConv2d'),  # formula: 'paper'
                    init_cfg=dict(type='PretrainedBackbone', checkpoint=backbone_file))
    loader = dict(sampler=dict(type='DefaultSampler', shuffle=False), batch_size=2, num_workers=0,
                  collate_fn=dict(type='default_collate'))
    cfg = dict(
        custom_imports=dict(imports=['normdense', 'tests.toy_runner', __name__], allow_failed_imports=False),
        default_scope='mmengine',
        model=dict(type='WSFormulaToyClassifier', backbone=backbone),
        train_dataloader=dict(loader, dataset=dict(type='NormdenseToyDataset', length=4, size=32)),
        train_cfg=dict(type='IterBasedTrainLoop', max_iters=1),
        optim_wrapper=dict(type='OptimWrapper', optimizer=dict(type='SGD', lr=0.05, momentum=0.9)),
        custom_hooks=[dict(type='BCNRateHook')],
        default_hooks=dict(checkpoint=dict(type='CheckpointHook', interval=1, by_epoch=False),
                           logger=dict(type='LoggerHook', interval=1)),
        test_dataloader=dict(loader, dataset=dict(type='NormdenseToyDataset', length=2, size=32)),
        test_evaluator=dict(type='NormdenseToyAccuracy'), test_cfg=dict(type='TestLoop'),
        randomness=dict(seed=0), work_dir=str(tmp_path / 'work'), log_level='WARNING')
    path = str(tmp_path / 'bcn-ws_toy.py')
    Config(cfg).dump(path)
    return path


def _formulas(model):
    return {m.formula for m in model.modules() if isinstance(m, WSConv2d)}


def _out64(model, x):
    """The backbone's last feature map, computed in float64."""
    model = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        return model.features(x.double())


def _load_tool(name):
    spec = importlib.util.spec_from_file_location(f'{name}_tool', osp.join(ROOT, 'tools', f'{name}.py'))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


@pytest.mark.parametrize('with_state', [True, False], ids=['converted-with-state', 'converted-meta-only'])
def test_trained_formula_survives_reload_test_resume_and_deploy(with_state, tmp_path):
    from mmengine.runner import Runner, load_checkpoint

    from normdense import jobs
    from normdense.deploy import build_model_from_config, fuse, load_fused
    backbone_file, backbone_cfg = _converted_backbone(tmp_path, with_state)
    config = _config(tmp_path, backbone_file, backbone_cfg)

    # fine-tune one iteration; what in-training validation would compute is the reference
    runner = Runner.from_cfg(Config.fromfile(config))
    quiet()
    runner.train()
    trained = runner.model.eval()
    assert _formulas(trained) == {'var_unbiased'}
    ckpt = str(tmp_path / 'work' / 'iter_1.pth')
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    ref = _out64(trained, x)
    with torch.no_grad():
        ref32 = trained.features(x)
    # the config's formula gives another function: the comparisons below can tell them apart
    other = copy.deepcopy(trained)
    for m in other.modules():
        if isinstance(m, WSConv2d):
            m.formula = 'paper'
    # (BCN's channel stage renormalizes every layer, so the difference is small at the end, yet far above
    # the float64 tolerances used below and 20x the float32 one)
    formula_gap = (_out64(other, x) - ref).abs().max()
    print('config formula vs trained:', (formula_gap / ref.abs().max()).item())
    assert formula_gap > 1e-4 * ref.abs().max()

    # a reload into the model the config builds (no init_weights: as tools/test.py and deploy build it)
    model = build_model_from_config(Config.fromfile(config))
    assert _formulas(model) == {'paper'}
    load_checkpoint(model, ckpt, map_location='cpu', strict=True)
    assert _formulas(model) == {'var_unbiased'}
    torch.testing.assert_close(_out64(model, x), ref, rtol=1e-10, atol=1e-10)

    # tools/test.py CONFIG CHECKPOINT (Runner load_from + StrictLoadHook)
    args = jobs.parse_args(jobs.test_arg_parser(), [config, ckpt, '--work-dir', str(tmp_path / 'test')])
    tester = jobs.build_runner(jobs.prepare_test(args))
    tester.test()
    assert _formulas(tester.model) == {'var_unbiased'}
    torch.testing.assert_close(_out64(tester.model, x), ref, rtol=1e-10, atol=1e-10)

    # --resume without the converted backbone at hand (init_cfg=None: only the checkpoint has the formula)
    cfg = Config.fromfile(config)
    cfg.model.backbone.init_cfg = None
    cfg.work_dir = str(tmp_path / 'resume')
    cfg.resume, cfg.load_from = True, ckpt
    resumed = Runner.from_cfg(cfg)
    resumed.train()  # resumes at iteration 1 = max_iters: loads, trains nothing
    assert _formulas(resumed.model) == {'var_unbiased'}
    torch.testing.assert_close(_out64(resumed.model, x), ref, rtol=1e-10, atol=1e-10)

    # tools/deploy.py folds with the loaded formula: its library path in float64 ...
    model = build_model_from_config(Config.fromfile(config)).double()
    load_checkpoint(model, ckpt, map_location='cpu', strict=True)
    fused = fuse(model.eval())
    assert not _formulas(fused)
    with torch.no_grad():
        torch.testing.assert_close(fused.features(x.double()), ref, rtol=1e-10, atol=1e-10)
    # ... and the command (float32 file, reloaded with load_fused)
    out = str(tmp_path / 'fused.pth')
    _load_tool('deploy').main([config, ckpt, out])
    deployed = load_fused(config, out)
    with torch.no_grad():
        got = deployed.features(x)
    print('deploy float32:', ((got - ref32).abs().max() / ref32.abs().max()).item())
    assert (got - ref32).abs().max() <= min(5e-6 * ref32.abs().max(), formula_gap / 20)
