"""Fold a trained normdense model for inference and/or export it to ONNX.

Takes every config tools/train.py takes: a file or a packaged name (mmdet::..., mmseg::...), a norm switch in
any form (--norm NAME, --cfg-options normdense_norm=NAME, normdense_norm = NAME in the config, a NormSwitched
model). Builds the model from CONFIG (through the registry of the config's default_scope), loads CHECKPOINT
strictly (a checkpoint of another norm: one line naming both norms and the fix; --debug adds the keys),
fuses it (normdense.deploy.fuse: WS, BCN, GN+PN, IterNorm, Unitization, EquiNorm become plain torch.nn modules),
then:

* OUT: saves the fused weights; ``normdense.deploy.load_fused(CONFIG, OUT)`` rebuilds the fused model from the
  config and loads them strictly (the file loads with torch.load(weights_only=True));
* ``--onnx OUT.onnx``: exports the fused model (``--no-fuse``: as trained) with torch's TorchScript exporter at
  ``--opset`` (``--dynamo``: the dynamo exporter), runs ONNX Runtime on a sample image and prints the largest
  difference from PyTorch. Segmentors export image -> logits at the input size; detectors image -> the neck's
  features and the RPN's / dense head's raw outputs (the RoI heads and NMS go through mmdeploy:
  docs/deploy.md); classifiers image -> logits.

WSConv2d layers fold with the WS formula saved in CHECKPOINT (the trained one), whatever CONFIG says.
"""
import argparse
import os
import sys

from mmengine.config import DictAction

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from normdense.errors import run_tool  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Fuse normdense layers of a trained model for inference, '
                                                 'and export it to ONNX')
    from normdense.norm_switch import CHOICES
    parser.add_argument('config', help='model config (mmdet / mmseg / mmpretrain): a file or a packaged name such '
                                       'as mmdet::retinanet/retinanet_r50_fpn_1x_coco.py')
    parser.add_argument('checkpoint', help='trained checkpoint (state_dict or mmengine Runner checkpoint)')
    parser.add_argument('out', nargs='?', help='where to write the fused weights (optional with --onnx)')
    parser.add_argument('--onnx', metavar='OUT.onnx', help='export to this ONNX file and check it in ONNX Runtime')
    parser.add_argument('--opset', type=int, default=17,
                        help='ONNX opset of the TorchScript exporter (default 17; mmdeploy uses 11)')
    parser.add_argument('--dynamo', action='store_true', help="torch's dynamo exporter (needs onnxscript)")
    parser.add_argument('--no-fuse', action='store_true', help='export the model as trained, not fused')
    parser.add_argument('--shape', type=int, nargs=2, metavar=('H', 'W'),
                        help="sample image size (default: the config's crop size or test Resize, else 512 x 512)")
    parser.add_argument('--norm', choices=CHOICES,
                        help='switch the config to this norm first (the --norm the checkpoint was trained with)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings (k=v), e.g. normdense_norm=gn-pn')
    parser.add_argument('--debug', action='store_true',
                        help='show the traceback of a known error (and a mismatching checkpoint\'s keys)')
    args = parser.parse_args(argv)
    if args.out is None and args.onnx is None:
        parser.error('give OUT (fused weights), --onnx OUT.onnx, or both')
    if args.no_fuse and args.out is not None:
        parser.error('--no-fuse applies to --onnx only: OUT holds fused weights')
    return args


def main(argv=None):
    args = parse_args(argv)
    from normdense.checkpoint import norm_of_keys
    from normdense.deploy import fuse, save_fused
    from normdense.deploy.io import build_switched, load_trained, switched_config
    from normdense.tools import resolve_config
    # a missing codebase / pkg_resources, an unknown norm: one line
    cfg, spec = switched_config(resolve_config(args.config) or args.config, args.norm, args.cfg_options)
    if args.onnx:  # before the model is built: a missing extra is one line, at once
        from normdense.deploy.onnx import require
        require('onnx', 'onnxruntime', *(('onnxscript', ) if args.dynamo else ()))
    model = build_switched(cfg, spec)
    load_trained(model, args.checkpoint)
    model.eval()
    stats = dict(norm=norm_of_keys(model.state_dict()))
    if not args.no_fuse:
        fuse(model, stats=stats)
        print(f'fused {stats["folded"]} conv->norm pairs, made {stats["convs"]} convs plain, replaced '
              f'{stats["standalone"]} norms without a conv')
    if args.out:
        save_fused(model, args.out, meta=dict(config=os.path.abspath(args.config),
                                              checkpoint=os.path.abspath(args.checkpoint), **stats))
        print(f'wrote the fused weights to {args.out}')
    if args.onnx:
        from normdense.deploy.onnx import export_trained, sample_size
        size = tuple(args.shape) if args.shape else sample_size(cfg)
        exporter = 'dynamo' if args.dynamo else f'TorchScript exporter, opset {args.opset}'
        report = export_trained(model, args.onnx, size, opset=None if args.dynamo else args.opset,
                                dynamo=args.dynamo)
        outputs = ', '.join(f'{k} {list(v)}' for k, v in report['outputs'].items())
        print(f'exported the {"trained" if args.no_fuse else "fused"} {report["kind"]} ({exporter}) to {args.onnx}: '
              f'input {list(report["input"])} -> {outputs}')
        print(f'ONNX Runtime vs PyTorch: largest difference {report["difference"]:.2e} (relative to each '
              f'output\'s largest value)')


if __name__ == '__main__':
    sys.exit(run_tool(main))
