"""Normalization diagnostics of a trained model: StatDiff, SND, power decomposition and (with
--compare-checkpoint) the ICS measures, per layer, written as JSON + PNG.

    python tools/analyze_norms.py CONFIG CHECKPOINT [--compare-checkpoint EARLIER.pth] \
        --layer-types Unitization2d BatchChannelNorm2d --layer-names 'backbone.*' --out-dir work_dirs/diag

The logic lives in normdense.analysis.report.
"""
import argparse
import json
import sys

from mmengine.config import DictAction

import normdense  # noqa: F401  (registers the layers)
from normdense.analysis.recorder import DIAGNOSTICS
from normdense.analysis.report import SPLITS, analyze_checkpoint, write_report
from normdense.errors import run_tool


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('config')
    p.add_argument('checkpoint')
    p.add_argument('--compare-checkpoint', help='second checkpoint of the same model (e.g. an earlier '
                   'iteration): enables ics_moment / em_distance between the two')
    p.add_argument('--out-dir', default='work_dirs/norm_diagnostics')
    p.add_argument('--split', default='val', choices=SPLITS, help='which dataloader of the config to use')
    p.add_argument('--num-batches', type=int, default=4)
    p.add_argument('--layer-names', nargs='*', default=None, help="fnmatch patterns, e.g. 'backbone.*'")
    p.add_argument('--layer-types', nargs='*', default=None, help='class names, e.g. Unitization2d GroupNorm')
    p.add_argument('--diagnostics', nargs='+', default=list(DIAGNOSTICS), choices=DIAGNOSTICS)
    p.add_argument('--max-samples', type=int, default=4096)
    p.add_argument('--snd-batch-size', type=int, default=2)
    p.add_argument('--ics-orders', type=int, nargs='+', default=[2, 3, 4], help='orders n of the Eq. 6-7 bound')
    p.add_argument('--em-method', default='marginal', choices=['marginal', 'sliced'])
    p.add_argument('--device', default='cpu')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--cfg-options', nargs='+', action=DictAction, help='override config settings')
    args = p.parse_args(argv)
    if not args.layer_names and not args.layer_types:
        p.error('choose layers with --layer-names and/or --layer-types')
    return args


def main(argv=None):
    args = parse_args(argv)
    report = analyze_checkpoint(
        args.config, args.checkpoint, compare_checkpoint=args.compare_checkpoint, split=args.split,
        num_batches=args.num_batches, cfg_options=args.cfg_options, device=args.device,
        layer_names=args.layer_names, layer_types=args.layer_types, diagnostics=args.diagnostics,
        max_samples=args.max_samples, snd_cfg=dict(batch_size=args.snd_batch_size), ics_orders=args.ics_orders,
        em_method=args.em_method, seed=args.seed)
    paths = write_report(report, args.out_dir)
    print(json.dumps(paths))
    return paths


if __name__ == '__main__':
    sys.exit(run_tool(main))
