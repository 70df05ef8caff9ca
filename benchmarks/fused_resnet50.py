"""Inference latency of a fused WS + BCN ResNet-50 against a frozen-BN ResNet-50 (the README's folding
target: fused <= 1.05x the frozen-BN baseline), eval mode, same input, interleaved.

    python benchmarks/fused_resnet50.py                       # 1 thread, one 3x512x512 image, 10 repeats
    python benchmarks/fused_resnet50.py --size 320 320 --repeats 15

Four mmdet ``ResNet(depth=50)`` backbones (4 stages, all outputs, pytorch style), timed side by side,
interleaved (benchmarks/_timing.py), medians:

* ``WS+BCN fused``: WSConv2d convs + estimate-mode BCN (32 groups) with random non-trivial estimates and
  affines (as a trained model would have), after ``normdense.deploy.fuse``: every conv -> BCN pair folds
  BCN's first stage into the conv; BCN's channel stage (a per-sample group norm, which depends on the
  sample) stays as an ``nn.GroupNorm`` after every conv.
* ``WS+BCN unfused``: the same model before ``fuse`` (eval mode), for reference.
* ``frozen BN`` (the target's baseline): plain convs + ``BN`` with ``requires_grad=False`` and
  ``norm_eval=True``, as mmdet's detectors configure an ImageNet-pretrained backbone; at inference each
  BN is a per-channel affine with its running statistics, not folded (mmdet does not fold it).
* ``frozen BN folded``: the same with every BN folded into its conv
  (``torch.nn.utils.fusion.fuse_conv_bn_eval``): convs only, the lower bound of any norm.

Prints and writes (benchmarks/results/fused_resnet50.json) the ratios fused / frozen BN (PASS/FAIL
against <= 1.05) and fused / frozen BN folded, and the agreement of fused vs unfused outputs.
"""
import argparse
import copy
import json
import os
import os.path as osp
import sys

import torch
import torch.nn as nn

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks._timing import conditions, interleaved_times, median_iqr  # noqa: E402
from benchmarks.fuse_latency import randomize_norms_  # noqa: E402

TARGET = 1.05


def resnet50(**kwargs):
    from mmdet.models.backbones import ResNet
    return ResNet(depth=50, num_stages=4, out_indices=(0, 1, 2, 3), style='pytorch', **kwargs)


def fold_bn_(module):
    """Fold every eval-mode BatchNorm2d of ``module`` into the conv before it, at the conv -> norm
    adjacencies ``normdense.deploy.fuse`` knows (mmdet ResNet stem and blocks, downsample Sequentials).
    Returns the number of folded pairs."""
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    from normdense.deploy.fuse import _conv_norm_pairs
    n = 0
    for conv_name, bn_name in _conv_norm_pairs(module):
        conv, bn = module._modules[conv_name], module._modules[bn_name]
        if type(conv) is nn.Conv2d and isinstance(bn, nn.BatchNorm2d):
            setattr(module, conv_name, fuse_conv_bn_eval(conv, bn))
            setattr(module, bn_name, nn.Identity())
            n += 1
    for child in module.children():
        n += fold_bn_(child)
    return n


