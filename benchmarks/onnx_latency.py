"""ONNX Runtime CPU latency of fused normdense models against the same architecture with BatchNorm folded into
its convs, and with GroupNorm (+ WS, fused).

    python benchmarks/onnx_latency.py                        # 2 threads, 512x512, 15 repeats
    python benchmarks/onnx_latency.py --threads 1 --size 320 320 --repeats 5 --out /tmp/o.json   # smoke

Models: the demo DeepLabV3 (configs/demo/deeplabv3_r18-d8_bcn-ws_toy-voc.py: half-width ResNet-18 V1c,
output stride 8, ASPP; exported as image -> logits at the input size) and mmdet's ResNet-50 backbone (four
stages' features). Variants of each:

* ``BN (folded)``: BatchNorm2d with plain convs; the TorchScript exporter folds eval BN into the convs (the
  script checks that no BatchNormalization node is left): the inference cost of a BN model;
* ``GN+WS (fused)``: GroupNorm with WSConv2d, after ``normdense.deploy.fuse`` (WS baked into the convs);
* ``BCN+WS (fused)``: estimate-mode BCN with WSConv2d after ``fuse`` (the first stage folded into the convs,
  the channel stage an nn.GroupNorm);
* ``GN+PN (fused)`` (ResNet-50 only; mmseg's DeepLabV3 puts its ReLU after the norm): the PNResNet backbone
  after ``fuse`` (GroupNorm, phi, per-channel affine).

Every variant is exported with the TorchScript exporter (``--opset``, default 17) and run in one ONNX Runtime
session (CPUExecutionProvider, all graph optimizations, ``--threads`` intra-op threads) on the same random
image, interleaved (benchmarks/_timing.py), medians and IQR. Statistics and affines are random non-trivial
values (latency does not depend on them). Target: BCN+WS (fused) <= 1.05x BN (folded); GN-based models are
compared with GN+WS too. Writes benchmarks/results/onnx_latency.json.
"""
import argparse
import collections
import json
import os
import os.path as osp
import sys
import tempfile

import torch
import torch.nn as nn

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks._timing import conditions, interleaved_times, median_iqr  # noqa: E402

DEMO_SEG = osp.join(ROOT, 'configs', 'demo', 'deeplabv3_r18-d8_bcn-ws_toy-voc.py')
TARGET = 1.05  # BCN+WS (fused) / BN (folded)


def randomize_(model, seed=0):
    """Random non-trivial eval statistics and affines of every norm (as a trained model has)."""
    from normdense.layers.bcn import BatchChannelNorm2d
    from normdense.layers.proxy_norm import GroupProxyNorm
    g = torch.Generator().manual_seed(seed)

    def uniform_(t, lo, hi):
        t.copy_(torch.rand(t.shape, generator=g) * (hi - lo) + lo)

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (BatchChannelNorm2d, nn.BatchNorm2d)):
                uniform_(m.running_mean, -0.5, 0.5)
                uniform_(m.running_var, 0.3, 2.0)
            if isinstance(m, BatchChannelNorm2d):
                uniform_(m.batch_weight, 0.5, 1.5)
                uniform_(m.batch_bias, -0.3, 0.3)
            if isinstance(m, GroupProxyNorm):
                uniform_(m.proxy_beta, -0.3, 0.3)
                uniform_(m.proxy_gamma, -0.3, 0.3)
            if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)) and m.weight is not None:
                uniform_(m.weight, 0.5, 1.5)
                uniform_(m.bias, -0.3, 0.3)
    return model


def deeplabv3_variants():
    from mmengine.config import Config

    from normdense.deploy import build_model_from_config
    from normdense.deploy.onnx import SegmentorLogits

    def build(norm_cfg, conv_cfg):
        cfg = Config.fromfile(DEMO_SEG)
        for part in (cfg.model.backbone, cfg.model.decode_head):
            part.norm_cfg, part.conv_cfg = norm_cfg, conv_cfg
        cfg.model.backbone.init_cfg = None
        return SegmentorLogits(build_model_from_config(cfg))

    ws = dict(type='WSConv2d')
    return {
        'BN (folded)': lambda: build(dict(type='BN', requires_grad=True), None),
        'GN+WS (fused)': lambda: build(dict(type='GN', num_groups=16, requires_grad=True), ws),
        'BCN+WS (fused)': lambda: build(dict(type='BCN', num_groups=16, mode='estimate'), ws),
    }


