"""Render a written toy COCO split (images + decoded annotations) as a PNG grid, for docs and eyeballs.

It reads back what :func:`normdense.data.writers.write_coco` wrote (through pycocotools), so the
picture shows the annotations as a consumer sees them, not the generator's in-memory masks.
"""
from __future__ import annotations

import os
import os.path as osp
from typing import Optional

import numpy as np
from PIL import Image, ImageDraw

from .toy_scenes import CLASS_COLORS, label_boundaries


def render_coco_preview(data_root: str, out_png: str, split: str = 'train', num: int = 6,
                        cols: int = 3, scale: int = 2, alpha: float = 0.45,
                        ann_file: Optional[str] = None, quantize: bool = True) -> str:
    """Save a grid of ``num`` images of ``split``: each as a pair (image | masks, boxes, names).

    Mask colours are fixed per class (``CLASS_COLORS``), with outlines so overlapping instances of
    the same class stay distinguishable. ``quantize`` saves a 256-colour (dithered) PNG, about a
    fifth of the size of the RGB one: small enough to keep in the docs.
    """
    from pycocotools import mask as mask_utils
    from pycocotools.coco import COCO

    ann_file = ann_file or osp.join(data_root, 'annotations', f'instances_{split}.json')
    coco = _quiet(COCO, ann_file)
    names = {c['id']: c['name'] for c in coco.loadCats(coco.getCatIds())}
    tiles = []
    for img_id in sorted(coco.getImgIds())[:num]:
        info = coco.loadImgs(img_id)[0]
        image = np.asarray(Image.open(osp.join(data_root, split, info['file_name'])).convert('RGB'))
        over = image.astype(np.float32).copy()
        anns = coco.loadAnns(coco.getAnnIds(imgIds=img_id))
        inst_map = np.zeros(image.shape[:2], np.int32)
        for k, ann in enumerate(anns, start=1):
            m = mask_utils.decode(coco.annToRLE(ann)).astype(bool)
            inst_map[m] = k
            color = np.array(CLASS_COLORS[(ann['category_id'] - 1) % len(CLASS_COLORS)], np.float32)
            over[m] = (1 - alpha) * over[m] + alpha * color
        over[label_boundaries(inst_map, 1) & (inst_map > 0)] = 255.0
        pair = np.concatenate([image, np.clip(over, 0, 255).astype(np.uint8)], axis=1)
        tile = Image.fromarray(pair).resize((pair.shape[1] * scale, pair.shape[0] * scale),
                                            Image.NEAREST)
        draw = ImageDraw.Draw(tile)
        w = image.shape[1]
        for ann in anns:
            x, y, bw, bh = ann['bbox']
            color = CLASS_COLORS[(ann['category_id'] - 1) % len(CLASS_COLORS)]
            box = [(w + x) * scale, y * scale, (w + x + bw) * scale - 1, (y + bh) * scale - 1]
            draw.rectangle(box, outline=color, width=2)
            label = names[ann['category_id']]
            tx, ty = box[0] + 2, max(box[1] - 11, 0)
            draw.rectangle([tx - 1, ty, tx + 6 * len(label) + 1, ty + 10], fill=(0, 0, 0))
            draw.text((tx, ty - 1), label, fill=color)
        tiles.append(np.asarray(tile))
    if not tiles:
        raise ValueError(f'no images in {ann_file}')
    rows = []
    pad = np.full((tiles[0].shape[0], 6, 3), 255, np.uint8)
    for r in range(0, len(tiles), cols):
        row = tiles[r:r + cols]
        row += [np.full_like(tiles[0], 255)] * (cols - len(row))
        parts = []
        for t in row:
            parts += [t, pad]
        rows.append(np.concatenate(parts[:-1], axis=1))
        rows.append(np.full((6, rows[-1].shape[1], 3), 255, np.uint8))
    grid = np.concatenate(rows[:-1], axis=0)
    os.makedirs(osp.dirname(osp.abspath(out_png)), exist_ok=True)
    img = Image.fromarray(grid)
    if quantize:
        img = img.quantize(colors=256, method=Image.Quantize.FASTOCTREE)
    img.save(out_png, optimize=True)
    return out_png


def _quiet(fn, *args):
    """Call ``fn`` with stdout silenced (pycocotools prints index-building chatter)."""
    import contextlib
    import io
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args)
