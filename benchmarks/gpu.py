"""GPU benchmark of the StatNorm engine's backends: nn.GroupNorm(32), nn.BatchNorm2d and each Triton-backed
layer (BCN estimate and batch, GN+PN relu, Unitization batch and estimate) with ``backend='aten'`` and
``backend='triton'``, training-mode forward and forward+backward at the FPN levels P2-P7 of two 800x1216 images
(2x256x200x304 .. 2x256x7x10) in bf16, fp16 and fp32; IterNorm (64 channels/group, T=5) against eigh-based ZCA
at P3 in fp32.

    python benchmarks/gpu.py                        # CUDA: benchmarks/results/gpu_<device>.json and .md
    python benchmarks/gpu.py --levels P2,P3 --dtypes bf16,fp32 --out R/benchmark.json --md R/benchmark.md
                                                    # what scripts/gpu_check.sh runs
    python benchmarks/gpu.py --device cpu --quick   # no GPU: the code path on a tiny shape (no measurement)

Timing: each call synchronized before and after (host clock, benchmarks/_timing.py ``device_times``), so the
launch overhead counts as it does in a training step; warm-up rounds first (Triton compiles there), the rows
of one (level, dtype) interleaved round by round, medians. Inputs are in the dtype (half inputs with float32
parameters, as a layer sees them under autocast); nn.GroupNorm is converted to the dtype (its CUDA kernel wants
the input's dtype for its parameters), the strictest baseline.

Bytes: the floor of a normalization layer is 3 passes over an activation-sized tensor forward (read x for the
statistics, read x and write y) and 5 backward (read x and dy for the sums, read them again and write dx):
``floor_bytes = 8 * numel * itemsize``. ``gbps`` = floor bytes / fwd+bwd time; ``floor_fraction`` = the time
the floor takes at the measured device-to-device copy bandwidth (read + write counted) / the fwd+bwd time.
Launches per fwd+bwd: kernels the GPU ran (torch.profiler; ATen ops + Triton launches on the CPU). Device time
(``device_ms``): the durations of those kernels, summed (torch.profiler's CUPTI records), apart from the host's:
at sizes where the host is the bottleneck the wall time is the host's, and device_ms is what the kernels take.
Host time per call (``host``): benchmarks/host.py's rows on the same device, N calls on a tiny tensor and one
synchronize (``--no-host`` skips them).

Targets (PASS/FAIL, in the JSON): at P2 and P3 in bf16, every Triton-backed layer with ``backend='triton'``:
fwd+bwd <= 1.2x nn.GroupNorm and >= 70 % of the byte floor; IterNorm >= 5x faster than ZCA. A row the build
cannot make (no ``backend`` option yet, no triton) is listed under ``unavailable`` and its targets FAIL.
"""
import argparse
import json
import os
import os.path as osp
import re
import sys
import time

if __name__ == '__main__':  # a torch-only GPU machine: the layers need no mmcv/mmengine (normdense/compat.py)
    import importlib.util
    if not all(importlib.util.find_spec(m) for m in ('mmengine', 'mmcv')):
        os.environ.setdefault('NORMDENSE_LAYERS_ONLY', '1')

import torch
import torch.nn as nn

sys.path.insert(0, osp.join(osp.dirname(osp.abspath(__file__)), '..'))
from benchmarks._launches import cuda_kernel_ms, launch_counts  # noqa: E402
from benchmarks._timing import conditions, device_times, median_iqr  # noqa: E402

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
LEVELS = {'P2': (2, 256, 200, 304), 'P3': (2, 256, 100, 152), 'P4': (2, 256, 50, 76), 'P5': (2, 256, 25, 38),
          'P6': (2, 256, 13, 19), 'P7': (2, 256, 7, 10)}
QUICK_LEVELS = {'tiny': (1, 64, 8, 8)}
DTYPES = {'bf16': torch.bfloat16, 'fp16': torch.float16, 'fp32': torch.float32}
QUICK_DTYPES = ('bf16', )
BACKENDS = ('aten', 'triton')
GN, BN = 'nn.GroupNorm(32)', 'nn.BatchNorm2d'
TARGET_LEVELS, TARGET_DTYPE = ('P2', 'P3'), 'bf16'
MAX_VS_GN, MIN_FLOOR_FRACTION, MIN_ZCA_OVER_ITERNORM = 1.2, 0.7, 5.0
FWD_PASSES, BWD_PASSES = 3, 5


