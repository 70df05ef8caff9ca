"""Train a normdense model from an mmdet, mmseg or mmpretrain config (the arguments of mmdet's train.py)."""
import argparse
import os
import sys

from mmengine.config import DictAction

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from normdense import launch  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Train a model (mmdet / mmseg / mmpretrain config, picked '
                                                 'from its default_scope) with normdense layers')
    parser.add_argument('config', help='train config file path')
    parser.add_argument('--work-dir', help='the dir to save logs and models')
    parser.add_argument('--amp', action='store_true', default=False,
                        help='enable automatic-mixed-precision training')
    parser.add_argument('--auto-scale-lr', action='store_true',
                        help='scale the learning rate by (GPUs x images per GPU) / auto_scale_lr.base_batch_size')
    parser.add_argument('--resume', nargs='?', type=str, const='auto',
                        help='resume from this checkpoint; without a path, from the latest one in the work dir')
    parser.add_argument('--allow-partial-load', action='store_true',
                        help='load a checkpoint that does not cover the model (missing, unexpected or '
                             'shape-mismatched keys) and log what stays at initialization (default: refuse)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, e.g. train_cfg.max_iters=10 (xxx=yyy, lists as [a,b])')
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
    launch.apply_train_args(cfg, amp=args.amp, auto_scale_lr=args.auto_scale_lr, resume=args.resume)
    launch.apply_load_args(cfg, allow_partial_load=args.allow_partial_load)
    runner = launch.build_runner(cfg)
    runner.train()


if __name__ == '__main__':
    main()
