"""A whole detector's training step per normalization (issue 52): torchvision's Mask R-CNN R-50-FPN v2.

    python benchmarks/detector_step.py                      # a GPU: 2 images of 800x1216, bf16 autocast, 20 steps
    python benchmarks/detector_step.py --device cpu --size 96 128 --steps 1 --warmup 1 --out /tmp/d.json  # smoke

``maskrcnn_resnet50_fpn_v2`` (random weights, none downloaded) has BatchNorm2d in the backbone, the FPN, the RPN
head's convs, the box head's 4 convs and the mask head: about 70 norms, every one trainable. Each variant is that
model converted with :func:`normdense.model_convert.convert_model`:

* ``frozen BN``: every BatchNorm2d as torchvision's FrozenBatchNorm2d (a fixed affine: the floor);
* ``GN+WS``: GN(32) and WSConv2d for the convs that feed a norm (the baseline of the WS/BCN paper's detection);
* ``BCN+WS estimate``: BCN (estimate mode, the micro-batch mode, a fixed update rate) and WSConv2d;
* ``Unitization``: Unitization2d (batch mode), plain convs;
* ``IterNorm``: IterNorm (64 channels per group, T = 5), plain convs.

GN+PN holds the activation that follows it and cannot replace a norm in place; it is measured per layer
(benchmarks/gpu.py). A step is the model's losses under autocast, backward and an SGD step with momentum;
every variant samples the same anchors and RoIs (the same seed before each step). The variants are timed
interleaved, each step synchronized (benchmarks/_timing.py's ``device_times``): ms per step, median and IQR,
and the ratio to GN+WS and to frozen BN. Target (reported, not failed on): BCN+WS and Unitization <= 1.10x
GN+WS. The backend each converted layer takes is recorded (Triton on a GPU where it imports).

Runs with torch and torchvision alone (``NORMDENSE_LAYERS_ONLY=1`` is set where mmengine/mmcv are missing).
"""
import argparse
import importlib.util
import json
import os
import sys

if not all(importlib.util.find_spec(m) for m in ('mmengine', 'mmcv')):
    os.environ.setdefault('NORMDENSE_LAYERS_ONLY', '1')

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import device_times, median_iqr  # noqa: E402

TARGET = 1.10
NORM_TYPES = ('BatchNorm2d', 'FrozenBatchNorm2d', 'GroupNorm', 'BatchChannelNorm2d', 'Unitization2d', 'IterNorm')
VARIANTS = {
    'frozen BN': None,
    'GN+WS': (dict(type='GN', num_groups=32), 'WSConv2d'),
    'BCN+WS estimate': (dict(type='BCN', mode='estimate', update_rate=0.01), 'WSConv2d'),
    'Unitization': (dict(type='Unitization'), None),
    'IterNorm': (dict(type='IterNorm'), None),
}


def _freeze_bn(model):
    from torchvision.ops.misc import FrozenBatchNorm2d
    for name, m in list(model.named_modules()):
        for child_name, child in list(m.named_children()):
            if type(child) is nn.BatchNorm2d:
                frozen = FrozenBatchNorm2d(child.num_features, eps=child.eps)
                for k in ('weight', 'bias', 'running_mean', 'running_var'):
                    getattr(frozen, k).copy_(getattr(child, k).detach())
                setattr(m, child_name, frozen.to(child.weight.device))
    return model


def build(variant, size, device, rois=512):
    from torchvision.models.detection import maskrcnn_resnet50_fpn_v2
    from normdense.model_convert import convert_model
    torch.manual_seed(0)
    # torchvision's sampling (512 RoIs of 2000 proposals per image) unless --rois asks for fewer (a CPU smoke run)
    fewer = {} if rois == 512 else dict(box_batch_size_per_image=rois, rpn_post_nms_top_n_train=4 * rois)
    model = maskrcnn_resnet50_fpn_v2(weights=None, weights_backbone=None, num_classes=91,
                                     min_size=min(size), max_size=max(size), **fewer)
    spec = VARIANTS[variant]
    model = _freeze_bn(model) if spec is None else convert_model(model, norm=spec[0], conv=spec[1], verbose=False)
    return model.to(device).train()


def batch(images, size, device):
    gen = torch.Generator().manual_seed(1)
    h, w = size
    imgs, targets = [], []
    for _ in range(images):
        imgs.append(torch.rand(3, h, w, generator=gen).to(device))
        xy = torch.rand(3, 2, generator=gen) * torch.tensor([w * 0.6, h * 0.6])
        wh = (torch.rand(3, 2, generator=gen) * 0.3 + 0.1) * torch.tensor([w, h])
        boxes = torch.cat([xy, xy + wh], 1)
        masks = torch.zeros(3, h, w, dtype=torch.uint8)
        for i, (x0, y0, x1, y1) in enumerate(boxes.round().long().tolist()):
            masks[i, y0:y1, x0:x1] = 1
        targets.append(dict(boxes=boxes.to(device), labels=torch.randint(1, 91, (3, ), generator=gen).to(device),
                            masks=masks.to(device)))
    return imgs, targets


def backends(model, device, dtype):
    """{backend name: number of the model's engine layers (BCN, GN+PN, Unitization) that take it}."""
    from normdense.kernels.backend import selected_backend
    from normdense.layers._statnorm import StatNorm2d
    seen = {}
    for m in model.modules():
        if isinstance(m, StatNorm2d):
            probe = torch.zeros(2, m.num_features if hasattr(m, 'num_features') else m.num_channels, 4, 4,
                                device=device, dtype=dtype)
            name = selected_backend(m, probe)
            seen[name] = seen.get(name, 0) + 1
    return seen