def layer_factories(c):
    """The Triton-backed layers, each a function of its ``backend`` keyword."""
    from normdense.layers.bcn import BatchChannelNorm2d
    from normdense.layers.proxy_norm import GroupProxyNorm
    from normdense.layers.unitization import Unitization2d
    return {'BCN estimate': lambda **kw: BatchChannelNorm2d(c, 32, mode='estimate', update_rate=0.01, **kw),
            'BCN batch': lambda **kw: BatchChannelNorm2d(c, 32, mode='batch', **kw),
            'GN+PN relu': lambda **kw: GroupProxyNorm(c, 32, act='relu', **kw),
            'Unitization batch': lambda **kw: Unitization2d(c, **kw),
            'Unitization estimate': lambda **kw: Unitization2d(c, mode='estimate', update_rate=0.01, **kw)}


def triton_problem(device):
    """Why ``backend='triton'`` cannot run here, or None."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return 'triton is not installed'
    if device == 'cpu' and os.environ.get('TRITON_INTERPRET') != '1':
        return 'Triton runs CPU tensors only under TRITON_INTERPRET=1'
    return None


def build(factory, backend, x, device):
    """(module, None) or (None, why not)."""
    if backend == 'triton' and triton_problem(device):
        return None, triton_problem(device)
    try:
        module = factory(backend=backend)
    except TypeError as e:
        if 'backend' not in str(e):
            raise
        return None, 'the layer has no backend option in this build'
    module = module.to(device).train()
    try:
        from normdense.kernels.backend import selected_backend
    except ImportError:
        return module, None
    chosen = selected_backend(module, x)
    if chosen != backend:  # a row must measure what it is named after
        return None, f'selected_backend() gives {chosen!r} for backend={backend!r}'
    return module, None


def make_call(module, x, grad, backward):
    def call():
        x.grad = None
        for p in module.parameters():
            p.grad = None
        out = module(x)
        if backward:
            out.backward(grad)
    return call


def copy_bandwidth(device, nbytes):
    """Device-to-device copy bandwidth in bytes/s, read + write counted (median of 10 timed copies)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        if device == 'cuda':
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device == 'cuda':
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / median_iqr(times)[0]


def bench_setting(shape, dtype, device, repeats, warmup, copy_bw):
    torch.manual_seed(0)
    x = torch.randn(shape, device=device, dtype=dtype).requires_grad_(True)
    grad = torch.randn(shape, device=device, dtype=dtype)
    modules = {GN: nn.GroupNorm(32, shape[1]).to(device=device, dtype=dtype).train(),
               BN: nn.BatchNorm2d(shape[1]).to(device=device, dtype=dtype).train()}
    unavailable = {}
    for name, factory in layer_factories(shape[1]).items():
        for backend in BACKENDS:
            module, why = build(factory, backend, x, device)
            if module is None:
                unavailable[f'{name} [{backend}]'] = why
            else:
                modules[f'{name} [{backend}]'] = module
    rows = {name: {} for name in modules}
    floor = (FWD_PASSES + BWD_PASSES) * x.numel() * x.element_size()
    for mode, backward in (('fwd', False), ('fwd+bwd', True)):
        calls = {name: make_call(m, x, grad, backward) for name, m in modules.items()}
        times = device_times(calls, repeats, warmup, device)
        for name in modules:
            med, iqr = median_iqr(times[name])
            rows[name][f'{mode}_ms'], rows[name][f'{mode}_iqr_ms'] = med * 1e3, iqr * 1e3
            if backward:
                rows[name].update(launch_counts(calls[name]))
                rows[name]['device_ms'] = cuda_kernel_ms(calls[name])  # the kernels' own time (None off CUDA)
    gn_device = rows[GN].get('device_ms')
    for row in rows.values():
        s = row['fwd+bwd_ms'] * 1e-3
        row.update(vs_gn=row['fwd+bwd_ms'] / rows[GN]['fwd+bwd_ms'], vs_bn=row['fwd+bwd_ms'] / rows[BN]['fwd+bwd_ms'],
                   floor_bytes=floor, gbps=floor / s / 1e9,
                   floor_fraction=floor / copy_bw / s)
        device = row.get('device_ms')
        row.update(device_vs_gn=None if not (device and gn_device) else device / gn_device,
                   device_floor_fraction=None if not device else floor / copy_bw / (device * 1e-3))
    return rows, unavailable


