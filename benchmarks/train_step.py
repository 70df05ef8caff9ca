"""One-image Mask R-CNN training step per normalization variant, against GN and mmcv's ConvWS + GN.

    python benchmarks/train_step.py                          # small model: 1 thread, 320x320, 7 repeats
    python benchmarks/train_step.py --threads 2 --size 512 512 --repeats 11
    python benchmarks/train_step.py --model r50-fpn          # R-50-FPN: 1 thread, 800x1216, 3 repeats
    python benchmarks/train_step.py --model r50-fpn --size 256 320 --repeats 1 --out /tmp/r50.json  # smoke

``--model r18-small`` (default): the small Mask R-CNN of tests/mm_models.py (ResNet-18, 64-channel FPN and
heads, 32 sampled RoIs, the layers in backbone, FPN, 4conv1fc box head and mask head; GN+PN: PNResNet
backbone with the rest GN, as the project's configs do; EquiNorm: EquiConv2d + ChannelAffine backbone on
[0, 1] inputs, rest GN, as tests/layers/test_equinorm.py). Writes benchmarks/results/train_step.json.

``--model r50-fpn``: mmdet's standard Mask R-CNN R-50-FPN (``_base_/models/mask-rcnn_r50_fpn.py``: 256-channel
FPN, RPN, 2000 -> 1000 proposals, 512 sampled RoIs, 28x28 mask targets, 80 classes, stem and stage 1
frozen) with conv_cfg/norm_cfg in backbone, FPN, Shared4Conv1FCBBoxHead and mask head, the layout of
mmdet's configs/gn+ws and of configs/mask_rcnn/mask-rcnn_r50_fpn_{gn-ws,bcn-ws,gn-pn}_2x_coco.py, random
weights (no checkpoint). Variants: ``mmcv GN+WS`` (conv_cfg ConvWS, GN(32): mmdet's gn+ws baseline),
``WSConv2d + BCN estimate`` (fused, the default), ``WSConv2d + BCN estimate reference`` (fused=False),
``GN+PN (PNResNet)`` (GNPN backbone, rest GN with plain convs); BCN with update_rate=0.01 in the
norm_cfg. Target printed: WSConv2d + BCN estimate step <= 1.02x mmcv GN+WS. Writes
benchmarks/results/train_step_r50.json.

Both: one random image (``--size`` H W) with 3 random gt boxes and masks; a step is ``model.train_step``
(data preprocessing, forward, backward, SGD update with momentum). All variants live in memory and are
timed interleaved (benchmarks/_timing.py, 1 warm-up round; the same seed before every step, so every
variant and repeat samples the same anchors and RoIs); medians and IQR. Also counts the bytes autograd
saves for backward during one more step (activation memory; CPU torch has no allocator peak counter;
``--no-memory`` skips it). ``--variants`` runs a subset (the reference variants are always included).
"""
import argparse
import copy
import json
import os
import os.path as osp
import sys

import torch

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks._timing import conditions, interleaved_times, median_iqr, saved_activation_bytes  # noqa: E402

GN = dict(type='GN', num_groups=32, requires_grad=True)
UNIT_RANGE = {'data_preprocessor.mean': [0.0, 0.0, 0.0], 'data_preprocessor.std': [255.0, 255.0, 255.0]}
BCN_R50 = dict(type='BCN', num_groups=32, mode='estimate', update_rate=0.01)
R50_TARGET = 1.02  # WSConv2d + BCN estimate step / mmcv GN+WS step


def variants():
    """The small Mask R-CNN (R-18, FPN-64) variants."""
    from tests.mm_models import mask_rcnn_cfg
    r18 = dict(type='ResNet', depth=18, num_stages=4, out_indices=(0, 1, 2, 3), frozen_stages=-1,
               norm_eval=False, style='pytorch')
    return {
        'GN': mask_rcnn_cfg(norm_cfg=GN),
        'mmcv ConvWS + GN': mask_rcnn_cfg(conv_cfg=dict(type='ConvWS'), norm_cfg=GN),
        'WSConv2d + GN': mask_rcnn_cfg(conv_cfg=dict(type='WSConv2d'), norm_cfg=GN),
        'WSConv2d + BCN estimate': mask_rcnn_cfg(conv_cfg=dict(type='WSConv2d'),
                                                 norm_cfg=dict(type='BCN', num_groups=32)),
        'GN+PN (PNResNet)': mask_rcnn_cfg(norm_cfg=GN, backbone=dict(
            r18, type='PNResNet', norm_cfg=dict(type='GNPN', num_groups=32))),
        'IterNorm': mask_rcnn_cfg(norm_cfg=dict(type='IterNorm')),
        'Unitization estimate': mask_rcnn_cfg(norm_cfg=dict(type='Unitization', mode='estimate',
                                                            requires_grad=True)),
        'EquiConv2d + ChannelAffine': mask_rcnn_cfg(norm_cfg=GN, overrides=UNIT_RANGE, backbone=dict(
            r18, conv_cfg=dict(type='EquiConv2d'), norm_cfg=dict(type='ChannelAffine', requires_grad=True))),
    }


