"""benchmarks/norm_comparison_fmnist.py end to end on generated idx files (the full run on Fashion-MNIST is a
benchmark, not a test; no real data and no network here)."""
import gzip
import json
import os
import os.path as osp
import subprocess
import sys

import numpy as np
import pytest

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks import norm_comparison_fmnist as nc  # noqa: E402


def write_idx_gz(folder, num_train, num_test):
    """The four Fashion-MNIST files as Debian's package installs them (gzipped idx), with random content."""
    rng = np.random.default_rng(1)
    os.makedirs(folder, exist_ok=True)
    raw = {}
    for split, n in (('train', num_train), ('t10k', num_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n).astype(np.uint8)
        raw[f'{split}-images-idx3-ubyte'] = (b'\x00\x00\x08\x03' + np.array([n, 28, 28], '>i4').tobytes()
                                             + images.tobytes())
        raw[f'{split}-labels-idx1-ubyte'] = b'\x00\x00\x08\x01' + np.array([n], '>i4').tobytes() + labels.tobytes()
    for name, data in raw.items():
        with gzip.open(osp.join(folder, name + '.gz'), 'wb') as f:
            f.write(data)
    return raw


def test_missing_data_is_one_line_naming_how_to_get_it(tmp_path):
    with pytest.raises(SystemExit) as e:
        nc.prepare_data(str(tmp_path), str(tmp_path / 'x'))
    msg = str(e.value)
    assert '\n' not in msg and str(tmp_path) in msg and 'apt-get install dataset-fashion-mnist' in msg
    assert 'FashionMNIST' in msg  # the mmpretrain way


def test_gz_files_are_extracted_once_and_extracted_ones_used_as_they_are(tmp_path):
    raw = write_idx_gz(tmp_path / 'deb', 12, 6)
    out = nc.prepare_data(str(tmp_path / 'deb'), str(tmp_path / 'ex'))
    assert out == str(tmp_path / 'ex')
    for name, data in raw.items():
        assert (tmp_path / 'ex' / name).read_bytes() == data
    assert nc.prepare_data(out, str(tmp_path / 'unused')) == out and not (tmp_path / 'unused').exists()


@pytest.mark.parametrize('batch', [1, 2, 32])
def test_configs_lr_and_schedule_scale_with_the_batch(batch):
    from mmengine.config import Config
    for norm in nc.NORMS:
        cfg = Config.fromfile(nc.config_path(norm, batch))
        assert cfg.normdense_norm == dict(norm=norm, num_groups=8) and cfg.runner_type == 'NormSwitchRunner'
        images = cfg.train_dataloader.dataset.indices
        assert cfg.train_dataloader.batch_size == batch and cfg.train_cfg.max_iters == images // batch
        assert cfg.optim_wrapper.optimizer.lr == pytest.approx(0.1 * batch / 32)
        assert cfg.param_scheduler[-1]['end'] == cfg.train_cfg.max_iters
        assert cfg.train_dataloader.dataset.type == cfg.val_dataloader.dataset.type == 'FashionMNIST'
        assert cfg.train_dataloader.dataset.download is False and cfg.val_evaluator.type == 'Accuracy'


@pytest.mark.slow  # ~1 min on 2 shared cores: 4 Runner builds, trainings and evaluations
def test_tiny_end_to_end(tmp_path):
    write_idx_gz(tmp_path / 'deb', 40, 25)
    out, plot = tmp_path / 'out.json', tmp_path / 'plot.png'
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    cmd = [sys.executable, osp.join(ROOT, 'benchmarks', 'norm_comparison_fmnist.py'), '--tiny',
           '--norms', 'bn,bcn-ws', '--batches', '1,2', '--seeds', '0', '--train-images', '8', '--test-images', '25',
           '--data-root', str(tmp_path / 'deb'), '--work-dir', str(tmp_path / 'work'), '--out', str(out),
           '--plot', str(plot)]
    run = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result['tiny'] and result['complete'] and 'BCN+WS > GN+WS > GN > BN' in result['paper_order']
    assert result['data']['train_images'] == 8 and result['data']['test_images'] == 25
    assert [(r['norm'], r['batch'], r['seed']) for r in result['runs']] == [
        ('bn', 1, 0), ('bcn-ws', 1, 0), ('bn', 2, 0), ('bcn-ws', 2, 0)]
    for r in result['runs']:
        assert r['iters'] == 8 // r['batch'] and r['lr'] == pytest.approx(0.1 * r['batch'] / 32)
        # mmpretrain's Accuracy over exactly the 25 test images: a multiple of 4 %
        assert 0 <= r['top1'] <= 100 and r['top1'] / 4 == pytest.approx(round(r['top1'] / 4))
    assert 'norm switch: bcn-ws' in result['runs'][1]['switched'] and 'norm switch: bn' in result['runs'][0]['switched']
    summary = {(s['batch'], s['norm']): s for s in result['summary']}
    assert summary[(2, 'bcn-ws')]['seeds'] == 1 and summary[(2, 'bcn-ws')]['values'] == [result['runs'][3]['top1']]
    assert plot.stat().st_size > 1000
    assert '[fmnist 4/4] BCN+WS batch 2 seed 0: top-1' in run.stdout and 'ETA' in run.stdout
    # the extracted files are what mmpretrain read
    assert (tmp_path / 'work' / 'idx' / 'train-labels-idx1-ubyte').is_file()


def test_a_config_reads_its_relative_data_root_as_tools_train_does(tmp_path, monkeypatch):
    """The configs' data_root (data/fashion_mnist, relative to the working directory) is where mmpretrain's
    FashionMNIST reads, and the data check of tools/train.py agrees (no data_root + data_prefix doubling)."""
    from mmengine.config import Config
    from mmpretrain.registry import DATASETS

    from normdense.config_check import check_data_paths
    write_idx_gz(tmp_path / 'deb', 12, 6)
    monkeypatch.chdir(tmp_path)
    cfg = Config.fromfile(nc.config_path('bcn-ws', 2))
    nc.prepare_data(str(tmp_path / 'deb'), str(tmp_path / cfg.data_root))
    check_data_paths(cfg, 'train')
    ds_cfg = dict(cfg.train_dataloader.dataset, indices=12)
    ds_cfg.pop('pipeline')
    from mmengine.registry import DefaultScope
    with DefaultScope.overwrite_default_scope('mmpretrain'):  # an earlier test may have left mmseg's scope
        dataset = DATASETS.build(ds_cfg)
    assert len(dataset) == 12 and dataset.get_data_info(0)['img'].shape == (28, 28)
    labels = np.frombuffer(gzip.open(tmp_path / 'deb' / 'train-labels-idx1-ubyte.gz').read()[8:], np.uint8)
    assert [int(dataset.get_data_info(i)['gt_label']) for i in range(12)] == labels.tolist()
