#!/usr/bin/env python
"""Write the toy PASCAL VOC 2012 segmentation dataset with its SBD-style aug split.

See docs/toy_data.md.

Labels are VOC's 21 classes: 0 background, toy classes circle, rectangle, ring, star, triangle on
labels 1-5 (VOC's aeroplane, bicycle, bird, boat, bottle); 255 = ignore (only with --ignore-border).

    python tools/make_toy_voc.py                        # data/toy_voc/VOCdevkit/VOC2012
    python tools/make_toy_voc.py --num-train 8 --num-val 4 --num-aug 8 --out /tmp/voc
"""
import argparse
import os.path as osp
import sys

try:
    import normdense  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from normdense.data.writers import timed, write_voc  # noqa: E402
from normdense.errors import run_tool  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--out', default='data/toy_voc',
                   help='output root; the tree goes in OUT/VOCdevkit/VOC2012 (default: %(default)s)')
    p.add_argument('--num-train', type=int, default=256, help='train images (default: %(default)s)')
    p.add_argument('--num-val', type=int, default=64, help='val images (default: %(default)s)')
    p.add_argument('--num-aug', type=int, default=256,
                   help='aug-only images (SegmentationClassAug, aug.txt) (default: %(default)s)')
    p.add_argument('--size', type=int, default=160,
                   help='image side in pixels (default: %(default)s)')
    p.add_argument('--seed', type=int, default=0, help='random seed (default: %(default)s)')
    p.add_argument('--ignore-border', type=int, default=0,
                   help='width of 255 (ignore) outlines in SegmentationClass, like real VOC; '
                        '0 = none (default: %(default)s)')
    p.add_argument('--min-objects', type=int, default=2,
                   help='objects drawn per image, at least (default: %(default)s)')
    p.add_argument('--max-objects', type=int, default=6,
                   help='objects drawn per image, at most (default: %(default)s)')
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    stats, secs = timed(write_voc, args.out, num_train=args.num_train, num_val=args.num_val,
                        num_aug=args.num_aug, size=args.size, seed=args.seed,
                        ignore_border=args.ignore_border,
                        num_objects=(args.min_objects, args.max_objects))
    print(f'toy VOC written to {stats["root"]} in {secs:.2f}s')
    for split in ('train', 'val', 'aug'):
        s = stats[split]
        print(f'  {split}: {s["images"]} images, {s["instances"]} instances, '
              f'per class {s["per_class"]}')
    print('  JPEGImages/*.jpg, SegmentationClass/*.png (train, val; VOC palette), '
          'SegmentationClassAug/*.png (train, aug; plain labels), '
          'ImageSets/Segmentation/{train,val,trainval,aug,trainaug}.txt')
    return stats


if __name__ == '__main__':
    sys.exit(run_tool(main))
