"""Layer benchmark: forward+backward time and saved-activation memory of every normdense layer against
torch.nn.BatchNorm2d, torch.nn.GroupNorm and mmcv's ConvWS (+ GN), on FPN-like shapes at batch 1 and 2.

    python benchmarks/layers.py                 # defaults: 1 thread, 256 channels, 16/32/64 px maps
    python benchmarks/layers.py --threads 2 --repeats 30 --sizes 16 32

Everything of one (batch, size) setting is timed side by side, interleaved (benchmarks/_timing.py), in
training mode; times are medians, reported as ratios to nn.GroupNorm (norm layers) or nn.Conv2d (convs).
Memory is the bytes of tensors autograd saves for backward (see ``saved_activation_bytes``). Writes
benchmarks/results/layers.json and docs/figures/bench_layers.png, and prints PASS/FAIL per target.

Rows ending in ``recompute`` are the same layers built with ``recompute=True`` (only the input saved for
backward, the rest recomputed in backward); the targets list them separately from the default
(plain-autograd) rows, and ``recompute cost`` compares their time with the default's.
"""
import argparse
import json
import os
import os.path as osp
import sys

import torch
import torch.nn as nn

sys.path.insert(0, osp.join(osp.dirname(osp.abspath(__file__)), '..'))
from benchmarks._timing import conditions, interleaved_times, median_iqr, saved_activation_bytes  # noqa: E402

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
RECOMPUTE = ' recompute'  # suffix of the rows of layers built with recompute=True


def norm_candidates(c):
    from normdense.layers.bcn import BatchChannelNorm2d
    from normdense.layers.equinorm import ChannelAffine
    from normdense.layers.iternorm import IterNorm
    from normdense.layers.proxy_norm import GroupProxyNorm
    from normdense.layers.unitization import Unitization2d
    return {
        'nn.BatchNorm2d': lambda: nn.BatchNorm2d(c),
        'nn.GroupNorm(32)': lambda: nn.GroupNorm(32, c),
        'BCN estimate': lambda: BatchChannelNorm2d(c, 32, mode='estimate', update_rate=0.01),
        'BCN estimate recompute': lambda: BatchChannelNorm2d(c, 32, mode='estimate', update_rate=0.01,
                                                             recompute=True),
        'BCN batch': lambda: BatchChannelNorm2d(c, 32, mode='batch'),
        'BCN batch recompute': lambda: BatchChannelNorm2d(c, 32, mode='batch', recompute=True),
        'GNPN (GN+PN)': lambda: GroupProxyNorm(c, 32),
        'GNPN (GN+PN) recompute': lambda: GroupProxyNorm(c, 32, recompute=True),
        'IterNorm g64 T5': lambda: IterNorm(c, group_size=64, T=5),
        'IterNorm g64 T5 recompute': lambda: IterNorm(c, group_size=64, T=5, recompute=True),
        'ZCA g64 (eigh)': lambda: IterNorm(c, group_size=64, method='zca'),
        'ZCA g64 (eigh) recompute': lambda: IterNorm(c, group_size=64, method='zca', recompute=True),
        'Unitization batch': lambda: Unitization2d(c),
        'Unitization batch recompute': lambda: Unitization2d(c, recompute=True),
        'Unitization estimate': lambda: Unitization2d(c, mode='estimate', update_rate=0.01),
        'ChannelAffine': lambda: ChannelAffine(c),
    }


def conv_candidates(c):
    from mmcv.cnn.bricks.conv_ws import ConvWS2d

    from normdense.layers.bcn import BatchChannelNorm2d
    from normdense.layers.equinorm import ChannelAffine, EquiConv2d
    from normdense.layers.ws import WSConv2d
    return {
        'nn.Conv2d': lambda: nn.Conv2d(c, c, 3, padding=1),
        'mmcv ConvWS2d': lambda: ConvWS2d(c, c, 3, padding=1),
        'WSConv2d': lambda: WSConv2d(c, c, 3, padding=1),
        'WSConv2d std_unbiased': lambda: WSConv2d(c, c, 3, padding=1, formula='std_unbiased'),
        'EquiConv2d': lambda: EquiConv2d(c, c, 3, padding=1),
        'nn.Conv2d+GN': lambda: nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(32, c)),
        'mmcv ConvWS2d+GN': lambda: nn.Sequential(ConvWS2d(c, c, 3, padding=1), nn.GroupNorm(32, c)),
        'WSConv2d+GN': lambda: nn.Sequential(WSConv2d(c, c, 3, padding=1), nn.GroupNorm(32, c)),
        'WSConv2d+BCN': lambda: nn.Sequential(WSConv2d(c, c, 3, padding=1),
                                              BatchChannelNorm2d(c, 32, update_rate=0.01)),
        'WSConv2d+BCN recompute': lambda: nn.Sequential(WSConv2d(c, c, 3, padding=1),
                                                        BatchChannelNorm2d(c, 32, update_rate=0.01, recompute=True)),
        'EquiConv2d+ChannelAffine': lambda: nn.Sequential(EquiConv2d(c, c, 3, padding=1), ChannelAffine(c)),
    }


