"""GPU benchmark: every normdense layer against nn.GroupNorm and nn.BatchNorm2d at FPN shapes, fp32 and
fp16 autocast, forward and forward+backward in training mode; IterNorm (64 channels/group, T=5) against
eigh-based ZCA whitening of the same groups; peak memory per layer.

    python benchmarks/gpu.py                       # on a CUDA machine: writes benchmarks/results/gpu_<device>.json
    python benchmarks/gpu.py --device cpu --quick  # no GPU: the whole code path on tiny shapes (no measurement)

Timing: each call synchronized before and after (host clock), so kernel-launch overhead is counted as it
is in a training step; warm-up first, candidates of one setting interleaved round by round, medians
(benchmarks/_timing.py ``device_times``). ``ops``: non-view ATen operators per forward + backward (each at
least one kernel launch on a GPU). Peak memory: ``torch.cuda.max_memory_allocated`` during one
forward+backward minus what was allocated before it (input, parameters and the incoming gradient
excluded). Targets (docs/gpu.md): IterNorm >= 5x faster than ZCA; BCN, GN+PN and Unitization fwd+bwd
<= 1.3x nn.GroupNorm.
"""
import argparse
import json
import os
import os.path as osp
import re
import sys

import torch
import torch.nn as nn

sys.path.insert(0, osp.join(osp.dirname(osp.abspath(__file__)), '..'))
from benchmarks._timing import conditions, count_ops, device_times, median_iqr  # noqa: E402
from benchmarks.layers import RECOMPUTE, norm_candidates  # noqa: E402

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
# (N, C, H, W): FPN levels of detection inputs (P3 of a 512 px crop, P2 of 400x672, P2 of 800x1344)
SHAPES = [(2, 256, 64, 64), (1, 256, 100, 168), (2, 256, 200, 336)]
QUICK_SHAPES = [(1, 64, 8, 8)]
GN = 'nn.GroupNorm(32)'
TARGET_LAYERS = ('BCN estimate', 'BCN batch', 'GNPN (GN+PN)', 'Unitization batch', 'Unitization estimate')


def candidates(c):
    """The norm layers of benchmarks/layers.py (recompute rows and the channel affine left out) and the
    two conv layers, each against its plain counterpart."""
    from normdense.layers.equinorm import EquiConv2d
    from normdense.layers.ws import WSConv2d
    cands = {n: f for n, f in norm_candidates(c).items() if not n.endswith(RECOMPUTE) and n != 'ChannelAffine'}
    cands.update({'nn.Conv2d 3x3': lambda: nn.Conv2d(c, c, 3, padding=1),
                  'WSConv2d 3x3': lambda: WSConv2d(c, c, 3, padding=1),
                  'EquiConv2d 3x3': lambda: EquiConv2d(c, c, 3, padding=1)})
    return cands


def make_call(module, x, grad, backward, autocast):
    def call():
        x.grad = None
        for p in module.parameters():
            p.grad = None
        with autocast:
            out = module(x)
        if backward:
            out.backward(grad.to(out.dtype))
    return call


def peak_bytes(call, device):
    if device == 'cpu':
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def bench_setting(shape, device, precision, repeats, warmup):
    n, c, h, w = shape
    torch.manual_seed(0)
    x = torch.randn(shape, device=device).relu_().requires_grad_(True)  # EquiNorm assumes post-ReLU inputs
    grad = torch.randn(shape, device=device)
    dtype = torch.float16 if device == 'cuda' else torch.bfloat16  # CPU autocast has no fp16 convs
    autocast = torch.autocast(device, dtype=dtype, enabled=precision == 'amp')
    modules = {name: f().to(device).train() for name, f in candidates(c).items()}
    rows = {name: {} for name in modules}
    for mode, backward in (('fwd', False), ('fwd+bwd', True)):
        calls = {name: make_call(m, x, grad, backward, autocast) for name, m in modules.items()}
        times = device_times(calls, repeats, warmup, device)
        for name in modules:
            med, iqr = median_iqr(times[name])
            rows[name][f'{mode}_ms'] = med * 1e3
            rows[name][f'{mode}_iqr_ms'] = iqr * 1e3
            if backward:
                rows[name]['peak_bytes'] = peak_bytes(calls[name], device)
                rows[name]['ops'] = count_ops(calls[name])
    for name, row in rows.items():
        for mode in ('fwd', 'fwd+bwd'):
            row[f'{mode}_vs_gn'] = row[f'{mode}_ms'] / rows[GN][f'{mode}_ms']
    return rows


