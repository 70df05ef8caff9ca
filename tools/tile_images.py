"""Tile images into one PNG grid: python tools/tile_images.py OUT.png IMG [IMG ...] [--cols 3]."""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from normdense.errors import run_tool  # noqa: E402
from normdense.visualization import tile_images  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description='Tile images into one PNG grid')
    parser.add_argument('out', help='output PNG path')
    parser.add_argument('images', nargs='+', help='input images')
    parser.add_argument('--cols', type=int, default=3)
    parser.add_argument('--titles', nargs='*', help='one title per image')
    args = parser.parse_args(argv)
    print(tile_images(args.images, args.out, cols=args.cols, titles=args.titles))


if __name__ == '__main__':
    sys.exit(run_tool(main))