def r50_fpn_cfg(conv_cfg=None, norm_cfg=None, backbone=None):
    """mmdet's mask-rcnn_r50_fpn model with conv_cfg/norm_cfg on backbone, FPN, the 4conv1fc box head and
    the mask head (mmdet's configs/gn+ws placement), random init (the backbone's torchvision checkpoint
    dropped). ``backbone``: entries replacing the ResNet-50's (e.g. PNResNet with its norm_cfg)."""
    from mmengine.config import Config

    from tests.mm_models import base_config
    model = copy.deepcopy(base_config('mmdet', '_base_/models/mask-rcnn_r50_fpn.py').model.to_dict())
    model['backbone'].update(conv_cfg=conv_cfg, norm_cfg=norm_cfg, norm_eval=False, init_cfg=None)
    model['backbone'].update(backbone or {})
    model['neck'].update(conv_cfg=conv_cfg, norm_cfg=norm_cfg)
    roi = model['roi_head']
    roi['bbox_head'] = dict(roi['bbox_head'], type='Shared4Conv1FCBBoxHead', conv_out_channels=256,
                            conv_cfg=conv_cfg, norm_cfg=norm_cfg)
    roi['mask_head'].update(conv_cfg=conv_cfg, norm_cfg=norm_cfg)
    return Config(dict(model=model)).model  # a ConfigDict, as the detectors expect


def r50_variants():
    ws = dict(type='WSConv2d')
    return {
        'mmcv GN+WS': r50_fpn_cfg(conv_cfg=dict(type='ConvWS'), norm_cfg=GN),
        'WSConv2d + BCN estimate': r50_fpn_cfg(conv_cfg=ws, norm_cfg=BCN_R50),
        'WSConv2d + BCN estimate reference': r50_fpn_cfg(conv_cfg=ws, norm_cfg=dict(BCN_R50, fused=False)),
        'GN+PN (PNResNet)': r50_fpn_cfg(norm_cfg=GN, backbone=dict(
            type='PNResNet', norm_cfg=dict(type='GNPN', num_groups=32))),
    }


