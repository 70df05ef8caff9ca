"""Dataset checks: what would crash deep in a dataloader worker, or silently change a metric.

The datasets are built by the codebase's own classes (mmdet's CocoDataset, mmseg's BaseSegDataset
subclasses, mmpretrain's datasets) through its registry, without pipeline and without their filtering,
so the checks see what those classes resolve (paths, classes, label maps, ignore index) and every image.
COCO annotations are read again raw with pycocotools because mmdet drops the ones it cannot use
(unknown category ids, degenerate boxes) without a log line.

Errors (the exit status of tools/check_dataset.py is non-zero) crash training or testing, or change what
is trained on or measured; warnings are what the dataset class drops on purpose (e.g. boxes under 1 px).
"""
import contextlib
import importlib
import io
import os.path as osp
from collections import OrderedDict

import numpy as np

from normdense.config_check import _leaf_datasets

SPLITS = ('train_dataloader', 'val_dataloader', 'test_dataloader')


class Report:
    """Problems per split: ``errors`` and ``warnings`` are lists of ``(image, message)``."""

    def __init__(self):
        self.splits = OrderedDict()

    def split(self, name):
        return self.splits.setdefault(name, dict(images=0, errors=[], warnings=[], notes=[]))

    @property
    def num_errors(self):
        return sum(len(s['errors']) for s in self.splits.values())

    @property
    def ok(self):
        return self.num_errors == 0

    def summary(self):
        parts = []
        for name, s in self.splits.items():
            state = f"{len(s['errors'])} error(s)" if s['errors'] else 'ok'
            if s['warnings']:
                state += f", {len(s['warnings'])} warning(s)"
            parts.append(f"{name.replace('_dataloader', '')}: {s['images']} images, {state}")
        verdict = 'FAILED' if not self.ok else 'passed'
        return f"dataset check {verdict}: {'; '.join(parts)}"

    def text(self, limit=50):
        lines = []
        for name, s in self.splits.items():
            lines.append(f"[{name}] {s['images']} images")
            lines += [f'  note: {n}' for n in s['notes']]
            for kind in ('errors', 'warnings'):
                items = s[kind]
                shown = items if not limit else items[:limit]
                lines += [f"  {kind[:-1].upper()} {img}: {msg}" for img, msg in shown]
                if len(items) > len(shown):
                    lines.append(f'  ... {len(items) - len(shown)} more {kind}')
        lines.append(self.summary())
        return '\n'.join(lines)


def _image_size(path):
    """(width, height) from the image header (PIL reads no pixels for this)."""
    from PIL import Image
    with Image.open(path) as im:
        return im.size


def _rel(path, root):
    return osp.relpath(path, root) if root else path


# --- COCO (mmdet) ----------------------------------------------------------------------------------

def _polygon_problem(seg):
    if seg == [] or seg is None:
        return "empty polygon (segmentation=[]): mmdet keeps no 'mask' and LoadAnnotations(with_mask=True) " \
               "raises KeyError: 'mask'"
    if isinstance(seg, list):
        bad = [p for p in seg if not isinstance(p, (list, tuple)) or len(p) < 6 or len(p) % 2]
        if bad:
            return f'degenerate polygon ({len(bad[0]) if isinstance(bad[0], (list, tuple)) else bad[0]!r} ' \
                   'coordinates; a polygon needs >= 3 x,y points)'
    return None


def check_coco(ds, report, split):
    """mmdet's CocoDataset (and subclasses): the raw json against the images and the config's classes."""
    from pycocotools.coco import COCO
    s = report.split(split)
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its loading times
        coco = COCO(ds.ann_file)
    root = ds.data_root
    img_dir = ds.data_prefix.get('img', '')
    classes = ds.metainfo['classes']
    names = {c['name']: c['id'] for c in coco.dataset.get('categories', [])}
    for c in classes:
        if c not in names:
            s['errors'].append((ds.ann_file, f'class {c!r} of the config is not among the categories of the '
                                             'annotation file: its label has no ground truth and the class order '
                                             'no longer matches'))
    wanted = {names[c] for c in classes if c in names}
    anns = coco.dataset.get('annotations', [])
    if not anns:
        s['errors'].append((ds.ann_file, 'no annotations at all (mmdet fails with "ValueError: need at least one '
                                         'array to concatenate" when training)'))
    skipped_classes = 0
    for img_id in sorted(coco.imgs):
        info = coco.imgs[img_id]
        s['images'] += 1
        path = osp.join(img_dir, info['file_name'])
        name = _rel(path, root)
        w, h = info.get('width'), info.get('height')
        if not osp.isfile(path):
            s['errors'].append((name, 'image file missing'))
        else:
            size = _image_size(path)
            if (w, h) != size:
                s['errors'].append((name, f'image is {size[0]}x{size[1]} but the annotation file says {w}x{h} '
                                          '(boxes are clipped and masks decoded at the wrong size)'))
        for a in coco.imgToAnns.get(img_id, []):
            tag = f"annotation id {a.get('id')}"
            cat = a.get('category_id')
            if cat not in coco.cats:
                s['errors'].append((name, f'{tag}: unknown category id {cat} (not among the annotation file\'s '
                                          'categories; mmdet drops the annotation without a log line)'))
                continue
            if cat not in wanted:
                skipped_classes += 1
                continue
            x, y, bw, bh = a.get('bbox', (0, 0, 0, 0))
            if bw <= 0 or bh <= 0 or a.get('area', 1) <= 0:
                s['errors'].append((name, f'{tag}: degenerate box {a.get("bbox")} (area {a.get("area")}): '
                                          'mmdet drops it from training, COCO evaluation keeps it as ground truth'))
            elif w and h and (min(x + bw, w) - max(x, 0) <= 0 or min(y + bh, h) - max(y, 0) <= 0):
                s['errors'].append((name, f'{tag}: box {a["bbox"]} lies outside the {w}x{h} image'))
            elif bw < 1 or bh < 1:
                s['warnings'].append((name, f'{tag}: box {a["bbox"]} under 1 px, dropped by mmdet'))
            if 'segmentation' in a and not a.get('iscrowd', 0):
                msg = _polygon_problem(a['segmentation'])
                if msg:
                    s['errors'].append((name, f'{tag}: {msg}'))
            seg = a.get('segmentation')
            if isinstance(seg, dict) and list(seg.get('size', [h, w])) != [h, w]:
                s['errors'].append((name, f'{tag}: RLE size {seg["size"]} differs from the image\'s [height, width] '
                                          f'{[h, w]} in the annotation file'))
    if skipped_classes:
        s['notes'].append(f'{skipped_classes} annotations of categories outside the config\'s classes are not used')


