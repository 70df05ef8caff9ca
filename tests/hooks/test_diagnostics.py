import json
import logging

import pytest
import torch
import torch.nn as nn
from mmengine.hooks import Hook
from mmengine.model import BaseModel
from mmengine.registry import HOOKS
from mmengine.runner import Runner
from torch.utils.data import Dataset

import normdense  # noqa: F401  (registers NormDiagnosticsHook, BCNRateHook)
from normdense.hooks.diagnostics import NormDiagnosticsHook
from normdense.layers.equinorm import ChannelAffine, EquiConv2d
from normdense.layers.unitization import Unitization2d


class ToyData(Dataset):
    def __init__(self, n=16):
        g = torch.Generator().manual_seed(0)
        self.x = torch.rand(n, 3, 8, 8, generator=g)
        self.y = torch.randint(0, 2, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return dict(inputs=self.x[i], labels=self.y[i])


class ToyNet(BaseModel):
    def __init__(self):
        super().__init__()
        self.conv1 = EquiConv2d(3, 8, 3, padding=1, bias=False)
        self.ca1 = ChannelAffine(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.un2 = Unitization2d(8, mode='estimate')
        self.conv3 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.gn3 = nn.GroupNorm(4, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, inputs, labels=None, mode='tensor'):
        x = torch.relu(self.ca1(self.conv1(inputs)))
        x = torch.relu(self.un2(self.conv2(x)))
        x = torch.relu(self.gn3(self.conv3(x)))
        logits = self.head(x.mean((2, 3)))
        if mode == 'loss':
            return dict(loss=nn.functional.cross_entropy(logits, labels))
        return logits


@HOOKS.register_module(force=True)
class _ForwardHookCounter(Hook):
    """Runs after every other hook: how many forward hooks the model carries during each iteration's
    forward (seen at the end of before_train_iter) and after the iteration."""
    priority = 'LOWEST'

    def __init__(self):
        self.during, self.after = [], []

    @staticmethod
    def _count(model):
        return sum(len(m._forward_hooks) for m in model.modules())

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        self.during.append(self._count(runner.model))

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        self.after.append(self._count(runner.model))


def make_runner(tmp_path, hook_cfg, max_iters=6):
    return Runner(
        model=ToyNet(), work_dir=str(tmp_path),
        train_dataloader=dict(dataset=ToyData(), batch_size=2, num_workers=0,
                              sampler=dict(type='DefaultSampler', shuffle=False),
                              collate_fn=dict(type='default_collate')),
        train_cfg=dict(by_epoch=False, max_iters=max_iters, val_interval=1000),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.05)),
        default_hooks=dict(logger=dict(type='LoggerHook', interval=1), checkpoint=None),
        custom_hooks=[dict(type='BCNRateHook'), hook_cfg, dict(type='_ForwardHookCounter')],
        visualizer=dict(type='Visualizer', vis_backends=[dict(type='LocalVisBackend')]),
        log_level='INFO', default_scope='mmengine', randomness=dict(seed=0),
        # a Runner's MessageHub is a global instance named after the experiment, which defaults to the
        # timestamp: two runners built in the same second would share (and leak) scalars
        experiment_name=f'diag_{tmp_path.name}')


def test_hook_records_scalars_into_message_hub_log_and_visualizer(tmp_path):
    hook_cfg = dict(type='NormDiagnosticsHook', interval=2, layer_types=['Unitization2d', 'GroupNorm', 'EquiConv2d'],
                    diagnostics=['statdiff', 'snd', 'power', 'ics_moment', 'em_distance'], max_samples=256,
                    snd_cfg=dict(num_points=4, num_draws=3), ics_orders=[2, 4])
    runner = make_runner(tmp_path, hook_cfg)
    runner.train()
    hub = runner.message_hub
    for layer in ('un2', 'gn3', 'conv1'):
        for key in ('statdiff', 'snd', 'power_dataset_frac', 'power_channel_imbalance', 'ics_moment_n2',
                    'ics_moment_n4', 'em_distance'):
            buf = hub.get_scalar(f'norm_diag/{layer}/{key}')
            assert buf is not None
            values = buf.data[0]
            # statdiff etc. at iterations 2, 4, 6; the ICS measures from the second measurement on
            assert len(values) == (2 if key.startswith(('ics', 'em')) else 3), (layer, key, values)
            assert all(v == v and v >= 0 for v in values)
    # GN has no batch dependence; Unitization in estimate mode only through r * update (tiny)
    assert hub.get_scalar('norm_diag/gn3/snd').current() < 1e-5
    # forward hooks only during measured iterations (2, 4, 6): one per measured layer, removed after
    counter = [h for h in runner.hooks if type(h).__name__ == '_ForwardHookCounter'][0]
    assert counter.during == [0, 3, 0, 3, 0, 3]
    assert counter.after == [0] * 6
    # visualizer backend: one record per measurement, at the measured iterations
    vis_file = tmp_path / runner.timestamp / 'vis_data' / 'scalars.json'
    records = [json.loads(line) for line in open(vis_file)]
    diag = [r for r in records if 'norm_diag/un2/statdiff' in r]
    assert [r['step'] for r in diag] == [2, 4, 6]


def test_hook_log_line(tmp_path, caplog):
    hook_cfg = dict(type='NormDiagnosticsHook', interval=3, layer_names=['un*'], diagnostics=['statdiff'])
    runner = make_runner(tmp_path, hook_cfg, max_iters=3)
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    runner.logger.addHandler(handler)
    runner.train()
    assert any(m.startswith('norm_diag (iter 3): statdiff=') for m in messages), messages
    assert runner.message_hub.get_scalar('norm_diag/un2/statdiff') is not None
    assert 'norm_diag/gn3/statdiff' not in runner.message_hub.log_scalars


@pytest.mark.parametrize('kwargs,match', [
    (dict(layer_types=['GroupNorm'], diagnostics=['statdif']), 'unknown diagnostic'),
    (dict(layer_types=['GroupNorm'], interval=0), 'interval'),
    (dict(diagnostics=['statdiff']), 'layer_names'),
    (dict(layer_types=['GroupNorm'], snd_cfg=dict(batch=2)), 'SND option'),
    (dict(layer_types=['GroupNorm'], ics_orders=[1]), 'ics_orders'),
    (dict(layer_types=['GroupNorm'], em_method='critic'), 'em_method'),
])
def test_bad_config_fails_at_build(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HOOKS.build(dict(type='NormDiagnosticsHook', **kwargs))


def test_no_matching_layer_is_an_error(tmp_path):
    runner = make_runner(tmp_path, dict(type='NormDiagnosticsHook', layer_types=['IterNorm']), max_iters=1)
    with pytest.raises(ValueError, match='no layer matches'):
        runner.train()


def test_registered():
    assert isinstance(HOOKS.build(dict(type='NormDiagnosticsHook', layer_types=['GroupNorm'])), NormDiagnosticsHook)
