#!/usr/bin/env python
"""The WS/BCN paper's micro-batch comparison at toy scale, measured with the norm switch.

* Segmentation: the toy DeepLabV3 (``configs/demo/deeplabv3_r18-d8_bcn-ws_toy-voc.py``: half-width
  ResNet-18 V1c, output stride 8, ASPP head) trained from scratch at 2 images per batch on the toy VOC set,
  with each norm in every slot (``normdense_norm = dict(norm=NAME, num_groups=16)``: the demo's 16 groups
  at half width), over several seeds; mIoU on the toy VOC val set.
* Classification: the toy classifier (``configs/demo/resnet18-w32_bcn-ws_toy-imagenet.py``) at batch 1 and 2
  with BN, GN+WS and BCN+WS; top-1 accuracy on the toy ImageNet val set.

The schedules are the demos' shortened (``--seg-iters``, ``--cls-iters``; warm-up and poly/cosine decay
rescaled to them); everything else is the demo configs'. Writes one JSON with every run and a plot of the
mean and the seed spread (min-max) per norm; ``--tiny`` is the end-to-end check of the tests (a few
iterations on a few images).

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/norm_comparison.py            # the full run (~1 h, 2 cores)
    python benchmarks/norm_comparison.py --tiny --work-dir /tmp/nc               # seconds
"""
import argparse
import json
import os
import os.path as osp
import platform
import sys
import time

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, ROOT)

SEG_CONFIG = osp.join(ROOT, 'configs', 'demo', 'deeplabv3_r18-d8_bcn-ws_toy-voc.py')
CLS_CONFIG = osp.join(ROOT, 'configs', 'demo', 'resnet18-w32_bcn-ws_toy-imagenet.py')
LABELS = {'bn': 'BN', 'gn': 'GN', 'gn-ws': 'GN+WS', 'bcn-ws': 'BCN+WS', 'gn-pn': 'GN+PN', 'iternorm': 'IterNorm',
          'unitization': 'Unitization'}
PAPER_ORDER = 'BCN+WS > GN+WS > GN > BN at micro-batch (WS/BCN paper, arXiv:1903.10520)'


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--seg-norms', default='bn,gn,gn-ws,bcn-ws,gn-pn,iternorm')
    p.add_argument('--cls-norms', default='bn,gn-ws,bcn-ws')
    p.add_argument('--seeds', default='0,1,2')
    p.add_argument('--seg-iters', type=int, default=700, help='toy DeepLabV3 iterations (the demo: 5000)')
    p.add_argument('--cls-iters', type=int, default=300, help='toy classifier iterations (the demo: 3000 at batch 8)')
    p.add_argument('--seg-batch', type=int, default=2)
    p.add_argument('--cls-batches', default='1,2')
    p.add_argument('--data-dir', default=osp.join(ROOT, 'data'), help='toy_voc / toy_imagenet here (written if absent)')
    p.add_argument('--work-dir', default=osp.join(ROOT, 'work_dirs', 'norm_comparison'))
    p.add_argument('--out', default=osp.join(ROOT, 'benchmarks', 'results', 'norm_comparison.json'))
    p.add_argument('--plot', default=osp.join(ROOT, 'docs', 'figures', 'norm_comparison.png'))
    p.add_argument('--tiny', action='store_true', help='a few iterations on a few images (the end-to-end test)')
    p.add_argument('--skip-cls', action='store_true')
    p.add_argument('--skip-seg', action='store_true')
    p.add_argument('--replot', action='store_true', help='only redraw --plot from the JSON at --out')
    return p.parse_args(argv)


def ensure_data(args):
    from normdense.data.writers import write_imagenet, write_voc
    voc = osp.join(args.data_dir, 'toy_voc')
    imagenet = osp.join(args.data_dir, 'toy_imagenet')
    small = dict(num_train=4, num_val=2, num_aug=4) if args.tiny else {}
    if not args.skip_seg and not osp.isdir(osp.join(voc, 'VOCdevkit', 'VOC2012', 'JPEGImages')):
        write_voc(voc, **small)
    if not args.skip_cls and not osp.isdir(osp.join(imagenet, 'meta')):
        write_imagenet(imagenet, **(dict(num_train=10, num_val=5) if args.tiny else {}))
    return osp.join(voc, 'VOCdevkit', 'VOC2012'), imagenet


