"""Write toy scenes as COCO, PASCAL VOC (with the SBD-style aug split) and ImageNet-layout datasets.

Each ``write_*`` function is deterministic: the same arguments give byte-identical annotation files
and images (image ``i`` of split ``s`` always comes from ``scene_rng(seed, s, i)``). The layouts are
the ones the OpenMMLab dataset classes read unchanged:

* :func:`write_coco`      -> mmdet ``CocoDataset`` (``metainfo=dict(classes=CLASSES)``), pycocotools;
* :func:`write_voc`       -> mmseg ``PascalVOCDataset`` (21 VOC classes, toy classes on labels 1-5),
                             including the ``SegmentationClassAug`` + ``aug.txt`` split of
                             mmseg's ``pascal_voc12_aug.py``;
* :func:`write_imagenet`  -> mmpretrain ``ImageNet`` / ``CustomDataset`` with ``metainfo`` classes.

See docs/toy_data.md for the resulting trees and the config values that point at them.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import os.path as osp
import re
import time
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
from PIL import Image

from .toy_scenes import (CLASSES, ToyScene, generate_classification_scene, generate_scene,
                         scene_rng)

#: PASCAL VOC's 21 classes (as in mmseg's ``PascalVOCDataset``); label 255 is "ignore".
VOC_CLASSES: Tuple[str, ...] = (
    'background', 'aeroplane', 'bicycle', 'bird', 'boat', 'bottle', 'bus', 'car', 'cat', 'chair',
    'cow', 'diningtable', 'dog', 'horse', 'motorbike', 'person', 'pottedplant', 'sheep', 'sofa',
    'train', 'tvmonitor')
#: toy class id -> VOC label written into the segmentation maps (circle=aeroplane, ...).
TOY_TO_VOC: Tuple[int, ...] = tuple(range(1, len(CLASSES) + 1))
#: The VOC class names the toy data uses, background first: a valid ``metainfo['classes']`` subset
#: for ``PascalVOCDataset`` (then ``num_classes=6``); with the full 21 classes labels 6-20 are unused.
VOC_TOY_CLASSES: Tuple[str, ...] = ('background',) + tuple(VOC_CLASSES[v] for v in TOY_TO_VOC)

COCO_CATEGORIES: List[dict] = [
    {'id': i + 1, 'name': name, 'supercategory': 'shape'} for i, name in enumerate(CLASSES)]

IMAGENET_EXT = '.JPEG'


def voc_palette() -> List[int]:
    """The standard 256-entry PASCAL VOC colour map, flattened to [r0, g0, b0, r1, ...]."""
    pal = []
    for i in range(256):
        r = g = b = 0
        c = i
        for j in range(8):
            r |= ((c >> 0) & 1) << (7 - j)
            g |= ((c >> 1) & 1) << (7 - j)
            b |= ((c >> 2) & 1) << (7 - j)
            c >>= 3
        pal += [r, g, b]
    return pal


# ----------------------------------------------------------------------------------------------
# helpers


def _save_image(image: np.ndarray, path: str, quality: int = 95) -> None:
    ext = osp.splitext(path)[1].lower()
    img = Image.fromarray(image)
    if ext in ('.jpg', '.jpeg'):
        img.save(path, format='JPEG', quality=quality)
    else:
        img.save(path, format='PNG')


def _remove_stale(folder: str, pattern: str, keep: Iterable[str]) -> int:
    """Delete files in ``folder`` that match ``pattern`` (files an earlier, larger run of the same
    writer made) but are not in ``keep``; other files are left alone. Returns how many went."""
    if not osp.isdir(folder):
        return 0
    keep, rx, n = set(keep), re.compile(pattern), 0
    for name in os.listdir(folder):
        if rx.fullmatch(name) and name not in keep:
            os.remove(osp.join(folder, name))
            n += 1
    return n


def _write_lines(path: str, lines: Sequence[str]) -> None:
    with open(path, 'w', newline='\n') as f:
        f.writelines(line + '\n' for line in lines)


def _write_json(path: str, obj) -> None:
    with open(path, 'w', newline='\n') as f:
        json.dump(obj, f, separators=(',', ':'))
        f.write('\n')


def encode_rle(mask: np.ndarray) -> dict:
    """COCO compressed RLE of a bool mask, JSON-ready (``counts`` as str)."""
    from pycocotools import mask as mask_utils
    rle = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
    return {'size': [int(rle['size'][0]), int(rle['size'][1])],
            'counts': rle['counts'].decode('ascii')}


def scenes_for_split(seed: int, split: str, num: int, size: int, **kwargs) -> Iterable[ToyScene]:
    for i in range(num):
        yield generate_scene(scene_rng(seed, split, i), size=size, **kwargs)


# ----------------------------------------------------------------------------------------------
# COCO


def coco_dict(scenes: Sequence[ToyScene], file_names: Sequence[str],
              info: Optional[dict] = None) -> dict:
    """A COCO instances dict for ``scenes`` (image ids 1.., annotation ids 1..)."""
    images, annotations = [], []
    for img_id, (scene, fname) in enumerate(zip(scenes, file_names), start=1):
        h, w = scene.image.shape[:2]
        images.append({'id': img_id, 'file_name': fname, 'width': w, 'height': h})
        for inst in scene.instances:
            annotations.append({
                'id': len(annotations) + 1, 'image_id': img_id, 'category_id': inst.label + 1,
                'segmentation': encode_rle(inst.mask), 'area': inst.area,
                'bbox': inst.bbox_xywh, 'iscrowd': 0})
    return {'info': info or {}, 'licenses': [], 'images': images, 'annotations': annotations,
            'categories': COCO_CATEGORIES}


def write_coco(out_dir: str = 'data/toy_coco', num_train: int = 256, num_val: int = 64,
               size: int = 160, seed: int = 0, img_ext: str = '.jpg',
               num_objects: Tuple[int, int] = (2, 6)) -> Dict[str, dict]:
    """Write ``out_dir/{train,val}/NNNNNN.jpg`` and ``out_dir/annotations/instances_{split}.json``.

    Segmentations are compressed RLE (exact, and ring-shaped masks keep their holes), ``bbox`` is
    the tight ``[x, y, w, h]`` box of the visible mask, ``area`` its pixel count, ``iscrowd`` 0.
    Returns per-split stats: images, instances, per-class instance counts, paths.
    """
    img_ext = img_ext if img_ext.startswith('.') else '.' + img_ext
    os.makedirs(osp.join(out_dir, 'annotations'), exist_ok=True)
    stats = {}
    for split, num in (('train', num_train), ('val', num_val)):
        img_dir = osp.join(out_dir, split)
        os.makedirs(img_dir, exist_ok=True)
        scenes, names = [], []
        for i, scene in enumerate(scenes_for_split(seed, split, num, size, num_objects=num_objects)):
            name = f'{i:06d}{img_ext}'
            _save_image(scene.image, osp.join(img_dir, name))
            scenes.append(scene)
            names.append(name)
        _remove_stale(img_dir, r'\d{6}\.(jpg|png)', names)
        info = {'description': f'normdense toy COCO ({split})', 'version': '1.0',
                'generator': 'normdense.data.writers.write_coco', 'seed': seed, 'size': size}
        coco = coco_dict(scenes, names, info)
        ann_file = osp.join(out_dir, 'annotations', f'instances_{split}.json')
        _write_json(ann_file, coco)
        stats[split] = {'images': len(scenes), 'instances': len(coco['annotations']),
                        'per_class': _count_labels(scenes), 'img_dir': img_dir, 'ann_file': ann_file}
    return stats


def _count_labels(scenes: Sequence[ToyScene]) -> Dict[str, int]:
    counts = {name: 0 for name in CLASSES}
    for s in scenes:
        for inst in s.instances:
            counts[CLASSES[inst.label]] += 1
    return counts


# ----------------------------------------------------------------------------------------------
# PASCAL VOC


def write_voc(out_dir: str = 'data/toy_voc', num_train: int = 256, num_val: int = 64,
              num_aug: int = 256, size: int = 160, seed: int = 0, ignore_border: int = 0,
              num_objects: Tuple[int, int] = (2, 6)) -> Dict[str, dict]:
    """Write a VOC2012 segmentation tree under ``out_dir/VOCdevkit/VOC2012``.

    * ``JPEGImages/<id>.jpg`` for every split (train, val and the aug-only images);
    * ``SegmentationClass/<id>.png``: palette PNGs (VOC colour map) for train and val; with
      ``ignore_border > 0`` label boundaries of that width are 255 like real VOC outlines;
    * ``SegmentationClassAug/<id>.png``: plain 8-bit label PNGs (no palette, no 255 outlines, like
      the SBD conversion of mmseg's ``voc_aug.py``) for train and aug ids;
    * ``ImageSets/Segmentation/{train,val,trainval,aug,trainaug}.txt``; ``aug.txt`` lists the
      aug-only ids (disjoint from train and val), ``trainaug.txt`` train + aug, as mmseg's
      converter writes them.

    Labels are VOC's: 0 background, toy class ``k`` -> ``k + 1`` (see ``TOY_TO_VOC``).
    """
    root = osp.join(out_dir, 'VOCdevkit', 'VOC2012')
    dirs = {k: osp.join(root, k) for k in
            ('JPEGImages', 'SegmentationClass', 'SegmentationClassAug', 'ImageSets/Segmentation')}
    for d in dirs.values():
        os.makedirs(d, exist_ok=True)
    palette = voc_palette()
    ids: Dict[str, List[str]] = {}
    stats = {}
    for split, num in (('train', num_train), ('val', num_val), ('aug', num_aug)):
        ids[split] = []
        scenes = []
        for i, scene in enumerate(scenes_for_split(seed, split, num, size, num_objects=num_objects)):
            img_id = f'{split}_{i:06d}'
            ids[split].append(img_id)
            scenes.append(scene)
            _save_image(scene.image, osp.join(dirs['JPEGImages'], img_id + '.jpg'))
            if split in ('train', 'val'):
                sem = scene.semantic_map(offset=1, ignore_border=ignore_border)
                png = Image.fromarray(sem)  # mode 'L'; putpalette turns it into 'P', same indices
                png.putpalette(palette)
                png.save(osp.join(dirs['SegmentationClass'], img_id + '.png'))
            if split in ('train', 'aug'):
                Image.fromarray(scene.semantic_map(offset=1)).save(
                    osp.join(dirs['SegmentationClassAug'], img_id + '.png'))
        stats[split] = {'images': num, 'instances': sum(len(s.instances) for s in scenes),
                        'per_class': _count_labels(scenes)}
    all_ids = ids['train'] + ids['val'] + ids['aug']
    _remove_stale(dirs['JPEGImages'], r'(train|val|aug)_\d{6}\.jpg', [i + '.jpg' for i in all_ids])
    _remove_stale(dirs['SegmentationClass'], r'(train|val|aug)_\d{6}\.png',
                  [i + '.png' for i in ids['train'] + ids['val']])
    _remove_stale(dirs['SegmentationClassAug'], r'(train|val|aug)_\d{6}\.png',
                  [i + '.png' for i in ids['train'] + ids['aug']])
    lists = {'train': ids['train'], 'val': ids['val'], 'trainval': ids['train'] + ids['val'],
             'aug': ids['aug'], 'trainaug': ids['train'] + ids['aug']}
    for name, lines in lists.items():
        _write_lines(osp.join(dirs['ImageSets/Segmentation'], name + '.txt'), lines)
    stats['root'] = root
    return stats


# ----------------------------------------------------------------------------------------------
# ImageNet layout


def _write_classification_image(job: Tuple[str, int, str, int, int, int]) -> Tuple[str, int]:
    """Draw and save image ``i`` of ``split``; returns (its path relative to the split folder, label)."""
    out_dir, seed, split, i, size, max_distractors = job
    label = i % len(CLASSES)
    scene = generate_classification_scene(scene_rng(seed, 'cls-' + split, i), label,
                                          size=size, max_distractors=max_distractors)
    rel = f'{CLASSES[label]}/{split}_{i:06d}{IMAGENET_EXT}'
    _save_image(scene.image, osp.join(out_dir, split, rel))
    return rel, label


def write_imagenet(out_dir: str = 'data/toy_imagenet', num_train: int = 5000, num_val: int = 100,
                   size: int = 160, seed: int = 0, max_distractors: int = 2,
                   workers: int = 1) -> Dict[str, dict]:
    """Write ``{train,val}/<class>/<split>_NNNNNN.JPEG`` plus ``meta/{train,val}.txt`` (lines
    ``<class>/<file> <label>``) and ``meta/classes.txt``.

    Image ``i`` shows one dominant object of class ``i % len(CLASSES)`` (so classes are balanced
    to within one image) over up to ``max_distractors`` small objects of any class.
    ``workers > 1`` draws the images in that many processes; every image has its own generator,
    so the files are the same as with one.
    """
    if workers < 1:
        raise ValueError(f'workers must be >= 1, got {workers}')
    os.makedirs(osp.join(out_dir, 'meta'), exist_ok=True)
    stats = {}
    for split, num in (('train', num_train), ('val', num_val)):
        lines, per_class = [], {name: 0 for name in CLASSES}
        for name in CLASSES:
            os.makedirs(osp.join(out_dir, split, name), exist_ok=True)
        jobs = [(out_dir, seed, split, i, size, max_distractors) for i in range(num)]
        if workers > 1 and num > 1:
            with multiprocessing.get_context('fork').Pool(min(workers, num)) as pool:
                written = pool.map(_write_classification_image, jobs, chunksize=32)
        else:
            written = [_write_classification_image(job) for job in jobs]
        for rel, label in written:
            lines.append(f'{rel} {label}')
            per_class[CLASSES[label]] += 1
        for name in CLASSES:
            keep = [osp.basename(ln.split(' ')[0]) for ln in lines if ln.startswith(name + '/')]
            _remove_stale(osp.join(out_dir, split, name), split + r'_\d{6}\.JPEG', keep)
        _write_lines(osp.join(out_dir, 'meta', f'{split}.txt'), lines)
        stats[split] = {'images': num, 'per_class': per_class,
                        'ann_file': osp.join(out_dir, 'meta', f'{split}.txt')}
    _write_lines(osp.join(out_dir, 'meta', 'classes.txt'), list(CLASSES))
    return stats


def timed(fn, *args, **kwargs):
    """(result, seconds) of ``fn(*args, **kwargs)``: the CLIs print both."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0
