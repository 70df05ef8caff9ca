#!/usr/bin/env python
"""Convert an ImageNet classifier checkpoint into an mmdet or mmseg ResNet backbone checkpoint.

    python tools/convert_checkpoint.py work_dirs/resnet50_bcn-ws_in1k/epoch_90.pth \\
        checkpoints/resnet50_bcn-ws_in1k.pth --to mmdet
    python tools/convert_checkpoint.py rn50_bcn_ws.pth checkpoints/resnet50_bcn-ws_in1k.pth --to mmdet --from authors
    python tools/convert_checkpoint.py resnet50-torchvision.pth checkpoints/resnet50_bcn-ws_from-bn.pth \\
        --to mmdet --from torchvision --norm bcn --ws-formula paper

Writes DST's folder/<stem>-<sha256[:8]>.pth (bare backbone keys + a meta block) and makes DST a symlink to it.
Prints what was and was not mapped; refuses a conversion that would leave part of the target backbone at its
initialization unless --allow-partial. See docs/pretraining.md and checkpoints/README.md.
"""
import argparse
import os.path as osp
import sys

try:
    import normdense  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from normdense.convert.backbone import (NORM_TYPES, SOURCES, TARGETS, WS_CHOICES, ConversionError,  # noqa: E402
                                        convert_backbone, load_source, save_backbone_checkpoint)
from normdense.errors import run_tool  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('src', help='source checkpoint (mmpretrain Runner checkpoint, authors\' release, torchvision): '
                               'a local file, https://..., open-mmlab://... or torchvision://... (cached in $TORCH_HOME)')
    p.add_argument('dst', help='stable output name, e.g. checkpoints/resnet50_bcn-ws_in1k.pth (becomes a symlink)')
    p.add_argument('--to', required=True, choices=TARGETS, help='codebase whose ResNet the backbone is for')
    p.add_argument('--from', dest='source', choices=SOURCES, default=None,
                   help='source layout (default: guessed from the keys)')
    p.add_argument('--allow-partial', action='store_true',
                   help='write even if part of the target backbone would stay at its initialization '
                        '(then load with strict=False)')
    p.add_argument('--ws-formula', choices=WS_CHOICES, default=None,
                   help="WS formula of the convs ('none': plain convs). mmpretrain: read from the checkpoint's "
                        "config; authors: default var_unbiased (BCN) / std_unbiased (GN); torchvision: the "
                        "target's WS (default paper)")
    p.add_argument('--norm', choices=tuple(NORM_TYPES), default=None,
                   help='norm layers: a check for mmpretrain/authors sources; for torchvision the target '
                        '(bcn, default, or bn)')
    p.add_argument('--num-groups', type=int, default=None,
                   help='groups of GN/BCN where the weights do not record them (default 32)')
    p.add_argument('--bcn-mode', choices=('estimate', 'batch'), default=None,
                   help='torchvision -> BCN: the BCN mode recorded for the starting point (default estimate)')
    p.add_argument('--dry-run', action='store_true', help='print the conversion report, write nothing')
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        conv = convert_backbone(load_source(args.src), args.to, source=args.source, norm=args.norm,
                                ws_formula=args.ws_formula, num_groups=args.num_groups, bcn_mode=args.bcn_mode)
        print(conv.report())
        if args.dry_run:
            return 0 if conv.complete else 1
        final = save_backbone_checkpoint(conv, args.dst, allow_partial=args.allow_partial,
                                         source_path=args.src if '://' in args.src else osp.abspath(args.src))
    except (ConversionError, FileNotFoundError) as e:
        print(f'error: {e}', file=sys.stderr)
        return 1
    print(f'wrote {final}\n  {args.dst} -> {osp.basename(final)}')
    print(f"  load with: init_cfg=dict(type='PretrainedBackbone', checkpoint='{args.dst}'"
          + (', strict=False)' if not conv.complete else ')'))
    print(f'  backbone: {conv.backbone_cfg}')
    return 0


if __name__ == '__main__':
    sys.exit(run_tool(main))
