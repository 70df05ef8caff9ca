#!/usr/bin/env python
"""The WS/BCN paper's micro-batch comparison on real photographs: Fashion-MNIST through mmpretrain.

Each run is one of ``configs/fashion_mnist/resnet14-w16_<norm>_1xb<batch>_fashion-mnist.py`` (mmpretrain's
ImageClassifier, a width-16 ResNet-14 for 28x28 grey images, the norm in every slot through the norm
switch, 8 groups), trained from scratch by mmengine's Runner for one pass over a subset of the training set
(``--train-images``; lr = 0.1 x batch / 32, BCN's and Unitization's r = lr) and evaluated once with
mmpretrain's ``Accuracy`` (top-1) on the first ``--test-images`` test images. Every norm at 1, 2 and 32
images per batch over several seeds (data order, flips and initialization); seed by seed, so a run cut short
still compares every norm on the seeds it finished. Writes one JSON with every run (after each run) and a
plot of the mean and the seed spread (min-max, and each seed) per norm and batch size.

Data: mmpretrain's ``FashionMNIST`` reads the four extracted idx files (``train-images-idx3-ubyte``, ...).
``--data-root`` holds them extracted or gzipped (``*-ubyte.gz``, as Debian's ``dataset-fashion-mnist``
installs them in /usr/share/datasets/fashion-mnist, the default when present); gzipped ones are extracted
once into ``--extract-dir``. Nothing is downloaded.

    OMP_NUM_THREADS=1 python benchmarks/norm_comparison_fmnist.py          # the full run (~1 h on one core)
    python benchmarks/norm_comparison_fmnist.py --tiny --work-dir /tmp/nc  # seconds, on generated idx files
"""
import argparse
import gzip
import json
import os
import os.path as osp
import platform
import shutil
import sys
import time

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIG_DIR = osp.join(ROOT, 'configs', 'fashion_mnist')
DEBIAN_ROOT = '/usr/share/datasets/fashion-mnist'
IDX_FILES = ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte', 't10k-images-idx3-ubyte',
             't10k-labels-idx1-ubyte')
NORMS = ('bn', 'gn', 'gn-ws', 'bcn-ws', 'gn-pn', 'iternorm', 'unitization')
LABELS = {'bn': 'BN', 'gn': 'GN', 'gn-ws': 'GN+WS', 'bcn-ws': 'BCN+WS', 'gn-pn': 'GN+PN', 'iternorm': 'IterNorm',
          'unitization': 'Unitization'}
PAPER_ORDER = ('micro-batch: BCN+WS > GN+WS > GN > BN (WS/BCN paper, arXiv:1903.10520, Tables 1, 7, 8); '
               'GN+PN matches BN (Labatie et al. 2021)')
GET_DATA = ('apt-get install dataset-fashion-mnist (Debian/Ubuntu: /usr/share/datasets/fashion-mnist), or let '
            "mmpretrain fetch them: python -c \"from mmpretrain.datasets import FashionMNIST; "
            "FashionMNIST('data/fashion_mnist', test_mode=False)\" and pass --data-root data/fashion_mnist")


def config_path(norm, batch):
    return osp.join(CONFIG_DIR, f'resnet14-w16_{norm}_1xb{batch}_fashion-mnist.py')


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--norms', default=','.join(NORMS))
    p.add_argument('--batches', default='1,2,32')
    p.add_argument('--seeds', default='0,1,2')
    p.add_argument('--train-images', type=int, default=None,
                   help="the first N training images, one pass (default: the configs' subset)")
    p.add_argument('--test-images', type=int, default=None,
                   help="evaluate on the first N test images (default: the configs', the whole test set)")
    p.add_argument('--data-root', default=DEBIAN_ROOT if osp.isdir(DEBIAN_ROOT) else osp.join(ROOT, 'data',
                                                                                                 'fashion_mnist'),
                   help='the idx files, extracted or .gz (default: Debian\'s dataset-fashion-mnist when installed)')
    p.add_argument('--extract-dir', default=None, help='where .gz files are extracted (default: WORK_DIR/idx)')
    p.add_argument('--work-dir', default=osp.join(ROOT, 'work_dirs', 'norm_comparison_fmnist'))
    p.add_argument('--out', default=osp.join(ROOT, 'benchmarks', 'results', 'norm_comparison_fmnist.json'))
    p.add_argument('--plot', default=osp.join(ROOT, 'docs', 'figures', 'norm_comparison_fmnist.png'))
    p.add_argument('--tiny', action='store_true',
                   help='64 training and 32 test images (generated idx files when --data-root has none): the test')
    p.add_argument('--replot', action='store_true',
                   help='only redraw --plot from the JSON at --out and print its markdown table')
    return p.parse_args(argv)


