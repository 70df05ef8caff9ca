"""Evaluate a checkpoint with an mmdet, mmseg or mmpretrain config.

Takes every argument of mmdet's, mmseg's and mmpretrain's own tools/test.py (see
normdense.jobs.test_arg_parser), with each codebase's meaning of --out and --tta; config and data errors
found before the runner is built, and the known errors of normdense.errors (missing codebase, broken mmcv,
...), are reported as one line; --debug shows the traceback.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from normdense import jobs  # noqa: E402
from normdense.errors import debug_requested, run_tool  # noqa: E402


def parse_args(argv=None):
    return jobs.parse_args(jobs.test_arg_parser(), argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        cfg = jobs.prepare_test(args)
    except jobs.USER_ERRORS as e:
        if debug_requested():
            raise
        sys.exit(f'test.py: error: {e}')
    return jobs.run_test(cfg, args)


if __name__ == '__main__':
    sys.exit(run_tool(main))  # known errors: one line (--debug: traceback)