def bench_whitening(shape, device, repeats, warmup, group=64):
    """Only what differs between IterNorm and ZCA: the whitening matrix of the same centred groups
    (Newton T=5 vs torch.linalg.eigh), forward + backward, fp32."""
    from normdense.layers.iternorm import newton_whitening_matrix, zca_whitening_matrix
    n, c, h, w = shape
    torch.manual_seed(0)
    xc = torch.randn(c // group, group, n * h * w, device=device)
    xc = (xc - xc.mean(2, keepdim=True)).requires_grad_(True)
    g = torch.randn(c // group, group, group, device=device)

    def call(fn):
        def step():
            xc.grad = None
            fn(xc).backward(g)
        return step
    times = device_times({'newton T5': call(lambda t: newton_whitening_matrix(t, 1e-5, 5)),
                          'zca eigh': call(lambda t: zca_whitening_matrix(t, 1e-5))}, repeats, warmup, device)
    out = {k: dict(zip(('ms', 'iqr_ms'), (v * 1e3 for v in median_iqr(t)))) for k, t in times.items()}
    out['zca_over_newton'] = out['zca eigh']['ms'] / out['newton T5']['ms']
    return out


def check_targets(results):
    targets = []
    for key, s in results['settings'].items():
        fp32 = s['fp32']
        r = fp32['ZCA g64 (eigh)']['fwd+bwd_ms'] / fp32['IterNorm g64 T5']['fwd+bwd_ms']
        targets.append(dict(target='IterNorm layer >= 5x faster than ZCA layer (fwd+bwd, fp32)', setting=key,
                            value=r, passed=r >= 5))
        r = s['whitening']['zca_over_newton']
        targets.append(dict(target='whitening matrix: Newton T5 >= 5x faster than eigh (fwd+bwd)', setting=key,
                            value=r, passed=r >= 5))
        for precision in ('fp32', 'amp'):
            for layer in TARGET_LAYERS:
                r = s[precision][layer]['fwd+bwd_vs_gn']
                targets.append(dict(target=f'{layer} fwd+bwd <= 1.3x nn.GroupNorm ({precision})', setting=key,
                                    value=r, passed=r <= 1.3))
    return targets


def slug(name):
    return re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--device', default='cuda', choices=('cuda', 'cpu'))
    parser.add_argument('--quick', action='store_true', help='tiny shapes, 3 repeats: checks the code path only')
    parser.add_argument('--repeats', type=int, default=None, help='timed rounds (default 30; 3 with --quick)')
    parser.add_argument('--warmup', type=int, default=None, help='untimed rounds first (default 5; 1 with --quick)')
    parser.add_argument('--out', default=None, help='JSON path (default benchmarks/results/gpu_<device>.json)')
    args = parser.parse_args(argv)
    if args.device == 'cuda' and not torch.cuda.is_available():
        sys.exit('benchmarks/gpu.py: no GPU (torch.cuda.is_available() is False): nothing measured; '
                 '--device cpu --quick runs the code path without measuring')
    repeats = args.repeats or (3 if args.quick else 30)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 5)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    device_name = torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'
    cond = dict(conditions(torch.get_num_threads()), device=device_name, quick=args.quick, repeats=repeats,
                warmup=warmup, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                note='synchronized per call (launch overhead counted), interleaved candidates, medians' if args.device == 'cuda' else
                'CPU code-path check only: not a GPU measurement')
    print('conditions:', json.dumps(cond))
    results = dict(conditions=cond, shapes=[list(s) for s in shapes], settings={})
    for shape in shapes:
        key = 'x'.join(map(str, shape))
        s = results['settings'][key] = {}
        for precision in ('fp32', 'amp'):
            s[precision] = bench_setting(shape, args.device, precision, repeats, warmup)
            print(f'\n{key} {precision}: {"layer":26s} {"fwd ms":>8s} {"fwd+bwd ms":>10s} {"vs GN":>6s} {"peak MB":>8s} '
                  f'{"ops":>5s}')
            for name, row in s[precision].items():
                peak = '-' if row['peak_bytes'] is None else f'{row["peak_bytes"] / 2**20:.1f}'
                print(f'  {name:34s} {row["fwd_ms"]:8.3f} {row["fwd+bwd_ms"]:10.3f} {row["fwd+bwd_vs_gn"]:6.2f} '
                      f'{peak:>8s} {row["ops"]:5d}')
        s['whitening'] = bench_whitening(shape, args.device, repeats, warmup)
        print(f'  whitening matrix fwd+bwd: ZCA / Newton T5 = {s["whitening"]["zca_over_newton"]:.2f}')
    results['targets'] = check_targets(results)
    for t in results['targets']:
        print(f'{"PASS" if t["passed"] else "FAIL"}  {t["target"]:60s} {t["setting"]:16s} {t["value"]:.2f}')
    out = args.out or osp.join(ROOT, 'benchmarks', 'results',
                               f'gpu_{slug(device_name)}{"_quick" if args.quick else ""}.json')
    os.makedirs(osp.dirname(osp.abspath(out)), exist_ok=True)
    with open(out, 'w') as f:
        json.dump(results, f, indent=1)
    print(f'wrote {out}')
    return results


if __name__ == '__main__':
    main()
