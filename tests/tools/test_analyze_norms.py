import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

TOY_PKG = textwrap.dedent('''
    import torch
    import torch.nn as nn
    from mmengine.model import BaseModel
    from mmengine.registry import DATASETS, MODELS
    from torch.utils.data import Dataset

    from normdense.layers.equinorm import ChannelAffine, EquiConv2d
    from normdense.layers.unitization import Unitization2d


    @DATASETS.register_module(force=True)
    class ToyImages(Dataset):
        def __init__(self, n=6):
            g = torch.Generator().manual_seed(1)
            self.x = torch.rand(n, 3, 12, 12, generator=g)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return dict(inputs=self.x[i])


    @MODELS.register_module(force=True)
    class ToyNormNet(BaseModel):
        def __init__(self):
            super().__init__()
            self.conv1 = EquiConv2d(3, 8, 3, padding=1, bias=False)
            self.ca1 = ChannelAffine(8)
            self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False)
            self.un2 = Unitization2d(16)
            self.conv3 = nn.Conv2d(16, 16, 3, padding=1, bias=False)
            self.un3 = Unitization2d(16, mode='estimate')

        def forward(self, inputs, data_samples=None, mode='tensor'):
            x = torch.relu(self.ca1(self.conv1(inputs)))
            x = torch.relu(self.un2(self.conv2(x)))
            return self.un3(self.conv3(x)).mean((2, 3))
''')

CONFIG = textwrap.dedent('''
    custom_imports = dict(imports=['normdense', 'toy_analyze_pkg'], allow_failed_imports=False)
    default_scope = 'mmengine'
    model = dict(type='ToyNormNet')
    val_dataloader = dict(batch_size=2, num_workers=2, persistent_workers=True,
                          dataset=dict(type='ToyImages', n=6),
                          sampler=dict(type='DefaultSampler', shuffle=False),
                          collate_fn=dict(type='default_collate'))
''')


@pytest.fixture
def toy_setup(tmp_path, monkeypatch):
    (tmp_path / 'toy_analyze_pkg.py').write_text(TOY_PKG)
    (tmp_path / 'toy_cfg.py').write_text(CONFIG)
    monkeypatch.syspath_prepend(str(tmp_path))
    import toy_analyze_pkg  # noqa: F401

    model = toy_analyze_pkg.ToyNormNet()
    early = tmp_path / 'iter_1.pth'
    torch.save(dict(state_dict=model.state_dict(), meta=dict(iter=1)), early)
    # a "later" checkpoint: a few SGD steps on a toy objective
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.un3.update_rate = None
    model.un3.current_rate = 0.1
    x = torch.rand(4, 3, 12, 12)
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).sum().neg().backward()
        opt.step()
    late = tmp_path / 'iter_4.pth'
    torch.save(dict(state_dict=model.state_dict(), meta=dict(iter=4)), late)
    return tmp_path, early, late


def test_cli_writes_png_and_json(toy_setup):
    tmp_path, early, late = toy_setup
    out = tmp_path / 'out'
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    proc = subprocess.run(
        [sys.executable, str(REPO / 'tools' / 'analyze_norms.py'), str(tmp_path / 'toy_cfg.py'), str(late),
         '--compare-checkpoint', str(early), '--layer-types', 'Unitization2d', 'EquiConv2d',
         '--out-dir', str(out), '--num-batches', '2', '--max-samples', '200'],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / 'norm_diagnostics.json').read_text())
    assert set(report['layers']) == {'conv1', 'un2', 'un3'}
    assert report['meta']['num_batches'] == 2 and report['meta']['layer_types']['un2'] == 'Unitization2d'
    for layer, values in report['layers'].items():
        for key in ('statdiff', 'snd', 'power', 'power_dataset_frac', 'ics_moment_n2', 'em_distance'):
            assert key in values and values[key] >= 0, (layer, key)
        assert values['em_distance'] > 0  # the weights changed between the two checkpoints
    # the batch-mode Unitization layer is batch dependent, the estimate-mode one (no rate: r = 0) is not
    assert report['layers']['un2']['snd'] > 0.05 and report['layers']['un3']['snd'] < 1e-5
    png = (out / 'norm_diagnostics.png').read_bytes()
    assert png[:8] == b'\x89PNG\r\n\x1a\n' and len(png) > 5000


def test_library_same_checkpoint_has_zero_shift(toy_setup):
    from normdense.analysis.report import analyze_checkpoint, write_report

    tmp_path, early, late = toy_setup
    report = analyze_checkpoint(str(tmp_path / 'toy_cfg.py'), str(late), compare_checkpoint=str(late),
                                num_batches=1, layer_names=['un*'], diagnostics=['em_distance', 'ics_moment'],
                                max_samples=10 ** 6)
    for values in report['layers'].values():
        assert values['em_distance'] == 0.0 and values['ics_moment_n3'] == 0.0
    paths = write_report(report, str(tmp_path / 'lib_out'), stem='same')
    assert Path(paths['png']).exists() and json.loads(Path(paths['json']).read_text())['layers']


def test_clear_errors(toy_setup):
    from normdense.analysis.report import analyze_checkpoint

    tmp_path, early, late = toy_setup
    with pytest.raises(ValueError, match='unknown diagnostic'):
        analyze_checkpoint(str(tmp_path / 'toy_cfg.py'), str(late), layer_types=['Unitization2d'],
                           diagnostics=['ics'])
    with pytest.raises(ValueError, match='no test_dataloader'):
        analyze_checkpoint(str(tmp_path / 'toy_cfg.py'), str(late), split='test', layer_types=['Unitization2d'])
    with pytest.raises(ValueError, match='no layer matches'):
        analyze_checkpoint(str(tmp_path / 'toy_cfg.py'), str(late), layer_types=['IterNorm'])



def test_cli_requires_a_layer_selection(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / 'tools'))
    import analyze_norms

    with pytest.raises(SystemExit) as exc:
        analyze_norms.parse_args(['cfg.py', 'x.pth'])
    assert exc.value.code == 2 and '--layer-names' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        analyze_norms.parse_args(['cfg.py', 'x.pth', '--layer-types', 'GroupNorm', '--diagnostics', 'ics'])
    args = analyze_norms.parse_args(['cfg.py', 'x.pth', '--layer-types', 'GroupNorm', '--ics-orders', '2', '4'])
    assert args.ics_orders == [2, 4] and args.split == 'val'
