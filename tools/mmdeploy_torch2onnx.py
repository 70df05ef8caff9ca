"""Export a normdense model to ONNX through mmdeploy 1.3.1 (its ``torch2onnx``: the codebase's rewriters, box
decoding, NMS and RoI heads included), for ONNX Runtime.

    python tools/mmdeploy_torch2onnx.py DEPLOY_CFG MODEL_CFG CHECKPOINT [IMG] --work-dir DIR [--check]

The arguments of mmdeploy's ``tools/deploy.py`` (which is not in mmdeploy's wheel, and whose export runs in a
spawned process that the compatibility shim cannot reach): DEPLOY_CFG is an mmdeploy deploy config
(``configs/deploy/``), MODEL_CFG the training config, CHECKPOINT the trained weights, IMG the image to trace on
(default: a random image at the deploy config's input shape). The export runs inside
``normdense.deploy.mmdeploy.mmdeploy_compat`` (the TorchScript exporter under torch >= 2.9, and what
mmdeploy's RoIAlign symbolic needs from torch); the checkpoint is checked to fit the model strictly first
(mmdeploy loads it non-strictly). A config that records a norm switch (``tools/train.py --norm``) is
switched; ``--norm`` switches it here. For ONNX Runtime nothing follows the export in mmdeploy's pipeline: the
.onnx in DIR is the deployable model. ``--check`` runs it in ONNX Runtime on the traced image and compares it
with mmdeploy's rewritten PyTorch forward. ``configs/deploy/README.md``.
"""
import argparse
import os
import sys

from mmengine.config import DictAction

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from normdense.errors import run_tool  # noqa: E402


def parse_args(argv=None):
    from normdense.norm_switch import CHOICES
    parser = argparse.ArgumentParser(description="Export a model to ONNX with mmdeploy's torch2onnx (ONNX Runtime)")
    parser.add_argument('deploy_cfg', help='mmdeploy deploy config (configs/deploy/*.py)')
    parser.add_argument('model_cfg', help='model config (mmdet / mmseg)')
    parser.add_argument('checkpoint', help='trained checkpoint')
    parser.add_argument('img', nargs='?', help='image to trace on (default: a random image at the input shape)')
    parser.add_argument('--work-dir', default='work_dirs/mmdeploy', help='where the .onnx goes')
    parser.add_argument('--device', default='cpu', help='device of the PyTorch model while tracing')
    parser.add_argument('--norm', choices=CHOICES, help='switch the config to this norm first (as tools/test.py)')
    parser.add_argument('--shape', type=int, nargs=2, metavar=('H', 'W'),
                        help="input size (sets the deploy config's onnx_config.input_shape to [W, H])")
    parser.add_argument('--check', action='store_true',
                        help="run the .onnx in ONNX Runtime and compare with mmdeploy's PyTorch forward")
    parser.add_argument('--no-strict', action='store_true',
                        help="skip the strict checkpoint check (mmdeploy's own load is non-strict)")
    parser.add_argument('--cfg-options', nargs='+', action=DictAction, help='override model config settings')
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from normdense.deploy import mmdeploy as md
    from normdense.deploy.onnx import relative_difference
    from normdense.tools import resolve_config
    md.require_mmdeploy()
    deploy_cfg = md.deploy_config(args.deploy_cfg)
    if args.shape:
        deploy_cfg.onnx_config.input_shape = [args.shape[1], args.shape[0]]
    model_cfg = md.model_config(resolve_config(args.model_cfg) or args.model_cfg, norm=args.norm,
                                cfg_options=args.cfg_options)
    img = args.img or md.sample_image(md.input_shape(deploy_cfg, model_cfg))
    path = md.export(deploy_cfg, model_cfg, args.checkpoint, args.work_dir, img=img, device=args.device,
                     strict=not args.no_strict)
    print(f'exported {args.model_cfg} with mmdeploy (TorchScript exporter, opset '
          f'{deploy_cfg.onnx_config.opset_version}) to {path}')
    if args.check:
        names, ref, got = md.pytorch_and_onnxruntime(deploy_cfg, model_cfg, args.checkpoint, path, img=img,
                                                     device=args.device)
        print('outputs: ' + ', '.join(f'{n} {list(t.shape)}' for n, t in zip(names, got)))
        if names[:2] == ['dets', 'labels']:
            m = md.match_detections(ref, got)
            print(f"ONNX Runtime vs PyTorch: {m['matched']} of PyTorch's top {m['compared']} detections "
                  '(>= 4 px) returned alike')
        elif all(t.is_floating_point() for t in ref):
            print(f'ONNX Runtime vs PyTorch: largest difference {relative_difference(ref, got):.2e} (relative to '
                  "each output's largest value)")
        else:
            same = sum(int((r == g).sum()) for r, g in zip(ref, got)) / max(1, sum(r.numel() for r in ref))
            print(f'ONNX Runtime vs PyTorch: {100 * same:.2f}% of the values equal (integer outputs: labels)')


if __name__ == '__main__':
    sys.exit(run_tool(main))