def max_rel_diff(ref, out):
    return max(float((o - r).abs().max() / r.abs().max()) for r, o in zip(ref, out))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--size', type=int, nargs=2, default=[512, 512], metavar=('H', 'W'))
    parser.add_argument('--repeats', type=int, default=10)
    parser.add_argument('--out', default=osp.join(ROOT, 'benchmarks', 'results', 'fused_resnet50.json'))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import normdense  # noqa: F401  (registers WSConv2d and BCN)
    from normdense.deploy import fuse

    torch.manual_seed(0)
    bcn = randomize_norms_(resnet50(conv_cfg=dict(type='WSConv2d'), norm_cfg=dict(type='BCN', num_groups=32),
                                    norm_eval=False))
    bcn.eval()  # (mmdet's ResNet.train returns None: no chaining)
    stats = {}
    fused = fuse(copy.deepcopy(bcn), stats=stats)
    torch.manual_seed(0)
    frozen = randomize_norms_(resnet50(norm_cfg=dict(type='BN', requires_grad=False), norm_eval=True))
    frozen.eval()
    folded = copy.deepcopy(frozen)
    n_bn_folded = fold_bn_(folded)
    models = {'WS+BCN fused': fused, 'WS+BCN unfused': bcn, 'frozen BN': frozen, 'frozen BN folded': folded}
    layer_counts = {n: {t: sum(type(m).__name__ == t for m in mdl.modules())
                        for t in ('Conv2d', 'WSConv2d', 'BatchChannelNorm2d', 'GroupNorm', 'BatchNorm2d')}
                    for n, mdl in models.items()}

    x = torch.randn(1, 3, *args.size)
    with torch.no_grad():
        fused_diff = max_rel_diff(bcn(x), fused(x))
        folded_diff = max_rel_diff(frozen(x), folded(x))

    def run(m):
        def step():
            with torch.no_grad():
                m(x)
        return step

    cond = conditions(args.threads)
    print('conditions:', json.dumps(cond))
    times = interleaved_times({n: run(m) for n, m in models.items()}, args.repeats, warmup=2)
    rows = {n: dict(zip(('median_ms', 'iqr_ms'), (v * 1e3 for v in median_iqr(t)))) for n, t in times.items()}
    fused_ms = rows['WS+BCN fused']['median_ms']
    ratio = fused_ms / rows['frozen BN']['median_ms']
    ratio_folded = fused_ms / rows['frozen BN folded']['median_ms']
    speedup = rows['WS+BCN unfused']['median_ms'] / fused_ms
    print(f'\nmmdet ResNet-50 backbone (4 stages, all outputs), one 3x{args.size[0]}x{args.size[1]} image, eval, '
          f'no_grad, {args.threads} thread(s), {args.repeats} interleaved repeats')
    print(f'fuse: {stats}; BN folded (baseline): {n_bn_folded}')
    print(f'layers per model: {json.dumps(layer_counts)}')
    print(f'{"":18s} {"median ms":>10s} {"IQR ms":>8s}')
    for n, r in rows.items():
        print(f'{n:18s} {r["median_ms"]:10.1f} {r["iqr_ms"]:8.1f}')
    verdict = 'PASS' if ratio <= TARGET else 'FAIL'
    verdict_folded = 'PASS' if ratio_folded <= TARGET else 'FAIL'
    print(f'{verdict}  fused WS+BCN / frozen-BN ResNet-50 = {ratio:.3f} (target <= {TARGET})')
    print(f'{verdict_folded}  fused WS+BCN / frozen-BN ResNet-50 with BN folded into the convs = {ratio_folded:.3f} '
          f'(same bound, stricter baseline)')
    print(f'fused vs unfused WS+BCN: {speedup:.2f}x faster; max |fused - unfused| / max |unfused| over the 4 '
          f'outputs: {fused_diff:.1e}; BN folded vs not: {folded_diff:.1e}')
    result = dict(conditions=cond, image_size=args.size, repeats=args.repeats, threads=args.threads,
                  fuse_stats=stats, bn_folded=n_bn_folded, layer_counts=layer_counts, rows=rows,
                  ratio_fused_vs_frozen_bn=ratio, target=TARGET, passed=ratio <= TARGET,
                  ratio_fused_vs_frozen_bn_folded=ratio_folded, passed_vs_folded=ratio_folded <= TARGET,
                  speedup_fused_vs_unfused=speedup, fused_rel_diff=fused_diff, bn_folded_rel_diff=folded_diff,
                  conditions_end=conditions(args.threads))
    os.makedirs(osp.dirname(args.out), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(result, f, indent=1)
    print(f'wrote {args.out}')
    return result


if __name__ == '__main__':
    main()
