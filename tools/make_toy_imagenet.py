#!/usr/bin/env python
"""Write the toy ImageNet-layout classification dataset: one dominant shape per image.

See docs/toy_data.md.

    python tools/make_toy_imagenet.py                   # data/toy_imagenet, 5000 train / 100 val
    python tools/make_toy_imagenet.py --num-train 10 --num-val 5 --out /tmp/inet
"""
import argparse
import os
import os.path as osp
import sys

try:
    import normdense  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from normdense.data.toy_scenes import CLASSES  # noqa: E402
from normdense.data.writers import timed, write_imagenet  # noqa: E402
from normdense.errors import run_tool  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--out', default='data/toy_imagenet', help='output root (default: %(default)s)')
    p.add_argument('--num-train', type=int, default=5000,
                   help='train images, labels cycle through the classes (default: %(default)s)')
    p.add_argument('--num-val', type=int, default=100, help='val images (default: %(default)s)')
    p.add_argument('--size', type=int, default=160,
                   help='image side in pixels (default: %(default)s)')
    p.add_argument('--seed', type=int, default=0, help='random seed (default: %(default)s)')
    p.add_argument('--max-distractors', type=int, default=2,
                   help='small objects of any class under the dominant one, at most '
                        '(default: %(default)s)')
    p.add_argument('--workers', type=int, default=os.cpu_count() or 1,
                   help='processes drawing the images; the files do not depend on it '
                        '(default: the number of cores, %(default)s)')
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    stats, secs = timed(write_imagenet, args.out, num_train=args.num_train, num_val=args.num_val,
                        size=args.size, seed=args.seed, max_distractors=args.max_distractors,
                        workers=args.workers)
    print(f'toy ImageNet layout ({len(CLASSES)} classes: {", ".join(CLASSES)}) written to '
          f'{args.out} in {secs:.2f}s')
    for split in ('train', 'val'):
        s = stats[split]
        print(f'  {split}: {s["images"]} images in {osp.join(args.out, split)}/<class>/, '
              f'list {s["ann_file"]}  per class {s["per_class"]}')
    print(f'  class names: {osp.join(args.out, "meta", "classes.txt")}')
    return stats


if __name__ == '__main__':
    sys.exit(run_tool(main))
