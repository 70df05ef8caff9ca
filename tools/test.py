"""Evaluate a checkpoint with an mmdet, mmseg or mmpretrain config (the arguments of mmdet's test.py)."""
import argparse
import os
import sys

from mmengine.config import DictAction

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from normdense import launch  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Test (and evaluate) a model: COCO AP for mmdet configs, '
                                                 'mIoU for mmseg, accuracy for mmpretrain')
    parser.add_argument('config', help='test config file path')
    parser.add_argument('checkpoint', help='checkpoint: a local file, https://..., open-mmlab://... or torchvision://...')
    parser.add_argument('--work-dir', help='the dir to save logs and the evaluation metrics')
    parser.add_argument('--out', help='dump the raw predictions to this pickle file')
    parser.add_argument('--show', action='store_true', help='show prediction results in a window')
    parser.add_argument('--show-dir', help='save images with drawn predictions into this directory '
                                           '(relative to the work dir\'s timestamped folder)')
    parser.add_argument('--allow-partial-load', action='store_true',
                        help='load a checkpoint that does not cover the model (missing, unexpected or '
                             'shape-mismatched keys) and log what stays at initialization (default: refuse)')
    parser.add_argument('--wait-time', type=float, default=2, help='the interval of show (s)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings (xxx=yyy)')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'], default='none',
                        help='job launcher')
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args(argv)
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    return args


def main(argv=None):
    args = parse_args(argv)
    cfg = launch.load_config(args.config, args.cfg_options, args.launcher, args.work_dir)
    launch.apply_test_args(cfg, args.checkpoint, out=args.out, show=args.show, show_dir=args.show_dir,
                           wait_time=args.wait_time)
    launch.apply_load_args(cfg, allow_partial_load=args.allow_partial_load)
    runner = launch.build_runner(cfg)
    if args.out:
        launch.add_result_dump(runner, args.out, launch.codebase_of(cfg))
    return runner.test()


if __name__ == '__main__':
    main()