def _common(cfg, norm, seed, iters, work_dir, name):
    cfg.work_dir = work_dir
    cfg.experiment_name = name
    cfg.randomness = dict(seed=seed)
    cfg.custom_hooks = []  # the demo's BCN rate hook: the switch adds what each norm needs
    cfg.runner_type = 'NormSwitchRunner'
    cfg.normdense_norm = dict(norm=norm, num_groups=16)
    cfg.train_cfg.max_iters = iters
    cfg.train_cfg.val_interval = iters + 1  # evaluated once, after training (below)
    cfg.default_hooks.checkpoint = dict(type='CheckpointHook', interval=iters + 1, save_last=False)
    cfg.default_hooks.logger = dict(type='LoggerHook', interval=max(1, iters // 5))
    cfg.pop('load_from', None)
    return cfg


def seg_config(norm, seed, iters, batch, data_root, work_dir, tiny):
    from mmengine.config import Config
    cfg = Config.fromfile(SEG_CONFIG)
    for ds in cfg.train_dataloader.dataset.datasets:
        ds.data_root = data_root
    cfg.val_dataloader.dataset.data_root = data_root
    cfg.test_dataloader = cfg.val_dataloader
    cfg.train_dataloader.batch_size = batch
    warm = min(50, max(1, iters // 10))
    cfg.param_scheduler = [
        dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=warm),
        dict(type='PolyLR', eta_min=0.0, power=0.9, begin=warm, end=iters, by_epoch=False)]
    return _common(cfg, norm, seed, iters, work_dir, f'seg_{norm}_s{seed}')


def cls_config(norm, seed, iters, batch, data_root, work_dir, tiny):
    from mmengine.config import Config
    cfg = Config.fromfile(CLS_CONFIG)
    cfg.train_dataloader.dataset.data_root = data_root
    cfg.val_dataloader.dataset.data_root = data_root
    cfg.test_dataloader = cfg.val_dataloader
    cfg.train_dataloader.batch_size = batch
    warm = min(50, max(1, iters // 10))
    cfg.param_scheduler = [
        dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=warm),
        dict(type='CosineAnnealingLR', by_epoch=False, begin=warm, end=iters, eta_min=0.0)]
    return _common(cfg, norm, seed, iters, work_dir, f'cls_{norm}_b{batch}_s{seed}')


def run_one(cfg, metric_key):
    """Train, then evaluate once; returns (metric, seconds, switch summary)."""
    from mmengine.registry import RUNNERS
    start = time.time()
    runner = RUNNERS.build(cfg)
    runner.train()
    metrics = runner.val_loop.run()
    seconds = time.time() - start
    value = next(v for k, v in metrics.items() if k.endswith(metric_key))
    return float(value), seconds, runner.normdense_switch.table()


def summarize(runs):
    groups = {}
    for r in runs:
        groups.setdefault((r['task'], r['batch'], r['norm']), []).append(r['value'])
    out = []
    for (task, batch, norm), values in groups.items():
        mean = sum(values) / len(values)
        out.append(dict(task=task, batch=batch, norm=norm, label=LABELS[norm], mean=mean, min=min(values),
                        max=max(values), seeds=len(values)))
    return out


def plot(summary, path, conditions):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    panels = sorted({(s['task'], s['batch']) for s in summary})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (task, batch) in zip(axes[0], panels):
        rows = [s for s in summary if (s['task'], s['batch']) == (task, batch)]
        xs = range(len(rows))
        means = [s['mean'] for s in rows]
        err = [[s['mean'] - s['min'] for s in rows], [s['max'] - s['mean'] for s in rows]]
        ax.bar(xs, means, yerr=err, capsize=4, color='#4c72b0')
        ax.set_xticks(list(xs), [s['label'] for s in rows], rotation=30)
        ax.set_ylabel('mIoU (%)' if task == 'seg' else 'top-1 (%)')
        ax.set_title(f"{'toy DeepLabV3' if task == 'seg' else 'toy classifier'}, batch {batch}")
    fig.suptitle(conditions, fontsize=8)
    fig.tight_layout()
    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    if args.replot:
        with open(args.out) as f:
            result = json.load(f)
        plot(result['summary'], args.plot, result['conditions'] + ('' if result.get('complete') else ' (incomplete)'))
        return result
    for norm in set(args.seg_norms.split(',')) | set(args.cls_norms.split(',')):
        if norm not in LABELS:
            raise SystemExit(f'norm_comparison.py: unknown norm {norm!r}; choose from {", ".join(LABELS)}')
    import torch
    import normdense  # noqa: F401  (registers the layers, hooks and NormSwitchRunner)
    if args.tiny:
        args.seg_iters, args.cls_iters = min(args.seg_iters, 2), min(args.cls_iters, 2)
    voc, imagenet = ensure_data(args)
    seeds = [int(s) for s in args.seeds.split(',')]
    jobs = []  # seed by seed: a run cut short still compares every norm on the seeds it finished
    for s in seeds:
        if not args.skip_seg:
            jobs += [('seg', n, s, args.seg_batch) for n in args.seg_norms.split(',')]
        if not args.skip_cls:
            jobs += [('cls', n, s, int(b)) for b in args.cls_batches.split(',') for n in args.cls_norms.split(',')]
    conditions = (f'toy DeepLabV3 {args.seg_iters} it. at batch {args.seg_batch}; toy classifier {args.cls_iters} '
                  f'it. at batch {args.cls_batches}; seeds {args.seeds}; from scratch; bars: mean, whiskers: min-max')
    result = dict(
        conditions=conditions, paper_order=PAPER_ORDER, tiny=args.tiny, complete=False,
        machine=dict(platform=platform.platform(), torch=torch.__version__, threads=torch.get_num_threads(),
                     omp_num_threads=os.environ.get('OMP_NUM_THREADS')),
        configs=dict(seg=osp.relpath(SEG_CONFIG, ROOT), cls=osp.relpath(CLS_CONFIG, ROOT)),
        summary=[], runs=[])
    runs = result['runs']
    os.makedirs(osp.dirname(osp.abspath(args.out)), exist_ok=True)
    for task, norm, seed, batch in jobs:
        work = osp.join(args.work_dir, f'{task}_{norm}_b{batch}_s{seed}')
        if task == 'seg':
            cfg = seg_config(norm, seed, args.seg_iters, batch, voc, work, args.tiny)
            value, secs, table = run_one(cfg, 'mIoU')
        else:
            cfg = cls_config(norm, seed, args.cls_iters, batch, imagenet, work, args.tiny)
            value, secs, table = run_one(cfg, 'top1')
        runs.append(dict(task=task, norm=norm, seed=seed, batch=batch, value=value, seconds=round(secs, 1),
                         iters=args.seg_iters if task == 'seg' else args.cls_iters,
                         switched=table.splitlines()[0]))
        print(f'[norm_comparison] {task} {LABELS[norm]} batch {batch} seed {seed}: {value:.2f} ({secs:.0f} s)',
              flush=True)
        result['summary'] = summary = summarize(runs)
        result['complete'] = len(runs) == len(jobs)
        with open(args.out, 'w') as f:  # after every run: a cut-short benchmark keeps what it measured
            json.dump(result, f, indent=1)
    plot(summary, args.plot, conditions)
    for s in summary:
        print(f"[norm_comparison] {s['task']} batch {s['batch']} {s['label']}: mean {s['mean']:.2f} "
              f"(min {s['min']:.2f}, max {s['max']:.2f}, {s['seeds']} seeds)")
    return result


if __name__ == '__main__':
    main()
