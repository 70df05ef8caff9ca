"""One-image Mask R-CNN training step per normalization variant, against GN and mmcv's ConvWS + GN.

    python benchmarks/train_step.py                          # 1 thread, one 320x320 image, 7 repeats
    python benchmarks/train_step.py --threads 2 --size 512 512 --repeats 11

The model is the small Mask R-CNN of tests/mm_models.py (ResNet-18, 64-channel FPN and heads, 32 sampled
RoIs, the layers in backbone, FPN, 4conv1fc box head and mask head; GN+PN: PNResNet backbone with the
rest GN, as the project's configs do; EquiNorm: EquiConv2d + ChannelAffine backbone on [0, 1] inputs,
rest GN, as tests/layers/test_equinorm.py). A step is ``model.train_step`` (data preprocessing, forward,
backward, SGD update). All variants live in memory and are timed interleaved; medians and IQR. Also
counts the bytes autograd saves for backward during one step (activation memory; CPU torch has no
allocator peak counter). Writes benchmarks/results/train_step.json.
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


def variants():
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--size', type=int, nargs=2, default=[320, 320], metavar=('H', 'W'))
    parser.add_argument('--repeats', type=int, default=7)
    parser.add_argument('--lr', type=float, default=0.002)
    parser.add_argument('--out', default=osp.join(ROOT, 'benchmarks', 'results', 'train_step.json'))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from mmdet.testing import demo_mm_inputs
    from mmengine.logging import MMLogger
    from mmengine.optim import OptimWrapper

    from normdense.layers.bcn import set_update_rate
    from tests.mm_models import build_detector
    MMLogger.get_current_instance().setLevel('ERROR')  # init_weights logs every parameter

    torch.manual_seed(0)
    data = demo_mm_inputs(1, image_shapes=[(3, *args.size)], num_items=[3], num_classes=3, with_mask=True)
    models, steps = {}, {}
    for name, cfg in variants().items():
        torch.manual_seed(0)
        model = build_detector(cfg).train()
        set_update_rate(model, args.lr)  # what BCNRateHook does (BCN / Unitization estimates)
        optim = OptimWrapper(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9))
        models[name] = (model, optim)

        def step(model=model, optim=optim):
            torch.manual_seed(0)  # same RPN / RoI sampling in every variant and repeat
            model.train_step(copy.deepcopy(data), optim)
        steps[name] = step
    cond = conditions(args.threads)
    print('conditions:', json.dumps(cond))
    times = interleaved_times(steps, args.repeats, warmup=1)
    rows = {}
    for name, (model, optim) in models.items():
        med, iqr = median_iqr(times[name])
        saved = saved_activation_bytes(lambda: steps[name](), list(model.parameters()))
        rows[name] = dict(median_ms=med * 1e3, iqr_ms=iqr * 1e3, saved_MB=saved / 2**20)
    ref, ws_ref = rows['GN'], rows['mmcv ConvWS + GN']
    print(f'\nMask R-CNN R-18 FPN-64 training step (train_step: forward, backward, SGD), one '
          f'{args.size[0]}x{args.size[1]} image, {args.threads} thread(s), {args.repeats} interleaved repeats')
    print(f'{"variant":28s} {"median ms":>10s} {"IQR ms":>8s} {"/ GN":>6s} {"/ ConvWS+GN":>12s} {"saved MB":>9s} '
          f'{"mem / GN":>9s}')
    for name, r in rows.items():
        r['time_vs_gn'] = r['median_ms'] / ref['median_ms']
        r['time_vs_mmcv_ws_gn'] = r['median_ms'] / ws_ref['median_ms']
        r['mem_vs_gn'] = r['saved_MB'] / ref['saved_MB']
        print(f'{name:28s} {r["median_ms"]:10.0f} {r["iqr_ms"]:8.0f} {r["time_vs_gn"]:6.2f} '
              f'{r["time_vs_mmcv_ws_gn"]:12.2f} {r["saved_MB"]:9.1f} {r["mem_vs_gn"]:9.2f}')
    result = dict(conditions=cond, conditions_end=conditions(args.threads), image_size=args.size,
                  repeats=args.repeats, rows=rows)
    os.makedirs(osp.dirname(args.out), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(result, f, indent=1)
    print(f'wrote {args.out}')


if __name__ == '__main__':
    main()
