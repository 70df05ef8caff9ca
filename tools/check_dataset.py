"""Check the train/val/test datasets of a config before training: missing files, empty or degenerate
polygons and boxes, unknown category ids, label values outside the classes and ignore index, image/mask
size mismatches. Exit status 1 when anything would crash or silently change a metric (docs/data.md).

    python tools/check_dataset.py configs/mask_rcnn_r50_fpn_bcn_ws.py
    python tools/check_dataset.py CONFIG --splits train --cfg-options train_dataloader.dataset.data_root=/data/coco/
"""
import argparse
import os
import sys

from mmengine.config import DictAction

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from normdense import jobs  # noqa: E402
from normdense.data.check import check_config_datasets  # noqa: E402
from normdense.errors import debug_requested, run_tool  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('config', help='config: a file, or a packaged name (mmdet::..., mmseg::...)')
    p.add_argument('--splits', nargs='+', choices=['train', 'val', 'test'], default=['train', 'val', 'test'],
                   help='which dataloaders to check (default: all; a test set equal to val is checked once)')
    p.add_argument('--limit', type=int, default=50, help='problems listed per split and kind, 0 = all')
    p.add_argument('--cfg-options', nargs='+', action=DictAction, help='override config settings (xxx=yyy)')
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        cfg = jobs.load_config(args.config, args.cfg_options)
        loaders = [f'{s}_dataloader' for s in args.splits]
        jobs.check_data_paths_of(cfg, loaders, evaluators=False)
    except jobs.USER_ERRORS as e:
        if debug_requested():
            raise
        sys.exit(f'check_dataset.py: error: {e}')
    report = check_config_datasets(cfg, splits=loaders)
    print(report.text(limit=args.limit))
    return 0 if report.ok else 1


if __name__ == '__main__':
    sys.exit(run_tool(main))
