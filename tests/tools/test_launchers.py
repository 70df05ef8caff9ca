"""tools/train.py and tools/test.py on a tiny mmengine Runner config (WS conv + estimate-mode BCN)."""
import os.path as osp
import pickle
import subprocess
import sys

import pytest
import torch
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.runner import Runner

from normdense import jobs

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
CONFIG = osp.join(ROOT, 'tests', 'fixtures', 'toy_runner_config.py')


def run_tool(*args, cwd):
    return subprocess.run([sys.executable, osp.join(ROOT, 'tools', args[0]), *args[1:]], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize('tool', ['train.py', 'test.py'])
def test_help(tool, tmp_path):
    out = run_tool(tool, '--help', cwd=tmp_path)
    assert out.returncode == 0 and 'usage:' in out.stdout and '--cfg-options' in out.stdout


@pytest.mark.slow  # ~30 s on 2 cores: three tool runs, each importing the stack
def test_train_two_iterations_then_resume_then_test(tmp_path):
    work = tmp_path / 'work'
    first = run_tool('train.py', CONFIG, '--work-dir', str(work), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (work / 'iter_2.pth').is_file()
    resumed = run_tool('train.py', CONFIG, '--work-dir', str(work), '--resume',
                       '--cfg-options', 'train_cfg.max_iters=4', cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert 'resumed epoch: 0, iter: 2' in resumed.stdout + resumed.stderr
    ckpt = torch.load(work / 'iter_4.pth')  # weights_only=True (torch's default) must work
    assert ckpt['meta']['iter'] == 4
    first_weights = torch.load(work / 'iter_2.pth')['state_dict']['norm.running_mean']
    assert not torch.equal(first_weights, ckpt['state_dict']['norm.running_mean'])

    out_pkl = tmp_path / 'preds.pkl'
    tested = run_tool('test.py', CONFIG, str(work / 'iter_4.pth'), '--work-dir', str(work),
                      '--out', str(out_pkl), cwd=tmp_path)
    assert tested.returncode == 0, tested.stderr[-3000:]
    assert 'accuracy:' in tested.stdout + tested.stderr
    assert len(pickle.load(open(out_pkl, 'rb'))) == 6


class _RecordLr(Hook):
    priority = 'NORMAL'  # after_train_iter before ParamSchedulerHook (LOW): the lr this step used

    def __init__(self):
        self.lrs = []

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        self.lrs.append(runner.optim_wrapper.optimizer.param_groups[0]['lr'])


def test_bcn_rate_follows_linear_warmup(tmp_path):
    cfg = jobs.load_config(CONFIG, {'train_cfg.max_iters': 5}, work_dir=str(tmp_path))
    runner = Runner.from_cfg(cfg)
    recorder = _RecordLr()
    runner.register_hook(recorder)
    runner.train()
    rates = runner.model.seen_rates
    assert rates == pytest.approx(recorder.lrs, rel=1e-12, abs=0)
    assert rates == pytest.approx([0.01, 0.04, 0.07, 0.1, 0.1])  # LinearLR from 0.1 x lr over 4 iterations


def test_missing_rate_hook_fails_at_first_iteration(tmp_path):
    cfg = jobs.load_config(CONFIG, work_dir=str(tmp_path))
    cfg.custom_hooks = []
    with pytest.raises(RuntimeError, match='BCNRateHook'):
        Runner.from_cfg(cfg).train()


def test_train_switches():
    cfg = Config.fromfile(CONFIG)
    jobs.apply_train_args(cfg, amp=True, auto_scale_lr=True, resume='auto')
    assert cfg.optim_wrapper.type == 'AmpOptimWrapper' and cfg.auto_scale_lr.enable
    assert cfg.resume is True and cfg.load_from is None
    cfg.pop('auto_scale_lr')
    with pytest.raises(RuntimeError, match='base_batch_size'):
        jobs.apply_train_args(cfg, auto_scale_lr=True)
    with pytest.raises(FileNotFoundError):
        jobs.apply_train_args(cfg, resume='/nonexistent.pth')
    with pytest.raises(FileNotFoundError, match='config'):
        jobs.load_config('/nonexistent_config.py')