# per --model: variants, default image size and repeats, output, the rows the others are compared with
MODES = {
    'r18-small': dict(variants=variants, size=(320, 320), repeats=7, out='train_step.json',
                      title='Mask R-CNN R-18 FPN-64', refs=(('GN', 'gn'), ('mmcv ConvWS + GN', 'mmcv_ws_gn'))),
    'r50-fpn': dict(variants=r50_variants, size=(800, 1216), repeats=3, out='train_step_r50.json',
                    title='Mask R-CNN R-50-FPN (mmdet layout, 4conv1fc box head)',
                    refs=(('mmcv GN+WS', 'mmcv_gn_ws'), )),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', choices=list(MODES), default='r18-small')
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--size', type=int, nargs=2, default=None, metavar=('H', 'W'),
                        help='image size (default: 320 320 for r18-small, 800 1216 for r50-fpn)')
    parser.add_argument('--repeats', type=int, default=None, help='timed rounds after 1 warm-up round '
                        '(default: 7 for r18-small, 3 for r50-fpn)')
    parser.add_argument('--lr', type=float, default=0.002)
    parser.add_argument('--variants', nargs='+', default=None, metavar='NAME',
                        help='run only these variants (and the reference ones)')
    parser.add_argument('--no-memory', action='store_true', help='skip the saved-for-backward count (one '
                        'more step per variant)')
    parser.add_argument('--out', default=None, help='JSON path (default benchmarks/results/train_step.json, '
                        'train_step_r50.json for r50-fpn)')
    args = parser.parse_args(argv)
    mode = MODES[args.model]
    size = list(args.size or mode['size'])
    repeats = args.repeats or mode['repeats']
    out = args.out or osp.join(ROOT, 'benchmarks', 'results', mode['out'])
    torch.set_num_threads(args.threads)
    from mmdet.testing import demo_mm_inputs
    from mmengine.logging import MMLogger
    from mmengine.optim import OptimWrapper

    from normdense.layers import set_update_rate
    from tests.mm_models import build_detector
    MMLogger.get_current_instance().setLevel('ERROR')  # init_weights logs every parameter

    cfgs = mode['variants']()
    if args.variants:
        unknown = set(args.variants) - set(cfgs)
        if unknown:
            parser.error(f'unknown variants {sorted(unknown)}; {args.model} has {list(cfgs)}')
        keep = set(args.variants) | {name for name, _ in mode['refs']}
        cfgs = {n: c for n, c in cfgs.items() if n in keep}
    torch.manual_seed(0)
    data = demo_mm_inputs(1, image_shapes=[(3, *size)], num_items=[3], num_classes=3, with_mask=True)
    models, steps = {}, {}
    for name, cfg in cfgs.items():
        torch.manual_seed(0)
        model = build_detector(cfg).train()
        set_update_rate(model, args.lr)  # what BCNRateHook does (estimate layers without a fixed rate)
        optim = OptimWrapper(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9))
        models[name] = (model, optim)

        def step(model=model, optim=optim):
            torch.manual_seed(0)  # same RPN / RoI sampling in every variant and repeat
            model.train_step(copy.deepcopy(data), optim)
        steps[name] = step
    cond = conditions(args.threads)
    print('conditions:', json.dumps(cond))
    times = interleaved_times(steps, repeats, warmup=1)
    rows = {}
    for name, (model, optim) in models.items():
        med, iqr = median_iqr(times[name])
        rows[name] = dict(median_ms=med * 1e3, iqr_ms=iqr * 1e3, times_ms=[t * 1e3 for t in times[name]])
        if not args.no_memory:
            saved = saved_activation_bytes(lambda: steps[name](), list(model.parameters()))
            rows[name]['saved_MB'] = saved / 2**20
    refs = mode['refs']
    print(f'\n{mode["title"]} training step (train_step: preprocessing, forward, backward, SGD), one '
          f'{size[0]}x{size[1]} image, {args.threads} thread(s), {repeats} interleaved repeats')
    print(f'{"variant":36s} {"median ms":>10s} {"IQR ms":>8s} '
          + ' '.join(f'{"/ " + ref:>{max(len(ref) + 2, 6)}s}' for ref, _ in refs)
          + ('' if args.no_memory else f' {"saved MB":>9s} {"mem / " + refs[0][0]:>{len(refs[0][0]) + 6}s}'))
    for name, r in rows.items():
        for ref, slug in refs:
            r[f'time_vs_{slug}'] = r['median_ms'] / rows[ref]['median_ms']
        if not args.no_memory:
            r[f'mem_vs_{refs[0][1]}'] = r['saved_MB'] / rows[refs[0][0]]['saved_MB']
        print(f'{name:36s} {r["median_ms"]:10.0f} {r["iqr_ms"]:8.0f} '
              + ' '.join(f'{r[f"time_vs_{slug}"]:{max(len(ref) + 2, 6)}.3f}' for ref, slug in refs)
              + ('' if args.no_memory else f' {r["saved_MB"]:9.1f} '
                 f'{r[f"mem_vs_{refs[0][1]}"]:{len(refs[0][0]) + 6}.2f}'))
    result = dict(conditions=cond, conditions_end=conditions(args.threads), model=args.model, image_size=size,
                  repeats=repeats, lr=args.lr, rows=rows)
    if args.model == 'r50-fpn':
        result['targets'] = r50_targets(rows)
    os.makedirs(osp.dirname(osp.abspath(out)), exist_ok=True)
    with open(out, 'w') as f:
        json.dump(result, f, indent=1)
    print(f'wrote {out}')
    return result


def r50_targets(rows):
    targets = []
    name, ref = 'WSConv2d + BCN estimate', 'mmcv GN+WS'
    if name in rows:
        r = rows[name]['median_ms'] / rows[ref]['median_ms']
        targets.append(dict(target=f'{name} (fused) step <= {R50_TARGET}x {ref}', value=round(r, 4),
                            passed=bool(r <= R50_TARGET)))
    print('\ntargets:')
    for t in targets:
        print(f'  {"PASS" if t["passed"] else "FAIL"}  {t["target"]}  value {t["value"]}')
    name_ref = 'WSConv2d + BCN estimate reference'
    for other in (name_ref, 'GN+PN (PNResNet)'):
        if other in rows:  # for comparison, not a target
            print(f'  (for comparison: {other} / {ref} = {rows[other]["median_ms"] / rows[ref]["median_ms"]:.3f})')
    return targets


if __name__ == '__main__':
    main()
