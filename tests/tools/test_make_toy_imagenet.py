"""tools/make_toy_imagenet.py: the ImageNet-layout set is read by mmpretrain's ImageNet/CustomDataset."""
import contextlib
import importlib.util
import os.path as osp

import numpy as np
import pytest
from PIL import Image

from normdense.data.toy_scenes import CLASSES

TOOL = osp.join(osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))), 'tools',
                'make_toy_imagenet.py')
N_TRAIN, N_VAL = 10, 5


def load_tool():
    spec = importlib.util.spec_from_file_location('make_toy_imagenet', TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def mmpretrain_scope():
    """Register mmpretrain's modules and make 'mmpretrain' the default scope only inside the block (so the
    transforms in ``pipeline`` resolve to mmpretrain's), leaving the global default scope untouched."""
    from mmengine.registry import DefaultScope
    from mmpretrain.utils import register_all_modules
    register_all_modules(init_default_scope=False)
    with DefaultScope.overwrite_default_scope('mmpretrain'):
        yield


def make(out, *extra):
    return load_tool().main(['--out', str(out), '--num-train', str(N_TRAIN), '--num-val',
                             str(N_VAL), *extra])


@pytest.fixture(scope='module')
def inet_root(tmp_path_factory):
    out = tmp_path_factory.mktemp('toy_imagenet')
    make(out, '--workers', '1')
    return out


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        load_tool().main(['--help'])
    assert e.value.code == 0
    assert 'data/toy_imagenet' in capsys.readouterr().out


def test_layout_balance_and_determinism(inet_root, tmp_path):
    assert (inet_root / 'meta' / 'classes.txt').read_text().split() == list(CLASSES)
    for split, n in (('train', N_TRAIN), ('val', N_VAL)):
        entries = [ln.split() for ln in (inet_root / 'meta' / f'{split}.txt').read_text().splitlines()]
        assert len(entries) == n
        for rel, label in entries:
            cls, fname = rel.split('/')
            assert cls == CLASSES[int(label)] and fname.endswith('.JPEG')
            img = Image.open(inet_root / split / rel)
            assert img.format == 'JPEG' and img.size == (160, 160)
        counts = np.bincount([int(lbl) for _, lbl in entries], minlength=len(CLASSES))
        assert counts.max() - counts.min() <= 1
        assert sorted(p.name for p in (inet_root / split).iterdir()) == sorted(CLASSES)
    make(tmp_path / 'same', '--workers', '2')  # drawn in 2 processes: the same bytes as in one
    files = sorted(p.relative_to(inet_root) for p in inet_root.rglob('*') if p.is_file())
    assert len(files) == N_TRAIN + N_VAL + 3
    assert files == sorted(p.relative_to(tmp_path / 'same') for p in (tmp_path / 'same').rglob('*') if p.is_file())
    for rel in files:
        assert (inet_root / rel).read_bytes() == (tmp_path / 'same' / rel).read_bytes(), rel
    make(tmp_path / 'other', '--seed', '5')
    assert (inet_root / 'train/ring/train_000002.JPEG').read_bytes() != \
        (tmp_path / 'other' / 'train/ring/train_000002.JPEG').read_bytes()


def test_workers_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match='workers must be >= 1'):
        make(tmp_path, '--workers', '0')


def _pipeline():
    return [dict(type='LoadImageFromFile'), dict(type='PackInputs')]


@pytest.mark.parametrize('split,n', [('train', N_TRAIN), ('val', N_VAL)])
def test_mmpretrain_imagenet_with_ann_file(inet_root, split, n):
    from mmpretrain.datasets import ImageNet
    with mmpretrain_scope():
        ds = ImageNet(data_root=str(inet_root), ann_file=f'meta/{split}.txt', data_prefix=split,
                      metainfo=dict(classes=CLASSES), pipeline=_pipeline())
    assert len(ds) == n and tuple(ds.CLASSES) == CLASSES
    for i in range(n):
        info = ds.get_data_info(i)
        assert osp.basename(osp.dirname(info['img_path'])) == CLASSES[info['gt_label']]
    out = ds[3]
    assert tuple(out['inputs'].shape) == (3, 160, 160)
    assert out['data_samples'].gt_label.item() == 3 % len(CLASSES)


@pytest.mark.parametrize('split,n', [('train', N_TRAIN), ('val', N_VAL)])
def test_mmpretrain_imagenet_split_shortcut(inet_root, split, n):
    """ImageNet(split=...) finds ``<split>/`` and ``meta/<split>.txt`` by itself."""
    from mmpretrain.datasets import ImageNet
    with mmpretrain_scope():
        ds = ImageNet(data_root=str(inet_root), split=split, metainfo=dict(classes=CLASSES),
                      pipeline=_pipeline())
    assert len(ds) == n and ds.ann_file.endswith(f'meta/{split}.txt')
    assert [ds.get_data_info(i)['gt_label'] for i in range(n)] == \
        [i % len(CLASSES) for i in range(n)]


def test_mmpretrain_custom_dataset_scanning_folders(inet_root):
    """Without ann_file, CustomDataset takes the classes from the sorted folder names: same ids."""
    from mmpretrain.datasets import CustomDataset
    with mmpretrain_scope():
        ds = CustomDataset(data_root=str(inet_root), data_prefix='train', pipeline=_pipeline())
    assert tuple(ds.CLASSES) == CLASSES and len(ds) == N_TRAIN
    for i in range(len(ds)):
        info = ds.get_data_info(i)
        assert osp.basename(osp.dirname(info['img_path'])) == CLASSES[info['gt_label']]
    with mmpretrain_scope():
        ds = CustomDataset(data_root=str(inet_root), ann_file='meta/val.txt', data_prefix='val',
                           metainfo=dict(classes=CLASSES), pipeline=_pipeline())
    assert len(ds) == N_VAL and ds[0]['data_samples'].gt_label.item() == 0
