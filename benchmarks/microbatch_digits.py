"""Micro-batch training on sklearn's digits: a small CNN trained at batch 1, 2 and 32 with BN, GN, GN+WS,
BCN+WS (estimate mode), GN+PN and IterNorm; several seeds; test accuracy median and IQR; plot.

    python benchmarks/microbatch_digits.py                     # 3 seeds, 3 epochs, 1 thread
    python benchmarks/microbatch_digits.py --seeds 0 1 2 3 4 --epochs 5

Data: sklearn.datasets.load_digits (1797 8x8 grey images, 10 classes, bundled with scikit-learn, no
download), a fixed stratified 80/20 train/test split, pixels / 16. Network: conv3x3(1->32) norm act,
conv3x3(32->32) norm act, maxpool 2, conv3x3(32->64) norm act, global average pool, linear(64->10);
GN/BCN 8 groups, IterNorm 16 channels per group (T=5), GN+PN 8 groups (the activation is inside the
layer). SGD momentum 0.9, constant lr = 0.1 * sqrt(B / 32) (square-root scaling), the same number of
epochs (samples seen) for every batch size, BCN's r = lr. Accuracy is measured in eval mode on the test
split. Writes benchmarks/results/microbatch_digits.json and docs/figures/bench_microbatch_digits.png.
"""
import argparse
import json
import math
import os
import os.path as osp
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks._timing import conditions, median_iqr  # noqa: E402


def make_norm(kind, c):
    from normdense.layers.bcn import BatchChannelNorm2d
    from normdense.layers.iternorm import IterNorm
    from normdense.layers.proxy_norm import GroupProxyNorm
    if kind == 'BN':
        return nn.BatchNorm2d(c)
    if kind in ('GN', 'GN+WS'):
        return nn.GroupNorm(8, c)
    if kind == 'BCN+WS':
        return BatchChannelNorm2d(c, num_groups=8, mode='estimate')
    if kind == 'GN+PN':
        return GroupProxyNorm(c, num_groups=8)
    if kind == 'IterNorm':
        return IterNorm(c, group_size=16, T=5)
    raise ValueError(kind)


VARIANTS = ('BN', 'GN', 'GN+WS', 'BCN+WS', 'GN+PN', 'IterNorm')


class SmallCNN(nn.Module):
    def __init__(self, kind):
        super().__init__()
        from normdense.layers.ws import WSConv2d
        conv = WSConv2d if kind.endswith('+WS') else nn.Conv2d
        act = nn.Identity if kind == 'GN+PN' else nn.ReLU
        layers = []
        for i, (cin, cout) in enumerate(((1, 32), (32, 32), (32, 64))):
            layers += [conv(cin, cout, 3, padding=1, bias=False), make_norm(kind, cout), act()]
            if i == 1:
                layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(self.features(x).mean((2, 3)))


def load_data():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    idx_tr, idx_te = train_test_split(list(range(len(y))), test_size=0.2, stratify=digits.target, random_state=0)
    return x[idx_tr], y[idx_tr], x[idx_te], y[idx_te]


