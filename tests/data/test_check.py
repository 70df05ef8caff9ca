"""normdense.data.check / tools/check_dataset.py on toy COCO and VOC sets corrupted in each way the
checker must catch, and on clean ones (no false alarm)."""
import json
import os.path as osp
import shutil
import subprocess
import sys

import numpy as np
import pytest
from mmengine.config import Config
from PIL import Image

from normdense.data.check import check_config_datasets
from normdense.data.writers import write_coco, write_voc

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
DET = osp.join(ROOT, 'configs/demo/mask-rcnn_r18_fpn_bcn-ws_toy-coco.py')
SEG = osp.join(ROOT, 'configs/demo/deeplabv3_r18-d8_bcn-ws_toy-voc.py')


@pytest.fixture(scope='module')
def clean_coco(tmp_path_factory):
    root = tmp_path_factory.mktemp('coco')
    write_coco(str(root), num_train=4, num_val=2, size=64)
    return root


@pytest.fixture(scope='module')
def clean_voc(tmp_path_factory):
    root = tmp_path_factory.mktemp('voc')
    write_voc(str(root), num_train=3, num_val=2, num_aug=2, size=64)
    return root


@pytest.fixture
def coco(clean_coco, tmp_path):
    shutil.copytree(clean_coco, tmp_path / 'coco')
    return tmp_path / 'coco'


@pytest.fixture
def voc(clean_voc, tmp_path):
    shutil.copytree(clean_voc, tmp_path / 'voc')
    return tmp_path / 'voc' / 'VOCdevkit' / 'VOC2012'


def det_cfg(root):
    cfg = Config.fromfile(DET)
    for loader in (cfg.train_dataloader, cfg.val_dataloader, cfg.test_dataloader):
        loader.dataset.data_root = str(root) + '/'
    return cfg


def seg_cfg(root):
    cfg = Config.fromfile(SEG)
    for ds in [*cfg.train_dataloader.dataset.datasets, cfg.val_dataloader.dataset, cfg.test_dataloader.dataset]:
        ds.data_root = str(root)
    return cfg


def edit_json(path, fn):
    with open(path) as f:
        data = json.load(f)
    fn(data)
    with open(path, 'w') as f:
        json.dump(data, f)


def errors(report, split):
    return report.splits[split]['errors']


def test_clean_sets_pass(clean_coco, clean_voc):
    det = check_config_datasets(det_cfg(clean_coco))
    assert det.ok and list(det.splits) == ['train_dataloader', 'val_dataloader']  # test = val: once
    assert [s['images'] for s in det.splits.values()] == [4, 2]
    assert not any(s['warnings'] for s in det.splits.values())
    seg = check_config_datasets(seg_cfg(clean_voc / 'VOCdevkit' / 'VOC2012'))
    assert seg.ok and [s['images'] for s in seg.splits.values()] == [5, 2]
    assert 'passed' in seg.summary()


@pytest.mark.parametrize('corrupt, expected', [
    (lambda d: d['annotations'][0].update(segmentation=[]), 'empty polygon'),
    (lambda d: d['annotations'][0].update(segmentation=[[1, 1, 5, 5]]), 'degenerate polygon'),
    (lambda d: d['annotations'][1].update(category_id=99), 'unknown category id 99'),
    (lambda d: d['annotations'][0].update(bbox=[3, 3, 0, 7]), 'degenerate box'),
    (lambda d: d['annotations'][0].update(bbox=[300, 300, 5, 5]), 'outside the 64x64 image'),
    (lambda d: d['images'][0].update(width=100), 'image is 64x64 but the annotation file says 100x64'),
    (lambda d: d.update(annotations=[]), 'no annotations at all'),
    (lambda d: d['categories'][0].update(name='disc'), "class 'circle' of the config is not among"),
])
def test_coco_corruptions(coco, corrupt, expected):
    edit_json(coco / 'annotations' / 'instances_train.json', corrupt)
    report = check_config_datasets(det_cfg(coco))
    assert not report.ok and errors(report, 'val_dataloader') == []
    assert any(expected in msg for _, msg in errors(report, 'train_dataloader')), errors(report, 'train_dataloader')
    assert 'FAILED' in report.summary()