def step_fn(model, imgs, targets, device, amp):
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step():
        torch.manual_seed(0)  # the same anchors and RoIs sampled in every variant and step
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=amp):
            losses = model(imgs, targets)
        loss = sum(losses.values())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not torch.isfinite(loss):
            raise FloatingPointError(f'loss {float(loss)}: not finite')
    return step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--device', default='cuda', choices=('cuda', 'cpu'))
    p.add_argument('--size', type=int, nargs=2, default=(800, 1216), metavar=('H', 'W'))
    p.add_argument('--images', type=int, default=2)
    p.add_argument('--steps', type=int, default=20, help='timed steps per variant (interleaved)')
    p.add_argument('--warmup', type=int, default=3, help='untimed steps per variant first (kernels compile)')
    p.add_argument('--rois', type=int, default=512, help='RoIs sampled per image for the heads (torchvision: 512)')
    p.add_argument('--no-amp', action='store_true', help='float32 instead of bf16 autocast')
    p.add_argument('--variants', default=','.join(VARIANTS), help=f'comma-separated (default all: {list(VARIANTS)})')
    p.add_argument('--out', default=None, help='JSON path (default benchmarks/results/detector_step_<device>.json)')
    p.add_argument('--md', default=None, help='markdown path (default: the JSON path with .md)')
    args = p.parse_args(argv)
    names = [v.strip() for v in args.variants.split(',') if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        p.error(f'unknown variants {unknown}; choose from {list(VARIANTS)}')
    if args.device == 'cuda' and not torch.cuda.is_available():
        sys.exit('detector_step.py: no GPU (torch.cuda.is_available() is False); --device cpu runs the code path')
    if importlib.util.find_spec('torchvision') is None:
        sys.exit('detector_step.py: needs torchvision (pip install torchvision)')
    if args.device == 'cuda' and os.environ.get('TRITON_INTERPRET') == '1':
        sys.exit('detector_step.py: TRITON_INTERPRET=1 is set: unset it so that the kernels run compiled')
    amp = not args.no_amp
    out = args.out or os.path.join(os.path.dirname(__file__), 'results', f'detector_step_{args.device}.json')
    md = args.md or os.path.splitext(out)[0] + '.md'
    imgs, targets = batch(args.images, tuple(args.size), args.device)
    models = {v: build(v, tuple(args.size), args.device, args.rois) for v in names}
    fns = {v: step_fn(m, imgs, targets, args.device, amp) for v, m in models.items()}
    dtype = torch.bfloat16 if amp else torch.float32
    taken = {v: backends(m, args.device, dtype) for v, m in models.items()}
    times = device_times(fns, args.steps, args.warmup, args.device)
    rows = {}
    for v in names:
        med, iqr = median_iqr(times[v])
        kinds = {}
        for m in models[v].modules():
            if type(m).__name__ in NORM_TYPES:
                kinds[type(m).__name__] = kinds.get(type(m).__name__, 0) + 1
        rows[v] = dict(ms=med * 1e3, iqr_ms=iqr * 1e3, backends=taken[v], norms=kinds,
                       ws_convs=sum(1 for m in models[v].modules() if type(m).__name__ == 'WSConv2d'))
    for v in names:
        for base in ('GN+WS', 'frozen BN'):
            if base in rows:
                rows[v][f'x_{base}'] = rows[v]['ms'] / rows[base]['ms']
    targets_met = {v: rows[v]['x_GN+WS'] <= TARGET for v in ('BCN+WS estimate', 'Unitization')
                   if v in rows and 'GN+WS' in rows}
    device_name = torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'
    result = dict(device=device_name, torch=torch.__version__, size=list(args.size), images=args.images, rois=args.rois,
                  amp='bf16' if amp else None, steps=args.steps, warmup=args.warmup, rows=rows,
                  target=f'BCN+WS estimate and Unitization <= {TARGET}x GN+WS', targets_met=targets_met)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    json.dump(result, open(out, 'w'), indent=1)
    lines = [f'Mask R-CNN R-50-FPN v2 (torchvision) training step, {args.images} x {args.size[0]}x{args.size[1]}, '
             f'{"bf16 autocast" if amp else "fp32"}, {device_name}, torch {torch.__version__}; median of '
             f'{args.steps} interleaved steps after {args.warmup} warm-up', '',
             '| variant | norms | ms / step (IQR) | x GN+WS | x frozen BN | engine backends |', '|---|---|---|---|---|---|']
    for v, r in rows.items():
        norms = ', '.join(f'{n} {k}' for k, n in r['norms'].items()) + (f", WSConv2d {r['ws_convs']}" if r['ws_convs'] else '')
        lines.append(f"| {v} | {norms} | {r['ms']:.1f} ({r['iqr_ms']:.1f}) | {r.get('x_GN+WS', float('nan')):.2f} "
                     f"| {r.get('x_frozen BN', float('nan')):.2f} | {r['backends'] or '-'} |")
    for v, ok in targets_met.items():
        lines.append(f"\n{'PASS' if ok else 'FAIL'} {v}: {rows[v]['x_GN+WS']:.2f}x GN+WS (target <= {TARGET})")
    open(md, 'w').write('\n'.join(lines) + '\n')
    print('\n'.join(lines))
    return result


if __name__ == '__main__':
    main()
