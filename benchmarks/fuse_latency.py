"""Inference latency of a Mask R-CNN (WS convs + estimate-mode BCN, the small model of tests/mm_models.py:
ResNet-18, 64-channel FPN and heads) before and after ``normdense.deploy.fuse``, eval mode, same input.

    python benchmarks/fuse_latency.py                       # 1 thread, one 320x320 image, 15 repeats
    python benchmarks/fuse_latency.py --threads 2 --size 512 512

Times ``model.predict`` (backbone, FPN, RPN, RoI box + mask heads, post-processing) and, separately,
``extract_feat`` (backbone + FPN, where the fused layers are), interleaved, medians. BCN statistics and
affines are set to random non-trivial values (as a trained model would have; the latency does not
depend on the values). Also prints the max abs difference of the outputs. Writes
benchmarks/results/fuse_latency.json.
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


def randomize_norms_(model, seed=0):
    """Non-trivial eval statistics and affines of every BCN and BatchNorm2d, as a trained model would have
    (the latency does not depend on them; the output checks do). Returns the model."""
    from normdense.layers.bcn import BatchChannelNorm2d
    g = torch.Generator().manual_seed(seed)

    def uniform_(t, lo, hi):
        t.copy_(torch.rand(t.shape, generator=g) * (hi - lo) + lo)

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, BatchChannelNorm2d):
                weights, biases = (m.batch_weight, m.weight), (m.batch_bias, m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                weights, biases = (m.weight, ), (m.bias, )
            else:
                continue
            uniform_(m.running_mean, -0.5, 0.5)
            uniform_(m.running_var, 0.3, 2.0)
            for p in weights:
                uniform_(p, 0.5, 1.5)
            for p in biases:
                uniform_(p, -0.3, 0.3)
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--size', type=int, nargs=2, default=[320, 320], metavar=('H', 'W'))
    parser.add_argument('--repeats', type=int, default=15)
    parser.add_argument('--out', default=osp.join(ROOT, 'benchmarks', 'results', 'fuse_latency.json'))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from mmdet.testing import demo_mm_inputs

    from normdense.deploy import fuse
    from tests.mm_models import build_detector, mask_rcnn_cfg
    torch.manual_seed(0)
    model = build_detector(mask_rcnn_cfg(conv_cfg=dict(type='WSConv2d'), norm_cfg=dict(type='BCN', num_groups=16)))
    randomize_norms_(model)
    model.eval()
    stats = {}
    fused = fuse(copy.deepcopy(model), stats=stats)
    data = demo_mm_inputs(1, image_shapes=[(3, *args.size)], num_items=[3], num_classes=3, with_mask=True)
    data = model.data_preprocessor(data, False)
    inputs, samples = data['inputs'], data['data_samples']

    with torch.no_grad():
        feats_ref, feats_out = model.extract_feat(inputs), fused.extract_feat(inputs)
        feat_diff = max(float((o - r).abs().max() / r.abs().max()) for r, o in zip(feats_ref, feats_out))
        p_ref = model.predict(inputs, copy.deepcopy(samples))[0].pred_instances
        p_out = fused.predict(inputs, copy.deepcopy(samples))[0].pred_instances
    same_count = len(p_ref) == len(p_out)
    score_diff = float((p_ref.scores - p_out.scores).abs().max()) if same_count and len(p_ref) else None

    def predict(m):
        def run():
            with torch.no_grad():
                m.predict(inputs, copy.deepcopy(samples))
        return run

    def features(m):
        def run():
            with torch.no_grad():
                m.extract_feat(inputs)
        return run

    cond = conditions(args.threads)
    print('conditions:', json.dumps(cond))
    times = interleaved_times({'unfused predict': predict(model), 'fused predict': predict(fused),
                               'unfused extract_feat': features(model), 'fused extract_feat': features(fused)},
                              args.repeats)
    rows = {n: dict(zip(('median_ms', 'iqr_ms'), (v * 1e3 for v in median_iqr(t)))) for n, t in times.items()}
    print(f'\nMask R-CNN R-18 FPN-64 (WS + BCN estimate), one {args.size[0]}x{args.size[1]} image, eval, '
          f'{args.threads} thread(s), {args.repeats} interleaved repeats')
    print(f'fuse: {stats}')
    print(f'{"":22s} {"median ms":>10s} {"IQR ms":>8s}')
    for n, r in rows.items():
        print(f'{n:22s} {r["median_ms"]:10.1f} {r["iqr_ms"]:8.1f}')
    sp = rows['unfused predict']['median_ms'] / rows['fused predict']['median_ms']
    sf = rows['unfused extract_feat']['median_ms'] / rows['fused extract_feat']['median_ms']
    print(f'speed-up (unfused / fused): predict {sp:.2f}x, backbone+FPN {sf:.2f}x')
    print(f'max |fused - unfused| / max|unfused| over FPN levels: {feat_diff:.2e}; '
          f'same number of detections: {same_count}; max score diff: {score_diff}')
    result = dict(conditions=cond, image_size=args.size, repeats=args.repeats, fuse_stats=stats, rows=rows,
                  speedup_predict=sp, speedup_extract_feat=sf, feature_rel_diff=feat_diff,
                  same_detection_count=same_count, max_score_diff=score_diff,
                  conditions_end=conditions(args.threads))
    os.makedirs(osp.dirname(args.out), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(result, f, indent=1)
    print(f'wrote {args.out}')


if __name__ == '__main__':
    main()
