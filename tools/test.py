"""Evaluate a checkpoint with an mmdet, mmseg or mmpretrain config.

Takes every argument of mmdet's, mmseg's and mmpretrain's own tools/test.py (see
normdense.launch.test_arg_parser), with each codebase's meaning of --out and --tta; config and data errors
found before the runner is built are reported as one line.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from normdense import launch  # noqa: E402


def parse_args(argv=None):
    return launch.parse_args(launch.test_arg_parser(), argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        cfg = launch.prepare_test(args)
    except launch.USER_ERRORS as e:
        sys.exit(f'test.py: error: {e}')
    return launch.run_test(cfg, args)


if __name__ == '__main__':
    main()