def bench_whitening(shape, device, repeats, warmup, group=64):
    """IterNorm (Newton T=5) against ZCA (eigh), fp32 fwd+bwd: the layers, and the whitening matrix alone."""
    from normdense.layers.iternorm import IterNorm, newton_whitening_matrix, zca_whitening_matrix
    n, c, h, w = shape
    torch.manual_seed(0)
    x = torch.randn(shape, device=device).requires_grad_(True)
    grad = torch.randn(shape, device=device)
    layers = {'IterNorm g64 T5': IterNorm(c, group_size=group, T=5), 'ZCA g64 (eigh)': IterNorm(c, group, method='zca')}
    calls = {k: make_call(m.to(device).train(), x, grad, True) for k, m in layers.items()}
    xc = torch.randn(c // group, group, n * h * w, device=device)
    xc = (xc - xc.mean(2, keepdim=True)).requires_grad_(True)
    g = torch.randn(c // group, group, group, device=device)

    def matrix(fn):
        def step():
            xc.grad = None
            fn(xc).backward(g)
        return step
    calls.update({'newton T5 matrix': matrix(lambda t: newton_whitening_matrix(t, 1e-5, 5)),
                  'zca eigh matrix': matrix(lambda t: zca_whitening_matrix(t, 1e-5))})
    times = device_times(calls, repeats, warmup, device)
    out = {k: dict(zip(('ms', 'iqr_ms'), (v * 1e3 for v in median_iqr(t)))) for k, t in times.items()}
    out['zca_over_iternorm'] = out['ZCA g64 (eigh)']['ms'] / out['IterNorm g64 T5']['ms']
    out['zca_over_newton'] = out['zca eigh matrix']['ms'] / out['newton T5 matrix']['ms']
    return out


def check_targets(results, levels):
    targets = []
    for level in levels:
        s = results['settings'].get(f'{level} {TARGET_DTYPE}')
        if s is None:
            continue
        for name in layer_factories(256):
            row = s['rows'].get(f'{name} [triton]')
            why = s['unavailable'].get(f'{name} [triton]')
            for target, key, ok in ((f'fwd+bwd <= {MAX_VS_GN}x nn.GroupNorm', 'vs_gn', lambda v: v <= MAX_VS_GN),
                                    (f'>= {MIN_FLOOR_FRACTION:.0%} of the byte floor', 'floor_fraction',
                                     lambda v: v >= MIN_FLOOR_FRACTION)):
                value = None if row is None else row[key]
                targets.append(dict(target=f'{name} [triton] {target} ({TARGET_DTYPE})', setting=level, value=value,
                                    passed=value is not None and ok(value), note=why))
    w = results.get('whitening')
    if w is not None:
        for key, what in (('zca_over_iternorm', 'IterNorm layer'), ('zca_over_newton', 'Newton T5 matrix')):
            targets.append(dict(target=f'{what} >= {MIN_ZCA_OVER_ITERNORM:.0f}x faster than ZCA (fwd+bwd, fp32)',
                                setting=w['level'], value=w[key], passed=w[key] >= MIN_ZCA_OVER_ITERNORM, note=None))
    return targets


def markdown(results):
    """A short report: conditions, one table per dtype (fwd+bwd ms, x nn.GroupNorm, % of the byte floor per
    level; launches at the smallest level), the targets."""
    c = results['conditions']
    lines = [f"Device: {c['device']}; torch {c['torch']}, CUDA {c['cuda']}, triton {c['triton']}; "
             f"copy bandwidth {results['copy_bandwidth_gbps']:.0f} GB/s (read + write); {c['note']}.", '']
    levels = list(results['levels'])
    for dname in results['dtypes']:
        settings = [results['settings'][f'{lv} {dname}'] for lv in levels]
        lines += [f'**{dname}**: fwd+bwd ms (host + device) / x nn.GroupNorm / x nn.BatchNorm2d / % of byte floor; '
                  f'device ms (the kernels\' own) / x nn.GroupNorm', '',
                  '| layer | ' + ' | '.join(levels) + f' | launches ({levels[-1]}) |',
                  '|---|' + '---|' * (len(levels) + 1)]
        names = list(settings[0]['rows']) + list(settings[0]['unavailable'])
        for name in names:
            cells = []
            for s in settings:
                r = s['rows'].get(name)
                device = '' if not r or r.get('device_ms') is None else \
                    f"; {r['device_ms']:.3f} / {r['device_vs_gn']:.2f}"
                cells.append('n/a' if r is None else
                             f"{r['fwd+bwd_ms']:.3f} / {r['vs_gn']:.2f} / {r['vs_bn']:.2f} / "
                             f"{100 * r['floor_fraction']:.0f}%{device}")
            last = settings[-1]['rows'].get(name)
            lines.append(f'| {name} | ' + ' | '.join(cells) + f" | {last['launches'] if last else 'n/a'} |")
        lines.append('')
    unavailable = {k: v for s in results['settings'].values() for k, v in s['unavailable'].items()}
    lines += [f'n/a: {k}: {v}' for k, v in sorted(unavailable.items())]
    if 'whitening' in results:
        w = results['whitening']
        lines.append(f"\nIterNorm g64 T5 vs ZCA at {w['level']} fp32 (fwd+bwd): layer {w['zca_over_iternorm']:.1f}x, "
                     f"whitening matrix {w['zca_over_newton']:.1f}x")
    if 'host' in results:
        h = results['host']
        lines += ['', f"Host time per fwd+bwd call (x {tuple(h['shape'])}, N calls then one synchronize; "
                      f"{'launches stubbed' if h['launches_stubbed'] else 'real launches'}), dy step:", '',
                  '| layer | us | x nn.GroupNorm | Python calls |', '|---|---|---|---|']
        lines += [f"| {r['name']} | {r['dy_us']:.1f} | {r['dy_vs_gn']:.2f} | {r['python_calls']} |"
                  for r in h['results']]
    lines += ['', '| target | level | value | result |', '|---|---|---|---|']
    for t in results['targets']:
        v = 'n/a' if t['value'] is None else f"{t['value']:.2f}"
        lines.append(f"| {t['target']} | {t['setting']} | {v} | {'PASS' if t['passed'] else 'FAIL'} |")
    return '\n'.join(lines) + '\n'


def slug(name):
    return re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--device', default='cuda', choices=('cuda', 'cpu'))
    parser.add_argument('--quick', action='store_true', help='a tiny shape in bf16, 3 repeats: the code path only')
    parser.add_argument('--repeats', type=int, default=None, help='timed rounds (default 25; 3 with --quick)')
    parser.add_argument('--warmup', type=int, default=None, help='untimed rounds first (default 3; 1 with --quick)')
    parser.add_argument('--levels', default=None,
                        help=f'comma-separated FPN levels (default all: {",".join(LEVELS)})')
    parser.add_argument('--dtypes', default=None, help=f'comma-separated dtypes (default all: {",".join(DTYPES)})')
    parser.add_argument('--out', default=None, help='JSON path (default benchmarks/results/gpu_<device>.json)')
    parser.add_argument('--md', default=None, help='markdown path (default: the JSON path with .md)')
    parser.add_argument('--no-host', action='store_true', help='skip the host-time rows (benchmarks/host.py)')
    args = parser.parse_args(argv)
    if args.device == 'cuda' and not torch.cuda.is_available():
        sys.exit('benchmarks/gpu.py: no GPU (torch.cuda.is_available() is False): nothing measured; '
                 '--device cpu --quick runs the code path without measuring')
    repeats = args.repeats or (3 if args.quick else 25)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    levels = QUICK_LEVELS if args.quick else LEVELS
    dtypes = QUICK_DTYPES if args.quick else tuple(DTYPES)
    for arg, flag, known in ((args.levels, '--levels', LEVELS), (args.dtypes, '--dtypes', DTYPES)):
        bad = [v for v in (arg or '').split(',') if arg and v not in known]
        if bad:
            parser.error(f'{flag}: unknown {", ".join(bad)} (choose from {", ".join(known)})')
    if args.levels and not args.quick:
        levels = {k: LEVELS[k] for k in args.levels.split(',')}
    if args.dtypes and not args.quick:
        dtypes = tuple(args.dtypes.split(','))
    device_name = torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cond = dict(conditions(torch.get_num_threads()), device=device_name, quick=args.quick, repeats=repeats,
                warmup=warmup, cuda=torch.version.cuda, triton=triton_version,
                triton_interpret=os.environ.get('TRITON_INTERPRET'),
                note='synchronized per call (launch overhead counted), interleaved rows, medians'
                if args.device == 'cuda' else 'CPU code-path check only: not a GPU measurement')
    if args.device == 'cuda':  # the whitening compares formulas: no TF32 in the matrix products
        torch.backends.cuda.matmul.allow_tf32 = False
    copy_bw = copy_bandwidth(args.device, (256 if args.device == 'cuda' else 8) << 20)
    print('conditions:', json.dumps(cond))
    print(f'device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write)')
    results = dict(conditions=cond, levels={k: list(v) for k, v in levels.items()}, dtypes=list(dtypes),
                   copy_bandwidth_gbps=copy_bw / 1e9, settings={})
    t_start = time.perf_counter()
    for dname in dtypes:
        for level, shape in levels.items():
            rows, unavailable = bench_setting(shape, DTYPES[dname], args.device, repeats, warmup, copy_bw)
            results['settings'][f'{level} {dname}'] = dict(shape=list(shape), rows=rows, unavailable=unavailable)
            print(f'\n{level} {"x".join(map(str, shape))} {dname}: {"row":30s} {"fwd ms":>8s} {"f+b ms":>8s} '
                  f'{"x GN":>5s} {"x BN":>5s} {"GB/s":>6s} {"floor":>6s} {"launches":>8s}')
            for name, r in rows.items():
                print(f'  {name:40s} {r["fwd_ms"]:8.3f} {r["fwd+bwd_ms"]:8.3f} {r["vs_gn"]:5.2f} {r["vs_bn"]:5.2f} '
                      f'{r["gbps"]:6.0f} {100 * r["floor_fraction"]:5.0f}% {r["launches"]:8d}')
            for name, why in unavailable.items():
                print(f'  {name:40s} n/a: {why}')
    if not args.no_host:  # host time per call apart from the device's (benchmarks/host.py; stubbed on the CPU)
        from benchmarks import host
        results['host'] = host.run(args.device, 2 if args.quick else 15, 5 if args.quick else 100,
                                   warmup=2 if args.quick else 20)
        for r in results['host']['results']:
            print(f"host {r['name']:34s} {r['dy_us']:8.1f} us/call {r['dy_vs_gn']:5.2f}x GN  "
                  f"{r['python_calls']} Python calls")
    wlevel = 'tiny' if args.quick else 'P3' if 'P3' in levels else list(levels)[-1]
    results['whitening'] = dict(bench_whitening(levels[wlevel], args.device, repeats, warmup), level=wlevel)
    results['targets'] = check_targets(results, list(QUICK_LEVELS) if args.quick else TARGET_LEVELS)
    results['wall_s'] = time.perf_counter() - t_start
    print()
    for t in results['targets']:
        v = 'n/a' if t['value'] is None else f"{t['value']:.2f}"
        print(f'{"PASS" if t["passed"] else "FAIL"}  {t["target"]:70s} {t["setting"]:5s} {v}'
              + (f'  ({t["note"]})' if t['note'] else ''))
    out = args.out or osp.join(ROOT, 'benchmarks', 'results',
                               f'gpu_{slug(device_name)}{"_quick" if args.quick else ""}.json')
    md = args.md or osp.splitext(out)[0] + '.md'
    for path in (out, md):
        os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    with open(out, 'w') as f:
        json.dump(results, f, indent=1)
    with open(md, 'w') as f:
        f.write(markdown(results))
    print(f'wrote {out} and {md} ({results["wall_s"]:.0f} s)')
    return results


if __name__ == '__main__':
    main()