def write_generated_idx(folder, num_train=64, num_test=32, seed=0):
    """Fashion-MNIST-shaped idx files (uint8 28x28 images, labels 0-9; class c brightens row band c) for --tiny."""
    import numpy as np
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    for split, n in (('train', num_train), ('t10k', num_test)):
        labels = (np.arange(n) % 10).astype(np.uint8)
        images = rng.integers(0, 80, size=(n, 28, 28), dtype=np.uint8)
        for i, c in enumerate(labels):
            images[i, 2 + 2 * c:4 + 2 * c] = 255
        with open(osp.join(folder, f'{split}-images-idx3-ubyte'), 'wb') as f:
            f.write(bytes([0, 0, 8, 3]) + b''.join(int(v).to_bytes(4, 'big') for v in (n, 28, 28)) + images.tobytes())
        with open(osp.join(folder, f'{split}-labels-idx1-ubyte'), 'wb') as f:
            f.write(bytes([0, 0, 8, 1]) + n.to_bytes(4, 'big') + labels.tobytes())
    return folder


def _shown(path):
    """A path as results record it: relative to the checkout when inside it (work dirs), else as given."""
    rel = osp.relpath(osp.abspath(path), ROOT)
    return path if rel.startswith('..') else rel


def prepare_data(data_root, extract_dir):
    """The folder holding the four extracted idx files mmpretrain reads: ``data_root`` itself, or
    ``extract_dir`` with the ``.gz`` files of ``data_root`` extracted into it. SystemExit (one line) when absent."""
    if all(osp.isfile(osp.join(data_root, name)) for name in IDX_FILES):
        return data_root
    if not all(osp.isfile(osp.join(data_root, name + '.gz')) for name in IDX_FILES):
        raise SystemExit(f'norm_comparison_fmnist.py: no Fashion-MNIST idx files in {data_root} '
                         f'({IDX_FILES[0]}[.gz], ...): {GET_DATA}')
    os.makedirs(extract_dir, exist_ok=True)
    for name in IDX_FILES:
        src, dst = osp.join(data_root, name + '.gz'), osp.join(extract_dir, name)
        if osp.isfile(dst) and osp.getmtime(dst) >= osp.getmtime(src):
            continue
        with gzip.open(src, 'rb') as fin, open(dst + '.part', 'wb') as fout:
            shutil.copyfileobj(fin, fout)
        os.replace(dst + '.part', dst)
    return extract_dir


