#!/usr/bin/env python
"""Write the toy COCO instance-segmentation dataset (see docs/toy_data.md).

    python tools/make_toy_coco.py                       # data/toy_coco, 256 train / 64 val, 160 px
    python tools/make_toy_coco.py --num-train 8 --num-val 4 --out /tmp/coco --preview /tmp/p.png
"""
import argparse
import os.path as osp
import sys

try:
    import normdense  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from normdense.data.toy_scenes import CLASSES  # noqa: E402
from normdense.data.writers import timed, write_coco  # noqa: E402
from normdense.errors import run_tool  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--out', default='data/toy_coco', help='output root (default: %(default)s)')
    p.add_argument('--num-train', type=int, default=256, help='train images (default: %(default)s)')
    p.add_argument('--num-val', type=int, default=64, help='val images (default: %(default)s)')
    p.add_argument('--size', type=int, default=160,
                   help='image side in pixels (default: %(default)s)')
    p.add_argument('--seed', type=int, default=0, help='random seed (default: %(default)s)')
    p.add_argument('--min-objects', type=int, default=2,
                   help='objects drawn per image, at least (default: %(default)s)')
    p.add_argument('--max-objects', type=int, default=6,
                   help='objects drawn per image, at most (default: %(default)s)')
    p.add_argument('--img-ext', default='.jpg', choices=['.jpg', '.png'],
                   help='image format (default: %(default)s)')
    p.add_argument('--preview', metavar='PNG',
                   help='also render a grid of train images with their masks')
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    stats, secs = timed(write_coco, args.out, num_train=args.num_train, num_val=args.num_val,
                        size=args.size, seed=args.seed, img_ext=args.img_ext,
                        num_objects=(args.min_objects, args.max_objects))
    print(f'toy COCO ({len(CLASSES)} classes: {", ".join(CLASSES)}) written to {args.out} '
          f'in {secs:.2f}s')
    for split in ('train', 'val'):
        s = stats[split]
        print(f'  {split}: {s["images"]} images in {s["img_dir"]}, {s["instances"]} instances in '
              f'{s["ann_file"]}  per class {s["per_class"]}')
    if args.preview:
        from normdense.data.preview import render_coco_preview
        print(f'  preview: {render_coco_preview(args.out, args.preview)}')
    return stats


if __name__ == '__main__':
    sys.exit(run_tool(main))