# --- semantic segmentation (mmseg) -----------------------------------------------------------------

def _mmseg_labels(seg, reduce_zero_label, label_map):
    """The label map as mmseg's LoadAnnotations hands it to the model."""
    seg = seg.astype(np.int64)
    if reduce_zero_label:
        seg[seg == 0] = 255
        seg = seg - 1
        seg[seg == 254] = 255
    if label_map:
        out = seg.copy()
        for old, new in label_map.items():
            out[seg == old] = new
        seg = out
    return seg


def check_seg(ds, report, split):
    """mmseg's BaseSegDataset: files, mask values against the classes and ignore index, mask sizes."""
    from PIL import Image
    s = report.split(split)
    num_classes = len(ds.metainfo['classes'])
    ignore = ds.ignore_index
    root = ds.data_root
    for item in ds.load_data_list():
        s['images'] += 1
        img, seg_path = item['img_path'], item.get('seg_map_path')
        name = _rel(img, root)
        if not osp.isfile(img):
            s['errors'].append((name, 'image file missing'))
            img = None
        if seg_path is None:
            continue
        if not osp.isfile(seg_path):
            s['errors'].append((name, f'label map missing: {_rel(seg_path, root)}'))
            continue
        with Image.open(seg_path) as im:
            seg = np.asarray(im)
        if seg.ndim != 2:
            s['errors'].append((name, f'label map {_rel(seg_path, root)} has shape {seg.shape}, not one channel '
                                      '(colour masks must be converted to label indices)'))
            continue
        labels = _mmseg_labels(seg, item.get('reduce_zero_label', False), item.get('label_map'))
        values = np.unique(labels)
        bad = [int(v) for v in values if not (0 <= v < num_classes or v == ignore)]
        if bad:
            s['errors'].append((name, f'label map values {bad} outside the classes 0..{num_classes - 1} and the '
                                      f'ignore index {ignore} (training: "IndexError: Target {bad[0]} is out of '
                                      'bounds"; evaluation: silently changes mIoU)'))
        if img is not None:
            size = _image_size(img)
            if size != (seg.shape[1], seg.shape[0]):
                s['errors'].append((name, f'image is {size[0]}x{size[1]} but its label map '
                                          f'{seg.shape[1]}x{seg.shape[0]}'))


# --- classification (mmpretrain) -------------------------------------------------------------------

def check_cls(ds, report, split):
    """mmpretrain's datasets: image files and labels within the classes."""
    s = report.split(split)
    classes = ds.metainfo.get('classes')
    for item in ds.load_data_list():
        s['images'] += 1
        img = item.get('img_path')
        if img is not None and not osp.isfile(img):
            s['errors'].append((img, 'image file missing'))
        label = item.get('gt_label')
        if classes and label is not None and not all(0 <= int(v) < len(classes) for v in np.atleast_1d(label)):
            s['errors'].append((img, f'label {label} outside the {len(classes)} classes'))


# --- entry point -----------------------------------------------------------------------------------

def _checker(ds, scope):
    if scope == 'mmdet':
        from mmdet.datasets import CocoDataset
        return check_coco if isinstance(ds, CocoDataset) else None
    if scope == 'mmseg':
        from mmseg.datasets import BaseSegDataset
        return check_seg if isinstance(ds, BaseSegDataset) else None
    if scope == 'mmpretrain':
        return check_cls
    return None


def check_config_datasets(cfg, splits=SPLITS):
    """Check every dataset the given dataloaders of ``cfg`` read; returns a Report."""
    from mmengine.registry import DATASETS, DefaultScope
    scope = cfg.get('default_scope') or 'mmengine'
    if scope != 'mmengine':
        importlib.import_module(f'{scope}.utils').register_all_modules(init_default_scope=False)
    report = Report()
    seen = []
    for split in splits:
        loader = cfg.get(split)
        if not isinstance(loader, dict) or loader.get('dataset') is None:
            continue
        if loader['dataset'] in seen:  # test_dataloader = val_dataloader: checked once
            continue
        seen.append(loader['dataset'])
        report.split(split)
        for where, ds_cfg in _leaf_datasets(loader['dataset'], f'{split}.dataset'):
            with DefaultScope.overwrite_default_scope(scope):
                ds = DATASETS.build(dict(ds_cfg, lazy_init=True, pipeline=[]))
            check = _checker(ds, scope)
            if check is None:
                report.split(split)['notes'].append(f'{where}: no checks for {type(ds).__name__}')
                continue
            check(ds, report, split)
    return report
