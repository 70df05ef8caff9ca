"""tools/make_toy_coco.py: the written COCO set is deterministic and read by pycocotools and mmdet."""
import copy
import contextlib
import importlib.util
import json
import os.path as osp

import numpy as np
import pytest

from normdense.data.toy_scenes import CLASSES, generate_scene, scene_rng

TOOL = osp.join(osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))), 'tools',
                'make_toy_coco.py')


def load_tool():
    spec = importlib.util.spec_from_file_location('make_toy_coco', TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def mmdet_scope():
    """Register mmdet's modules and make 'mmdet' the default scope only inside the block (so the
    transforms in ``pipeline`` resolve to mmdet's), leaving the global default scope untouched."""
    from mmengine.registry import DefaultScope
    from mmdet.utils import register_all_modules
    register_all_modules(init_default_scope=False)
    with DefaultScope.overwrite_default_scope('mmdet'):
        yield


def make(out, *extra):
    return load_tool().main(['--out', str(out), '--num-train', '8', '--num-val', '4', *extra])


@pytest.fixture(scope='module')
def coco_root(tmp_path_factory):
    root = tmp_path_factory.mktemp('toy_coco')
    make(root)
    return root


def read(path):
    with open(path, 'rb') as f:
        return f.read()


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        load_tool().main(['--help'])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ('--out', '--num-train', '--num-val', '--size', '--seed'):
        assert opt in out
    assert 'data/toy_coco' in out


def test_layout_and_output(coco_root, capsys, tmp_path):
    for split, n in (('train', 8), ('val', 4)):
        assert sorted(p.name for p in (coco_root / split).iterdir()) == \
            [f'{i:06d}.jpg' for i in range(n)]
        assert (coco_root / 'annotations' / f'instances_{split}.json').is_file()
    make(tmp_path / 'c')
    out = capsys.readouterr().out
    assert 'written to' in out and 's' in out.split('in ')[-1] and 'instances' in out


def test_deterministic(coco_root, tmp_path):
    make(tmp_path / 'same')
    for split in ('train', 'val'):
        ann = f'annotations/instances_{split}.json'
        assert read(coco_root / ann) == read(tmp_path / 'same' / ann)
        for i in range(3):
            assert read(coco_root / split / f'{i:06d}.jpg') == \
                read(tmp_path / 'same' / split / f'{i:06d}.jpg')
    make(tmp_path / 'other', '--seed', '1')
    assert read(coco_root / 'annotations/instances_train.json') != \
        read(tmp_path / 'other' / 'annotations/instances_train.json')
    # a smaller re-run into the same folder removes the images it no longer lists
    load_tool().main(['--out', str(tmp_path / 'same'), '--num-train', '3', '--num-val', '2'])
    assert len(list((tmp_path / 'same' / 'train').iterdir())) == 3


def test_png_images(tmp_path):
    from PIL import Image
    make(tmp_path / 'png', '--img-ext', '.png', '--size', '96')
    img = Image.open(tmp_path / 'png' / 'train' / '000003.png')
    assert img.format == 'PNG' and img.size == (96, 96)
    scene = generate_scene(scene_rng(0, 'train', 3), size=96)
    assert np.array_equal(np.asarray(img), scene.image)  # lossless: exactly the generated pixels


def test_annotations_match_masks_and_scenes(coco_root):
    from pycocotools import mask as mask_utils
    with open(coco_root / 'annotations/instances_train.json') as f:
        coco = json.load(f)
    assert [c['name'] for c in coco['categories']] == list(CLASSES)
    assert [c['id'] for c in coco['categories']] == list(range(1, len(CLASSES) + 1))
    assert len(coco['images']) == 8
    ann_ids = [a['id'] for a in coco['annotations']]
    assert ann_ids == list(range(1, len(ann_ids) + 1))
    for img in coco['images']:
        assert (img['width'], img['height']) == (160, 160)
        scene = generate_scene(scene_rng(0, 'train', img['id'] - 1), size=160)
        anns = [a for a in coco['annotations'] if a['image_id'] == img['id']]
        assert [a['category_id'] - 1 for a in anns] == scene.labels
        for a, inst in zip(anns, scene.instances):
            assert a['iscrowd'] == 0
            m = mask_utils.decode(a['segmentation']).astype(bool)
            assert np.array_equal(m, inst.mask)
            assert a['area'] == int(m.sum()) == int(mask_utils.area(a['segmentation']))
            assert a['bbox'] == mask_utils.toBbox(a['segmentation']).tolist()
            x, y, w, h = a['bbox']
            assert m[y:y + h, x:x + w].sum() == m.sum()


@pytest.mark.parametrize('iou_type', ['bbox', 'segm'])
def test_cocoeval_ground_truth_as_detections_gives_ap_1(coco_root, iou_type, capsys):
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval
    gt = COCO(str(coco_root / 'annotations/instances_val.json'))

    def evaluate(shift_class):
        dets = []  # fresh dicts: loadRes adds keys to the ones it is given
        for a in gt.loadAnns(gt.getAnnIds()):
            cat = (a['category_id'] + shift_class - 1) % len(CLASSES) + 1
            det = {'image_id': a['image_id'], 'category_id': cat, 'score': 1.0}
            if iou_type == 'bbox':
                det['bbox'] = list(a['bbox'])
            else:
                det['segmentation'] = copy.deepcopy(a['segmentation'])
            dets.append(det)
        ev = COCOeval(gt, gt.loadRes(dets), iou_type)
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
        return ev.stats

    stats = evaluate(0)
    assert stats[0] == pytest.approx(1.0)   # AP@[.5:.95]
    assert stats[8] == pytest.approx(1.0)   # AR@100
    assert evaluate(1)[0] == pytest.approx(0.0)  # every detection with a wrong class


def test_mmdet_coco_dataset_reads_it(coco_root):
    from mmdet.datasets import CocoDataset
    from pycocotools import mask as mask_utils
    with mmdet_scope():
        ds = CocoDataset(
            data_root=str(coco_root), ann_file='annotations/instances_train.json',
            data_prefix=dict(img='train/'), metainfo=dict(classes=CLASSES),
            filter_cfg=dict(filter_empty_gt=True, min_size=4),
            pipeline=[dict(type='LoadImageFromFile'),
                      dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
                      dict(type='PackDetInputs')])
    assert len(ds) == 8 and ds.metainfo['classes'] == CLASSES
    with open(coco_root / 'annotations/instances_train.json') as f:
        coco = json.load(f)
    for idx in (0, 5):
        out = ds[idx]
        sample = out['data_samples']
        assert tuple(out['inputs'].shape) == (3, 160, 160)
        anns = [a for a in coco['annotations'] if a['image_id'] == sample.img_id]
        gi = sample.gt_instances
        assert len(anns) == len(gi) > 0
        assert gi.labels.tolist() == [a['category_id'] - 1 for a in anns]
        x, y, w, h = np.array([a['bbox'] for a in anns], np.float32).T
        assert np.allclose(gi.bboxes.tensor.numpy(), np.stack([x, y, x + w, y + h], 1))
        masks = gi.masks.to_ndarray().astype(bool)
        for m, a in zip(masks, anns):
            assert np.array_equal(m, mask_utils.decode(a['segmentation']).astype(bool))
            assert a['area'] == m.sum()


def test_mmdet_coco_metric_on_ground_truth(coco_root):
    """mmdet's CocoMetric (what the configs evaluate with) scores ground-truth predictions 1.0."""
    import torch
    from mmdet.datasets import CocoDataset
    from mmdet.evaluation import CocoMetric
    with mmdet_scope():
        ds = CocoDataset(
            data_root=str(coco_root), ann_file='annotations/instances_val.json',
            data_prefix=dict(img='val/'), metainfo=dict(classes=CLASSES), test_mode=True,
            pipeline=[dict(type='LoadImageFromFile'),
                      dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
                      dict(type='PackDetInputs', meta_keys=('img_id', 'ori_shape', 'img_shape'))])
        metric = CocoMetric(ann_file=str(coco_root / 'annotations/instances_val.json'),
                            metric=['bbox', 'segm'])
    metric.dataset_meta = ds.metainfo
    preds = []
    for i in range(len(ds)):
        sample = ds[i]['data_samples']
        gi = sample.gt_instances
        preds.append({'img_id': sample.img_id, 'ori_shape': sample.ori_shape,
                      'pred_instances': {'bboxes': gi.bboxes.tensor, 'labels': gi.labels,
                                         'scores': torch.ones(len(gi)),
                                         'masks': torch.from_numpy(gi.masks.to_ndarray()).bool()}})
    metric.process({}, preds)
    res = metric.evaluate(len(preds))
    assert res['coco/bbox_mAP'] == pytest.approx(1.0)
    assert res['coco/segm_mAP'] == pytest.approx(1.0)


def test_preview(coco_root, tmp_path):
    from PIL import Image
    out = tmp_path / 'prev.png'
    load_tool().main(['--out', str(tmp_path / 'p'), '--num-train', '3', '--num-val', '1',
                      '--preview', str(out)])
    img = Image.open(out)
    assert img.mode in ('RGB', 'P') and img.size[0] > 3 * 2 * 160