def run(kind, batch, seed, epochs, data):
    from normdense.layers import set_update_rate
    x_tr, y_tr, x_te, y_te = data
    torch.manual_seed(seed)
    model = SmallCNN(kind)
    lr = 0.1 * math.sqrt(batch / 32)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    set_update_rate(model, lr)
    g = torch.Generator().manual_seed(seed)
    model.train()
    finite = True
    for _ in range(epochs):
        perm = torch.randperm(len(y_tr), generator=g)
        for i in range(0, len(perm), batch):
            b = perm[i:i + batch]
            loss = F.cross_entropy(model(x_tr[b]), y_tr[b])
            if not torch.isfinite(loss):
                finite = False
                break
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if not finite:
            break
    model.eval()
    with torch.no_grad():
        acc = (model(x_te).argmax(1) == y_te).float().mean().item() if finite else float('nan')
    return acc


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2])
    parser.add_argument('--epochs', type=int, default=3)
    parser.add_argument('--batches', type=int, nargs='+', default=[1, 2, 32])
    parser.add_argument('--variants', nargs='+', default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument('--out', default=osp.join(ROOT, 'benchmarks', 'results', 'microbatch_digits.json'))
    parser.add_argument('--plot', default=osp.join(ROOT, 'docs', 'figures', 'bench_microbatch_digits.png'))
    parser.add_argument('--resummarize', action='store_true',
                        help='do not train: recompute the summary and the plot from the runs stored in --out')
    args = parser.parse_args(argv)
    if args.resummarize:
        with open(args.out) as f:
            results = json.load(f)
        args.epochs, args.seeds = results['epochs'], results['seeds']
        keys = list(results['runs'])
        args.variants = list(dict.fromkeys(k.rsplit(' B', 1)[0] for k in keys))
        args.batches = [int(b) for b in dict.fromkeys(k.rsplit(' B', 1)[1] for k in keys)]
        finish(results, args)
        return
    torch.set_num_threads(args.threads)
    data = load_data()
    cond = conditions(args.threads)
    print('conditions:', json.dumps(cond))
    results = dict(conditions=cond, epochs=args.epochs, seeds=args.seeds, runs={}, summary={})
    t0 = time.time()
    for kind in args.variants:
        for batch in args.batches:
            accs = []
            for seed in args.seeds:
                accs.append(run(kind, batch, seed, args.epochs, data))
                print(f'{kind:9s} B={batch:<3d} seed {seed}: test acc {accs[-1]:.4f}  ({time.time() - t0:.0f} s)',
                      flush=True)
            results['runs'][f'{kind} B{batch}'] = accs
    results['conditions_end'] = conditions(args.threads)
    finish(results, args)


def summarize(results):
    for key, accs in results['runs'].items():
        ok = [a for a in accs if a == a]
        med, iqr = median_iqr(ok) if ok else (float('nan'), float('nan'))
        results['summary'][key] = dict(median=med, iqr=iqr, n=len(accs), diverged=len(accs) - len(ok))


def finish(results, args):
    summarize(results)
    print(f'\ntest accuracy on sklearn digits (360 test images), {args.epochs} epochs, seeds {args.seeds}: '
          f'median [IQR; with 3 seeds the IQR is the range]')
    print(f'{"variant":10s}' + ''.join(f'{"B=" + str(b):>18s}' for b in args.batches))
    for kind in args.variants:
        cells = []
        for b in args.batches:
            s = results['summary'][f'{kind} B{b}']
            cell = f'{s["median"]:.4f} [{s["iqr"]:.4f}]' + (f' ({s["diverged"]} nan)' if s['diverged'] else '')
            cells.append(f'{cell:>18s}')
        print(f'{kind:10s}' + ''.join(cells))
    os.makedirs(osp.dirname(args.out), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(results, f, indent=1)
    plot(results, args, args.plot)
    print(f'wrote {args.out} and {args.plot}')


def plot(results, args, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(args.batches)
    for i, b in enumerate(args.batches):
        meds, lo, hi = [], [], []
        for kind in args.variants:
            accs = sorted(a for a in results['runs'][f'{kind} B{b}'] if a == a)
            med = statistics.median(accs) if accs else 0.0
            q = statistics.quantiles(accs, n=4) if len(accs) >= 2 else [med, med, med]
            meds.append(med)
            lo.append(med - min(q[0], med))
            hi.append(max(q[2], med) - med)
        ax.bar([j + i * width for j in range(len(args.variants))], meds, width, yerr=[lo, hi], capsize=3,
               label=f'batch {b}')
        for j, kind in enumerate(args.variants):
            ax.scatter([j + i * width] * len(results['runs'][f'{kind} B{b}']), results['runs'][f'{kind} B{b}'],
                       s=6, color='k', zorder=3)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(args.variants))])
    ax.set_xticklabels(args.variants)
    ax.set_ylabel('test accuracy (eval mode)')
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title(f'sklearn digits, small CNN, {args.epochs} epochs, seeds {args.seeds}: median, IQR, runs', fontsize=10)
    fig.tight_layout()
    os.makedirs(osp.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == '__main__':
    main()