def _rescale_schedule(cfg, iters):
    """Set the configs' one-pass schedule to ``iters`` iterations (warm-up and decay scaled with it)."""
    old = cfg.train_cfg.max_iters
    for sched in cfg.param_scheduler:
        sched['begin'] = round(sched['begin'] * iters / old)
        sched['end'] = max(sched['begin'] + 1, round(sched['end'] * iters / old))
    cfg.train_cfg.max_iters = iters
    cfg.train_cfg.val_interval = iters + 1  # no validation inside train(): evaluated once below
    cfg.default_hooks.checkpoint.interval = iters + 1  # no checkpoint: evaluated in memory after training
    cfg.default_hooks.checkpoint.save_last = False
    cfg.default_hooks.logger.interval = max(1, iters // 5)


def run_config(norm, batch, seed, data, work_dir, train_images=None, test_images=None):
    """The config of one run, as the benchmark changes it: data folder, seed, work dir, subset sizes."""
    from mmengine.config import Config
    cfg = Config.fromfile(config_path(norm, batch))
    for loader in (cfg.train_dataloader, cfg.val_dataloader):
        loader.dataset.data_prefix = data
    if train_images is not None:
        cfg.train_dataloader.dataset.indices = train_images
    if test_images is not None:
        cfg.val_dataloader.dataset.indices = test_images
    cfg.test_dataloader = cfg.val_dataloader
    _rescale_schedule(cfg, cfg.train_dataloader.dataset.indices // batch)
    cfg.work_dir = work_dir
    cfg.experiment_name = f'{norm}_b{batch}_s{seed}'
    cfg.randomness = dict(seed=seed)
    cfg.visualizer.vis_backends = [dict(type='LocalVisBackend')]
    return cfg


def run_one(cfg):
    """Train, then evaluate once with the config's Accuracy; returns (top-1 %, seconds, switch summary)."""
    from mmengine.registry import RUNNERS
    start = time.time()
    runner = RUNNERS.build(cfg)
    runner.train()
    metrics = runner.val_loop.run()
    seconds = time.time() - start
    value = next(v for k, v in metrics.items() if k.endswith('top1'))
    return float(value), seconds, runner.normdense_switch.table()


def summarize(runs):
    groups = {}
    for r in runs:
        groups.setdefault((r['batch'], r['norm']), []).append(r['top1'])
    order = {n: i for i, n in enumerate(NORMS)}
    out = []
    for (batch, norm), values in sorted(groups.items(), key=lambda kv: (kv[0][0], order[kv[0][1]])):
        mean = sum(values) / len(values)
        out.append(dict(batch=batch, norm=norm, label=LABELS[norm], mean=mean, min=min(values), max=max(values),
                        seeds=len(values), values=values))
    return out


def plot(summary, path, conditions):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    norms = [n for n in NORMS if any(s['norm'] == n for s in summary)]
    batches = sorted({s['batch'] for s in summary})
    colors = {1: '#c44e52', 2: '#dd8452', 32: '#4c72b0'}
    width = 0.8 / len(batches)
    fig, ax = plt.subplots(figsize=(1.3 * len(norms) + 2.5, 4.2))
    for j, batch in enumerate(batches):
        rows = {s['norm']: s for s in summary if s['batch'] == batch}
        xs = [i + (j - (len(batches) - 1) / 2) * width for i, n in enumerate(norms) if n in rows]
        sel = [rows[n] for n in norms if n in rows]
        ax.bar(xs, [s['mean'] for s in sel], width * 0.92, color=colors.get(batch, None), label=f'batch {batch}',
               yerr=[[s['mean'] - s['min'] for s in sel], [s['max'] - s['mean'] for s in sel]], capsize=2)
        for x, s in zip(xs, sel):
            ax.plot([x] * len(s['values']), s['values'], 'k.', markersize=3)
    ax.set_xticks(range(len(norms)), [LABELS[n] for n in norms])
    ax.set_ylabel('top-1 accuracy (%), test images')
    low = min([s['min'] for s in summary] + [100.0])
    ax.set_ylim(max(0.0, 10 * (low // 10) - 10), 100)
    ax.axhline(10, color='grey', lw=0.5, ls=':')  # chance
    ax.legend(loc='upper left', bbox_to_anchor=(1.005, 1.0), fontsize=8)
    ax.set_title('Fashion-MNIST, ResNet-14 w16 from scratch: mean over seeds (bars), min-max (whiskers), seeds (dots)',
                 fontsize=9)
    fig.text(0.5, 0.01, conditions, ha='center', fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_table(summary):
    """Norms as rows, batch sizes as columns: 'mean (min-max)' of top-1 %."""
    batches = sorted({s['batch'] for s in summary})
    cell = {(s['norm'], s['batch']): s for s in summary}
    lines = ['| norm | ' + ' | '.join(f'batch {b}' for b in batches) + ' |', '|---|' + '---|' * len(batches)]
    for norm in NORMS:
        if any((norm, b) in cell for b in batches):
            lines.append(f'| {LABELS[norm]} | ' + ' | '.join(
                f"{cell[norm, b]['mean']:.2f} ({cell[norm, b]['min']:.2f}-{cell[norm, b]['max']:.2f})"
                if (norm, b) in cell else '-' for b in batches) + ' |')
    return '\n'.join(lines)


def _eta(runs, jobs_left):
    """Seconds left: each remaining run at the mean time of the finished runs of its batch size."""
    per_batch = {}
    for r in runs:
        per_batch.setdefault(r['batch'], []).append(r['seconds'])
    overall = sum(r['seconds'] for r in runs) / max(1, len(runs))
    return sum(sum(per_batch[b]) / len(per_batch[b]) if b in per_batch else overall for _, b, _ in jobs_left)


def main(argv=None):
    args = parse_args(argv)
    if args.replot:
        with open(args.out) as f:
            result = json.load(f)
        plot(result['summary'], args.plot, result['conditions'] + ('' if result['complete'] else ' (incomplete)'))
        print(markdown_table(result['summary']))
        return result
    norms = args.norms.split(',')
    for norm in norms:
        if norm not in LABELS:
            raise SystemExit(f'norm_comparison_fmnist.py: unknown norm {norm!r}; choose from {", ".join(NORMS)}')
    batches = [int(b) for b in args.batches.split(',')]
    seeds = [int(s) for s in args.seeds.split(',')]
    if args.tiny:
        args.train_images = args.train_images or 64
        args.test_images = args.test_images or 32
        if not any(osp.isfile(osp.join(args.data_root, n + ext)) for n in IDX_FILES[:1] for ext in ('', '.gz')):
            args.data_root = write_generated_idx(osp.join(args.work_dir, 'generated_idx'))
    data = prepare_data(args.data_root, args.extract_dir or osp.join(args.work_dir, 'idx'))

    import torch
    torch.set_num_threads(1)  # one core: the machine is shared (and the timings are comparable)
    import normdense  # noqa: F401  (registers the layers, hooks and NormSwitchRunner)

    probe = run_config(norms[0], batches[0], seeds[0], data, args.work_dir, args.train_images, args.test_images)
    train_images, test_images = probe.train_dataloader.dataset.indices, probe.val_dataloader.dataset.indices
    jobs = [(n, b, s) for s in seeds for b in batches for n in norms]
    conditions = (f'Fashion-MNIST: first {train_images} training images, one pass (lr = 0.1 x batch / 32, r = lr), '
                  f'first {test_images} test images; ResNet-14 width 16, 8 groups, from scratch; seeds '
                  f'{args.seeds}; 1 CPU thread')
    started = time.time()
    result = dict(
        conditions=conditions, paper_order=PAPER_ORDER, tiny=args.tiny, complete=False,
        started_utc=time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(started)), finished_utc=None,
        data=dict(root=_shown(args.data_root), read_from=_shown(data), train_images=train_images,
                  test_images=test_images),
        machine=dict(platform=platform.platform(), python=platform.python_version(), torch=torch.__version__,
                     threads=torch.get_num_threads(), omp_num_threads=os.environ.get('OMP_NUM_THREADS')),
        configs={f'{n}_b{b}': osp.relpath(config_path(n, b), ROOT) for n in norms for b in batches},
        summary=[], runs=[])
    runs = result['runs']
    os.makedirs(osp.dirname(osp.abspath(args.out)), exist_ok=True)
    print(f'[fmnist] {len(jobs)} runs: {len(norms)} norms x batches {args.batches} x seeds {args.seeds}; '
          f'data {_shown(data)}', flush=True)
    for k, (norm, batch, seed) in enumerate(jobs):
        cfg = run_config(norm, batch, seed, data, osp.join(args.work_dir, f'{norm}_b{batch}_s{seed}'),
                         args.train_images, args.test_images)
        top1, secs, table = run_one(cfg)
        runs.append(dict(norm=norm, batch=batch, seed=seed, top1=top1, seconds=round(secs, 1),
                         iters=cfg.train_cfg.max_iters, lr=cfg.optim_wrapper.optimizer.lr,
                         switched=table.splitlines()[0]))
        elapsed = time.time() - started
        print(f'[fmnist {k + 1}/{len(jobs)}] {LABELS[norm]} batch {batch} seed {seed}: top-1 {top1:.2f} % '
              f'({secs:.0f} s, {cfg.train_cfg.max_iters} it.); elapsed {elapsed / 60:.1f} min, '
              f'ETA {_eta(runs, jobs[k + 1:]) / 60:.1f} min', flush=True)
        result['summary'] = summary = summarize(runs)
        result['complete'] = len(runs) == len(jobs)
        result['finished_utc'] = time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())
        with open(args.out, 'w') as f:  # after every run: a cut-short benchmark keeps what it measured
            json.dump(result, f, indent=1)
    plot(summary, args.plot, conditions)
    print(markdown_table(summary))
    for s in summary:
        print(f"[fmnist] batch {s['batch']} {s['label']}: mean {s['mean']:.2f} (min {s['min']:.2f}, "
              f"max {s['max']:.2f}, {s['seeds']} seeds)")
    return result


if __name__ == '__main__':
    main()