def make_step(module, x, grad):
    def step():
        x.grad = None
        for p in module.parameters():
            p.grad = None
        module(x).backward(grad)
    return step


def bench_setting(cands, batch, channels, size, repeats, relu_input):
    torch.manual_seed(0)
    x = torch.randn(batch, channels, size, size)
    if relu_input:  # EquiNorm assumes post-ReLU (non-negative) inputs
        x = x.relu()
    x.requires_grad_(True)
    grad = torch.randn(batch, channels, size, size)
    modules = {n: f().train() for n, f in cands.items()}
    steps = {n: make_step(m, x, grad) for n, m in modules.items()}
    times = interleaved_times(steps, repeats)
    # Saved bytes at this size and at twice the height: the difference is the part that grows with the
    # activation (bytes per input element), the rest is fixed (weight-sized: standardized kernels, proxy
    # samples, whitening matrices).
    x2 = torch.cat([x.detach(), x.detach()], dim=2).requires_grad_(True)
    numel = x.numel()
    rows = {}
    for n, m in modules.items():
        med, iqr = median_iqr(times[n])
        mem = saved_activation_bytes(lambda: m(x), list(m.parameters()))
        mem2 = saved_activation_bytes(lambda: m(x2), list(m.parameters()))
        per_elem = (mem2 - mem) / numel
        rows[n] = dict(time_ms=med * 1e3, iqr_ms=iqr * 1e3, saved_bytes=mem, repeats=repeats,
                       act_bytes_per_elem=per_elem, fixed_bytes=mem - per_elem * numel)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--channels', type=int, default=256)
    parser.add_argument('--sizes', type=int, nargs='+', default=[16, 32, 64],
                        help='square map sizes (FPN P4/P3/P2 of a 256 px image: 16, 32, 64)')
    parser.add_argument('--batches', type=int, nargs='+', default=[1, 2])
    parser.add_argument('--repeats', type=int, default=15)
    parser.add_argument('--conv-sizes', type=int, nargs='+', default=[16, 32],
                        help='map sizes for the conv rows (3x3 256->256 convs are slow on CPU)')
    parser.add_argument('--out', default=osp.join(ROOT, 'benchmarks', 'results', 'layers.json'))
    parser.add_argument('--plot', default=osp.join(ROOT, 'docs', 'figures', 'bench_layers.png'))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cond = conditions(args.threads)
    print('conditions:', json.dumps(cond))
    c = args.channels
    results = dict(conditions=cond, channels=c, norm={}, conv={}, whitening={})
    for batch in args.batches:
        for size in args.sizes:
            key = f'N{batch}_{size}x{size}'
            results['norm'][key] = bench_setting(norm_candidates(c), batch, c, size, args.repeats, False)
            print_table(f'norm layers, input ({batch}, {c}, {size}, {size}), fwd+bwd, train mode',
                        results['norm'][key], 'nn.GroupNorm(32)')
            results['whitening'][key] = bench_whitening(batch, c, size, args.repeats)
        for size in (args.conv_sizes or args.sizes):
            key = f'N{batch}_{size}x{size}'
            results['conv'][key] = bench_setting(conv_candidates(c), batch, c, size, args.repeats, True)
            print_table(f'3x3 convs {c}->{c}, input ({batch}, {c}, {size}, {size}), fwd+bwd, train mode',
                        results['conv'][key], 'nn.Conv2d')
    results['conditions_end'] = conditions(args.threads)
    results['targets'] = check_targets(results)
    results['recompute'] = recompute_summary(results)
    os.makedirs(osp.dirname(args.out), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(results, f, indent=1)
    plot(results, args.plot)
    print(f'wrote {args.out} and {args.plot}')
    return results


def bench_whitening(batch, c, size, repeats):
    """Only the part that differs between IterNorm and ZCA: the whitening matrix of the centred groups
    (Newton T=5 vs eigh), forward + backward, same (G, 64, m) input."""
    from normdense.layers.iternorm import newton_whitening_matrix, zca_whitening_matrix
    torch.manual_seed(0)
    m = batch * size * size
    xc = torch.randn(c // 64, 64, m)
    xc = (xc - xc.mean(2, keepdim=True)).requires_grad_(True)
    g = torch.randn(c // 64, 64, 64)

    def run(fn):
        def step():
            xc.grad = None
            fn(xc).backward(g)
        return step
    times = interleaved_times({'newton T5': run(lambda t: newton_whitening_matrix(t, 1e-5, 5)),
                               'zca eigh': run(lambda t: zca_whitening_matrix(t, 1e-5))}, repeats)
    return {n: dict(time_ms=median_iqr(v)[0] * 1e3, iqr_ms=median_iqr(v)[1] * 1e3) for n, v in times.items()}


def print_table(title, rows, ref):
    print(f'\n{title}')
    print(f'{"layer":28s} {"median ms":>10s} {"IQR ms":>8s} {"time/ref":>9s} {"saved MB":>9s} {"mem/ref":>8s} '
          f'{"act B/elem":>10s} {"act/ref":>8s} {"fixed MB":>9s}')
    for n, r in rows.items():
        print(f'{n:28s} {r["time_ms"]:10.2f} {r["iqr_ms"]:8.2f} {r["time_ms"] / rows[ref]["time_ms"]:9.2f} '
              f'{r["saved_bytes"] / 2**20:9.2f} {r["saved_bytes"] / rows[ref]["saved_bytes"]:8.2f} '
              f'{r["act_bytes_per_elem"]:10.2f} {r["act_bytes_per_elem"] / rows[ref]["act_bytes_per_elem"]:8.2f} '
              f'{r["fixed_bytes"] / 2**20:9.2f}')
    print(f'(ref = {ref}; saved = tensors autograd keeps for backward; act B/elem = saved bytes that grow per '
          f'input element; fixed = the rest)')


def check_targets(results):
    targets = []

    def add(name, value, ok, detail, **extra):
        targets.append(dict(target=name, setting=detail, value=round(value, 3), passed=bool(ok), **extra))

    for key, rows in results['conv'].items():
        r = rows['WSConv2d']['time_ms'] / rows['mmcv ConvWS2d']['time_ms']
        add('WSConv2d fwd+bwd / mmcv ConvWS2d <= 1.0', r, r <= 1.0, key)
        r = rows['WSConv2d+GN']['time_ms'] / rows['mmcv ConvWS2d+GN']['time_ms']
        add('(WSConv2d+GN) / (mmcv ConvWS2d+GN) <= 1.0', r, r <= 1.0, key)
    for key, rows in results['norm'].items():
        r = rows['ZCA g64 (eigh)']['time_ms'] / rows['IterNorm g64 T5']['time_ms']
        add('IterNorm layer >= 5x faster than ZCA layer (fwd+bwd)', r, r >= 5.0, key)
        w = results['whitening'][key]
        r = w['zca eigh']['time_ms'] / w['newton T5']['time_ms']
        add('whitening matrix only: Newton T5 >= 5x faster than eigh (fwd+bwd)', r, r >= 5.0, key)
        gn = rows['nn.GroupNorm(32)']['act_bytes_per_elem']
        default, best = {}, {}  # per layer: default row; recompute row where there is one, else default
        for n, row in rows.items():
            if n in ('nn.BatchNorm2d', 'nn.GroupNorm(32)'):
                continue
            r = row['act_bytes_per_elem'] / gn
            if n.endswith(RECOMPUTE):
                layer = n[:-len(RECOMPUTE)]
                add(f'{layer} with recompute=True: activation memory <= 1.2x nn.GroupNorm', r, r <= 1.2, key)
                best[layer] = r
            else:
                add(f'{n}: activation memory <= 1.2x nn.GroupNorm', r, r <= 1.2, key)
                default[n] = r
                best.setdefault(n, r)
        # the issue's target over all layers, both ways: worst layer with default settings, and worst
        # layer when every layer that offers it uses recompute=True
        worst = max(default, key=default.get)
        add(f'all layers, default (plain autograd): activation memory <= 1.2x nn.GroupNorm (value: worst '
            f'layer)', default[worst], default[worst] <= 1.2, key, worst=worst)
        worst = max(best, key=best.get)
        add(f'all layers, recompute=True: activation memory <= 1.2x nn.GroupNorm (value: worst layer)',
            best[worst], best[worst] <= 1.2, key, worst=worst)
    for key, rows in results['conv'].items():
        base = rows['nn.Conv2d']['act_bytes_per_elem']
        gn = results['norm'].get(key, {}).get('nn.GroupNorm(32)', {}).get('act_bytes_per_elem')
        if gn is None:
            continue
        for n in ('WSConv2d', 'WSConv2d std_unbiased', 'EquiConv2d'):
            r = (rows[n]['act_bytes_per_elem'] - base) / gn
            add(f'{n}: activation memory beyond nn.Conv2d <= 1.2x nn.GroupNorm', r, r <= 1.2, key)
    print('\ntargets:')
    width = max(len(t['target']) for t in targets)
    for t in targets:
        worst = f' ({t["worst"]})' if 'worst' in t else ''
        print(f'  {"PASS" if t["passed"] else "FAIL"}  {t["target"]:{width}s} {t["setting"]:12s} '
              f'value {t["value"]}{worst}')
    return targets


def recompute_summary(results):
    """Per layer with a ``recompute`` row: activation memory / nn.GroupNorm of the default (plain
    autograd) and the recompute=True row, and the time cost of recompute (time / default time) per
    setting. Printed and stored; not a target of its own (the memory target is checked per row)."""
    out = []
    for kind, gn_ref in (('norm', 'nn.GroupNorm(32)'), ('conv', None)):
        for key, rows in results[kind].items():
            for n in rows:
                if not n.endswith(RECOMPUTE):
                    continue
                base = n[:-len(RECOMPUTE)]
                if gn_ref is not None:
                    gn = rows[gn_ref]['act_bytes_per_elem']
                    mem = (rows[base]['act_bytes_per_elem'] / gn, rows[n]['act_bytes_per_elem'] / gn)
                else:  # conv rows: relative to nn.Conv2d+GN
                    ref = rows['nn.Conv2d+GN']['act_bytes_per_elem']
                    mem = (rows[base]['act_bytes_per_elem'] / ref, rows[n]['act_bytes_per_elem'] / ref)
                out.append(dict(layer=base, kind=kind, setting=key,
                                time_ratio=rows[n]['time_ms'] / rows[base]['time_ms'], mem_default=mem[0],
                                mem_recompute=mem[1], mem_ref=gn_ref or 'nn.Conv2d+GN'))
    print('\nrecompute=True vs default (plain autograd): fwd+bwd time ratio, activation memory / reference')
    for r in out:
        print(f'  {r["layer"]:24s} {r["setting"]:12s} time x{r["time_ratio"]:.2f}   memory / {r["mem_ref"]}: '
              f'default {r["mem_default"]:.2f} -> recompute {r["mem_recompute"]:.2f}')
    return out


def plot(results, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    for ax, (kind, ref, field, label) in zip(axes, [
            ('norm', 'nn.GroupNorm(32)', 'time_ms', 'fwd+bwd time / nn.GroupNorm'),
            ('norm', 'nn.GroupNorm(32)', 'act_bytes_per_elem', 'activation memory (saved for backward) / nn.GroupNorm'),
            ('conv', 'nn.Conv2d', 'time_ms', 'fwd+bwd time / nn.Conv2d (3x3)')]):
        settings = list(results[kind])
        names = list(results[kind][settings[0]])
        width = 0.8 / len(settings)
        for i, s in enumerate(settings):
            rows = results[kind][s]
            vals = [rows[n][field] / rows[ref][field] for n in names]
            ax.bar([j + i * width for j in range(len(names))], vals, width, label=s)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))])
        ax.set_xticklabels(names, rotation=60, ha='right', fontsize=8)
        ax.axhline(1.0, color='k', lw=0.8)
        if field == 'act_bytes_per_elem':
            ax.axhline(1.2, color='r', lw=0.8, ls='--')
        ax.set_yscale('log')
        ax.set_title(label, fontsize=10)
        ax.legend(fontsize=7)
    c = results['conditions']
    fig.suptitle(f'normdense layers, {results["channels"]} channels, CPU {c["threads"]} thread(s), '
                 f'loadavg {c["loadavg_1_5_15"][0]:.1f} (shared machine), medians of interleaved runs',
                 fontsize=10)
    fig.tight_layout()
    os.makedirs(osp.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == '__main__':
    main()
