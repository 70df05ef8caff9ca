"""Fold a trained normdense model for inference: build it from CONFIG (through the registry of the
config's default_scope), load CHECKPOINT, fuse (normdense.deploy.fuse) and save the fused weights to OUT.
WSConv2d layers fold with the WS formula saved in CHECKPOINT (the trained one), whatever CONFIG says.

Load the result with ``normdense.deploy.load_fused(CONFIG, OUT)`` (it rebuilds the fused structure from
the config and loads the weights strictly; the file loads with torch.load(weights_only=True)).
"""
import argparse
import os
import sys

from mmengine.config import DictAction

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from normdense.errors import run_tool  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Fuse normdense layers of a trained model for inference')
    parser.add_argument('config', help='model config file (mmdet / mmseg / mmpretrain)')
    parser.add_argument('checkpoint', help='trained checkpoint (state_dict or mmengine Runner checkpoint)')
    parser.add_argument('out', help='where to write the fused weights')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction, help='override config settings (k=v)')
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from mmengine.runner import load_checkpoint

    from normdense.codebases import read_config
    from normdense.deploy import build_model_from_config, fuse, save_fused
    cfg = read_config(args.config)  # a missing codebase / pkg_resources: one line
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    model = build_model_from_config(cfg)
    load_checkpoint(model, args.checkpoint, map_location='cpu', strict=True)
    model.eval()
    stats = {}
    fuse(model, stats=stats)
    save_fused(model, args.out, meta=dict(config=os.path.abspath(args.config),
                                          checkpoint=os.path.abspath(args.checkpoint), **stats))
    print(f'fused {stats["folded"]} conv->norm pairs, made {stats["convs"]} convs plain, replaced '
          f'{stats["standalone"]} norms without a conv; wrote {args.out}')


if __name__ == '__main__':
    sys.exit(run_tool(main))