def resnet50_variants():
    from mmdet.models.backbones import ResNet

    import normdense  # noqa: F401  (registers the layers and PNResNet)
    from mmdet.registry import MODELS

    def build(norm_cfg, conv_cfg, type_='ResNet'):
        if type_ == 'ResNet':
            return ResNet(depth=50, norm_cfg=norm_cfg, conv_cfg=conv_cfg, norm_eval=False)
        return MODELS.build(dict(type=type_, depth=50, norm_cfg=norm_cfg, conv_cfg=conv_cfg, norm_eval=False))

    ws = dict(type='WSConv2d')
    return {
        'BN (folded)': lambda: build(dict(type='BN', requires_grad=True), None),
        'GN+WS (fused)': lambda: build(dict(type='GN', num_groups=32, requires_grad=True), ws),
        'BCN+WS (fused)': lambda: build(dict(type='BCN', num_groups=32, mode='estimate'), ws),
        'GN+PN (fused)': lambda: build(dict(type='GNPN', num_groups=32), None, 'PNResNet'),
    }


def cpu_model():
    try:
        with open('/proc/cpuinfo') as f:
            return next((line.split(':', 1)[1].strip() for line in f if line.startswith('model name')), 'unknown')
    except OSError:
        return 'unknown'


def node_counts(path):
    import onnx
    return dict(collections.Counter(n.op_type for n in onnx.load(path).graph.node).most_common())


def session(path, threads):
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    return ort.InferenceSession(path, opts, providers=['CPUExecutionProvider'])


def run_model(name, variants, x, args, tmp):
    from normdense.deploy import fuse
    from normdense.deploy.onnx import export_and_check
    sessions, info = {}, {}
    for variant, make in variants.items():
        torch.manual_seed(0)
        model = randomize_(make())
        model.eval()  # (mmdet's ResNet.train returns None)
        fuse(model)
        path = osp.join(tmp, f'{name}_{len(sessions)}.onnx')
        _, diff = export_and_check(model, (x, ), path, opset=args.opset)
        counts = node_counts(path)
        if variant.startswith('BN') and counts.get('BatchNormalization'):
            raise SystemExit(f'{name} {variant}: the exporter left {counts["BatchNormalization"]} BatchNormalization '
                             'nodes unfolded')
        sessions[variant] = session(path, args.threads)
        info[variant] = dict(nodes=counts, ort_difference=diff, onnx_bytes=os.path.getsize(path))
    feed = x.numpy()
    fns = {v: (lambda s=s: s.run(None, {s.get_inputs()[0].name: feed})) for v, s in sessions.items()}
    times = interleaved_times(fns, args.repeats, warmup=2)
    base, gn = median_iqr(times['BN (folded)'])[0], median_iqr(times['GN+WS (fused)'])[0]
    rows = {}
    for v in sessions:
        med, iqr = median_iqr(times[v])
        rows[v] = dict(median_ms=med * 1e3, iqr_ms=iqr * 1e3, vs_bn=med / base, vs_gn_ws=med / gn, **info[v])
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument('--size', type=int, nargs=2, default=(512, 512), metavar=('H', 'W'))
    parser.add_argument('--repeats', type=int, default=15)
    parser.add_argument('--opset', type=int, default=17)
    parser.add_argument('--models', nargs='+', default=['deeplabv3-demo', 'resnet50'],
                        choices=['deeplabv3-demo', 'resnet50'])
    parser.add_argument('--out', default=osp.join(ROOT, 'benchmarks', 'results', 'onnx_latency.json'))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import onnxruntime
    cond = dict(conditions(args.threads), cpu_model=cpu_model(), onnxruntime=onnxruntime.__version__,
                opset=args.opset, size=list(args.size), repeats=args.repeats)
    print(json.dumps(cond))
    x = torch.randn(1, 3, *args.size, generator=torch.Generator().manual_seed(0))
    builders = {'deeplabv3-demo': deeplabv3_variants, 'resnet50': resnet50_variants}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            results[name] = run_model(name, builders[name](), x, args, tmp)
            print(f'\n{name}, ONNX Runtime CPU, {args.threads} threads, 1x3x{args.size[0]}x{args.size[1]}')
            print(f'{"variant":<16}{"median ms":>11}{"IQR":>8}{"vs BN":>8}{"vs GN+WS":>10}  ORT diff  norm nodes')
            for v, r in results[name].items():
                norms = {k: n for k, n in r['nodes'].items() if 'Norm' in k}
                print(f'{v:<16}{r["median_ms"]:>11.1f}{r["iqr_ms"]:>8.1f}{r["vs_bn"]:>7.2f}x{r["vs_gn_ws"]:>9.2f}x'
                      f'  {r["ort_difference"]:.1e}  {norms}')
            ratio = results[name]['BCN+WS (fused)']['vs_bn']
            print(f'target BCN+WS (fused) <= {TARGET}x BN (folded): {ratio:.2f}x '
                  f'{"met" if ratio <= TARGET else "NOT met"}')
    os.makedirs(osp.dirname(osp.abspath(args.out)), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(dict(conditions=cond, results=results, target=TARGET), f, indent=1)
    print(f'\nwrote {args.out}')


if __name__ == '__main__':
    main()
