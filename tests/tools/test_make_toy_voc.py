"""tools/make_toy_voc.py: the written VOC tree is read by mmseg's PascalVOCDataset (train and aug)."""
import contextlib
import importlib.util
import os.path as osp

import numpy as np
import pytest
from PIL import Image

from normdense.data.toy_scenes import CLASSES, generate_scene, scene_rng
from normdense.data.writers import VOC_CLASSES, VOC_TOY_CLASSES, voc_palette

TOOL = osp.join(osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))), 'tools',
                'make_toy_voc.py')
N_TRAIN, N_VAL, N_AUG = 6, 3, 5


def load_tool():
    spec = importlib.util.spec_from_file_location('make_toy_voc', TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def mmseg_scope():
    """Register mmseg's modules and make 'mmseg' the default scope only inside the block (so the
    transforms in ``pipeline`` resolve to mmseg's), leaving the global default scope untouched."""
    from mmengine.registry import DefaultScope
    from mmseg.utils import register_all_modules
    register_all_modules(init_default_scope=False)
    with DefaultScope.overwrite_default_scope('mmseg'):
        yield


def make(out, *extra):
    return load_tool().main(['--out', str(out), '--num-train', str(N_TRAIN), '--num-val',
                             str(N_VAL), '--num-aug', str(N_AUG), *extra])


@pytest.fixture(scope='module')
def voc_root(tmp_path_factory):
    out = tmp_path_factory.mktemp('toy_voc')
    make(out)
    return out / 'VOCdevkit' / 'VOC2012'


def lines(path):
    with open(path) as f:
        return f.read().split()


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        load_tool().main(['--help'])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert 'data/toy_voc' in out and '--num-aug' in out and '--ignore-border' in out


def test_layout(voc_root):
    sets = voc_root / 'ImageSets' / 'Segmentation'
    train, val, aug = lines(sets / 'train.txt'), lines(sets / 'val.txt'), lines(sets / 'aug.txt')
    assert (len(train), len(val), len(aug)) == (N_TRAIN, N_VAL, N_AUG)
    assert lines(sets / 'trainval.txt') == train + val
    assert lines(sets / 'trainaug.txt') == train + aug
    assert not (set(aug) & set(train)) and not (set(aug) & set(val)) and not (set(train) & set(val))
    for i in train + val + aug:
        assert (voc_root / 'JPEGImages' / f'{i}.jpg').is_file()
    assert sorted(p.stem for p in (voc_root / 'SegmentationClass').iterdir()) == sorted(train + val)
    assert sorted(p.stem for p in (voc_root / 'SegmentationClassAug').iterdir()) == \
        sorted(train + aug)
    # SegmentationClass: palette PNGs with VOC's colour map; SegmentationClassAug: plain labels
    png = Image.open(voc_root / 'SegmentationClass' / f'{train[0]}.png')
    assert png.mode == 'P' and png.getpalette()[:3 * 256] == voc_palette()
    assert voc_palette()[3:6] == [128, 0, 0] and voc_palette()[3 * 15:3 * 16] == [192, 128, 128]
    assert Image.open(voc_root / 'SegmentationClassAug' / f'{aug[0]}.png').mode == 'L'


def test_labels_match_scenes(voc_root):
    for split, idx in (('train', 0), ('val', 2), ('aug', 4)):
        scene = generate_scene(scene_rng(0, split, idx), size=160)
        expected = scene.semantic_map()
        folders = {'train': ['SegmentationClass', 'SegmentationClassAug'],
                   'val': ['SegmentationClass'], 'aug': ['SegmentationClassAug']}[split]
        for folder in folders:
            got = np.asarray(Image.open(voc_root / folder / f'{split}_{idx:06d}.png'))
            assert np.array_equal(got, expected), (split, folder)
        assert set(np.unique(expected)) <= set(range(len(CLASSES) + 1))


def test_deterministic_and_ignore_border(voc_root, tmp_path):
    make(tmp_path / 'same')
    same = tmp_path / 'same' / 'VOCdevkit' / 'VOC2012'
    for rel in ('SegmentationClass/train_000001.png', 'SegmentationClassAug/aug_000001.png',
                'JPEGImages/val_000000.jpg', 'ImageSets/Segmentation/aug.txt'):
        assert (voc_root / rel).read_bytes() == (same / rel).read_bytes()
    make(tmp_path / 'border', '--ignore-border', '2', '--seed', '3')
    border = tmp_path / 'border' / 'VOCdevkit' / 'VOC2012'
    cls = np.asarray(Image.open(border / 'SegmentationClass' / 'train_000000.png'))
    aug = np.asarray(Image.open(border / 'SegmentationClassAug' / 'train_000000.png'))
    assert (cls == 255).any() and not (aug == 255).any()  # outlines only in SegmentationClass
    keep = cls != 255
    assert np.array_equal(cls[keep], aug[keep])
    assert (voc_root / 'JPEGImages/train_000000.jpg').read_bytes() != \
        (border / 'JPEGImages/train_000000.jpg').read_bytes()


def _pipeline():
    return [dict(type='LoadImageFromFile'), dict(type='LoadAnnotations'),
            dict(type='PackSegInputs')]


def test_mmseg_pascal_voc_dataset_train_and_aug(voc_root):
    from mmseg.datasets import PascalVOCDataset
    for seg_dir, ann, split, n in (('SegmentationClass', 'train.txt', 'train', N_TRAIN),
                                   ('SegmentationClass', 'val.txt', 'val', N_VAL),
                                   ('SegmentationClassAug', 'aug.txt', 'aug', N_AUG)):
        with mmseg_scope():
            ds = PascalVOCDataset(data_root=str(voc_root),
                                  data_prefix=dict(img_path='JPEGImages', seg_map_path=seg_dir),
                                  ann_file=f'ImageSets/Segmentation/{ann}', pipeline=_pipeline())
        assert len(ds) == n and ds.metainfo['classes'] == VOC_CLASSES
        out = ds[1]
        assert tuple(out['inputs'].shape) == (3, 160, 160)
        seg = out['data_samples'].gt_sem_seg.data.numpy()[0]
        expected = generate_scene(scene_rng(0, split, 1), size=160).semantic_map()
        assert np.array_equal(seg, expected)


def test_mmseg_voc12aug_config_builds_on_toy_data(voc_root):
    """mmseg's own pascal_voc12_aug.py (train = ConcatDataset(train + aug)) with our data_root."""
    import mmseg
    from mmengine.config import Config
    from mmseg.registry import DATASETS
    cfg_path = osp.join(osp.dirname(mmseg.__file__), '.mim', 'configs', '_base_', 'datasets',
                        'pascal_voc12_aug.py')
    if not osp.isfile(cfg_path):
        pytest.skip('mmseg wheel without .mim configs')
    cfg = Config.fromfile(cfg_path)
    train = cfg.train_dataloader.dataset
    for sub in train.datasets:
        sub.data_root = str(voc_root)
    val_cfg = cfg.val_dataloader.dataset
    val_cfg.data_root = str(voc_root)
    with mmseg_scope():
        ds = DATASETS.build(train)
        val = DATASETS.build(val_cfg)
    assert len(ds) == N_TRAIN + N_AUG
    sample = ds[N_TRAIN + 1]  # from the aug part, through mmseg's real train pipeline
    assert sample['data_samples'].gt_sem_seg.data.shape[-2:] == sample['inputs'].shape[-2:]
    assert len(val) == N_VAL
    assert val[0]['data_samples'].gt_sem_seg.data.shape[-2:] == (160, 160)  # labels not resized


def test_mmseg_toy_class_subset(voc_root):
    """metainfo classes = background + the 5 VOC classes in use (num_classes=6) keeps label ids."""
    from mmseg.datasets import PascalVOCDataset
    with mmseg_scope():
        ds = PascalVOCDataset(
            data_root=str(voc_root), metainfo=dict(classes=VOC_TOY_CLASSES),
            data_prefix=dict(img_path='JPEGImages', seg_map_path='SegmentationClass'),
            ann_file='ImageSets/Segmentation/train.txt', pipeline=_pipeline())
    assert ds.metainfo['classes'] == VOC_TOY_CLASSES
    seg = ds[0]['data_samples'].gt_sem_seg.data.numpy()[0]
    expected = generate_scene(scene_rng(0, 'train', 0), size=160).semantic_map()
    assert np.array_equal(seg, expected)