def test_coco_missing_image(coco):
    (coco / 'val' / '000001.jpg').unlink()
    report = check_config_datasets(det_cfg(coco))
    assert errors(report, 'val_dataloader') == [('val/000001.jpg', 'image file missing')]
    assert errors(report, 'train_dataloader') == []


def test_voc_label_254_and_size_mismatch_and_missing_file(voc):
    sets = voc / 'ImageSets' / 'Segmentation'
    first_val = (sets / 'val.txt').read_text().split()[0]
    path = voc / 'SegmentationClass' / f'{first_val}.png'
    im = Image.open(path)
    seg = np.array(im)
    seg[0, 0] = 254
    out = Image.fromarray(seg, mode='P')
    out.putpalette(im.getpalette())
    out.save(path)
    first_aug = (sets / 'aug.txt').read_text().split()[0]
    Image.fromarray(np.zeros((32, 48), np.uint8)).save(voc / 'SegmentationClassAug' / f'{first_aug}.png')
    first_train = (sets / 'train.txt').read_text().split()[0]
    (voc / 'JPEGImages' / f'{first_train}.jpg').unlink()
    report = check_config_datasets(seg_cfg(voc))
    val = errors(report, 'val_dataloader')
    assert len(val) == 1 and val[0][0] == f'JPEGImages/{first_val}.jpg' and 'values [254]' in val[0][1]
    train = dict(errors(report, 'train_dataloader'))
    assert train[f'JPEGImages/{first_train}.jpg'] == 'image file missing'
    assert train[f'JPEGImages/{first_aug}.jpg'] == 'image is 64x64 but its label map 48x32'
    assert len(train) == 2 and not report.ok


def test_voc_colour_mask(voc):
    first_val = (voc / 'ImageSets' / 'Segmentation' / 'val.txt').read_text().split()[0]
    path = voc / 'SegmentationClass' / f'{first_val}.png'
    Image.open(path).convert('RGB').save(path)
    report = check_config_datasets(seg_cfg(voc))
    assert 'not one channel' in errors(report, 'val_dataloader')[0][1]


def run_tool(*args, cwd):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # 29-45 s on 2 shared cores: tool runs in subprocesses, each importing the stack
def test_tool_exit_status_and_train_check_data(coco, tmp_path):
    opts = ['--cfg-options', *(f'{d}.dataset.data_root={coco}/' for d in ('train_dataloader', 'val_dataloader',
                                                                         'test_dataloader'))]
    tool = osp.join(ROOT, 'tools', 'check_dataset.py')
    clean = run_tool(tool, DET, *opts, cwd=tmp_path)
    assert clean.returncode == 0, clean.stderr[-2000:]
    assert clean.stdout.strip().splitlines()[-1].startswith('dataset check passed')
    edit_json(coco / 'annotations' / 'instances_train.json', lambda d: d['annotations'][0].update(segmentation=[]))
    bad = run_tool(tool, DET, *opts, cwd=tmp_path)
    assert bad.returncode == 1 and 'empty polygon' in bad.stdout
    assert bad.stdout.strip().splitlines()[-1].startswith('dataset check FAILED: train: 4 images, 1 error(s)')
    train = run_tool(osp.join(ROOT, 'tools', 'train.py'), DET, '--check-data', *opts,
                     f'val_evaluator.ann_file={coco}/annotations/instances_val.json', cwd=tmp_path)
    assert train.returncode == 1 and 'empty polygon' in train.stdout
    assert 'dataset check FAILED' in train.stderr.strip().splitlines()[-1] and 'Traceback' not in train.stderr
