#!/usr/bin/env python
"""``make demo-seg``: DeepLabV3 with BCN+WS on toy PASCAL VOC, trained on CPU at 2 images per batch.

1. writes the toy VOC set (``tools/make_toy_voc.py``) unless it is already there;
2. trains ``configs/demo/deeplabv3_r18-d8_bcn-ws_toy-voc.py`` with ``tools/train.py``;
3. evaluates the final checkpoint on toy val with ``tools/test.py`` (mmseg's IoUMetric) and dumps
   the predictions;
4. renders a PNG (image | ground truth | prediction for a few val images), recomputes the per-class
   IoU from the dumped predictions as a cross-check, and writes ``summary.json``.

Every stage runs in its own process; its wall-clock time and CPU time (user + system of the child
process, which is what the machine's other users lose) are measured and reported.

The stages run with 2 intra-op threads by default (``OMP_NUM_THREADS=2``, ``--threads``): on 2 idle
cores a training iteration of this config measured 0.09 s with 2 threads against 0.13 s with 1.
On cores shared with other jobs, use ``--threads 1``: 2 OpenMP threads per process then
oversubscribe the cores and spin-wait for each other (6.3 s of CPU per iteration with 2 threads
against 0.19 s with 1 thread on a busy machine, docs/segmentation.md). Two processes with one image each
(``--launcher pytorch``) were slower still (0.17 s per iteration: BCN's estimates and the gradients
are all-reduced every iteration). An already set ``OMP_NUM_THREADS`` wins.

    python scripts/demo_seg.py                       # what `make demo-seg` runs
    python scripts/demo_seg.py --iters 8000            # a longer schedule
    python scripts/demo_seg.py --work-dir /tmp/seg --iters 20
"""
import argparse
import glob
import json
import os
import os.path as osp
import resource
import subprocess
import sys
import time

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
CONFIG = 'configs/demo/deeplabv3_r18-d8_bcn-ws_toy-voc.py'
DATA_ROOT = 'data/toy_voc/VOCdevkit/VOC2012'
# what the toy classes are called by mmseg (VOC labels 0-5) and what they are
CLASS_NAMES = ('background', 'aeroplane', 'bicycle', 'bird', 'boat', 'bottle')
SHAPE_NAMES = ('background', 'circle', 'rectangle', 'ring', 'star', 'triangle')
TARGET_MIOU = 50.0  # percent, as mmseg reports it
TIME_LIMIT_S = 600.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--config', default=CONFIG)
    p.add_argument('--work-dir', default='work_dirs/demo_seg')
    p.add_argument('--num-show', type=int, default=6, help='val images in the PNG (default: %(default)s)')
    p.add_argument('--png', help='where to write the PNG (default: WORK_DIR/predictions.png)')
    p.add_argument('--iters', type=int,
                   help='train this many iterations instead of the config\'s 5000 (the poly schedule, '
                        'validation and checkpoint follow); docs/segmentation.md has measured values')
    p.add_argument('--threads', type=int, default=2,
                   help='OMP_NUM_THREADS / MKL_NUM_THREADS of the stages unless already set (default: 2; '
                        '1 on cores shared with other jobs)')
    p.add_argument('--cfg-options', nargs='+', default=[],
                   help='passed to tools/train.py and tools/test.py (e.g. train_cfg.max_iters=20)')
    return p.parse_args(argv)


def run_stage(name, cmd, timings, env=None):
    """Run ``cmd`` from the repository root; record its wall time and the child's CPU time."""
    print(f'\n=== {name}: {" ".join(cmd)}', flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    timings[name] = dict(wall_s=round(wall, 1), cpu_s=round(cpu, 1))
    print(f'=== {name}: {wall:.1f} s wall, {cpu:.1f} s CPU', flush=True)


def latest_test_metrics(test_work_dir):
    """The metrics tools/test.py logged (mmengine writes <work_dir>/<timestamp>/<timestamp>.json)."""
    logs = sorted(glob.glob(osp.join(test_work_dir, '*', '*.json')), key=osp.getmtime)
    if not logs:
        raise FileNotFoundError(f'no test metrics json under {test_work_dir}')
    with open(logs[-1]) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return lines[-1]


def load_predictions(pkl_path):
    """(img_path, gt (H, W) int array, pred (H, W) int array) per image from tools/test.py --out."""
    import numpy as np
    from mmengine.fileio import load
    out = []
    for r in load(pkl_path):
        gt = np.asarray(r['gt_sem_seg']['data']).squeeze(0).astype(np.int64)
        pred = np.asarray(r['pred_sem_seg']['data']).squeeze(0).astype(np.int64)
        out.append((r['img_path'], gt, pred))
    return out


def per_class_iou(predictions, num_classes, ignore_index=255):
    """Per-class IoU (percent) over the whole set from the dumped predictions, with mmseg's own
    ``IoUMetric.intersect_and_union`` (tools/test.py logs the per-class table but returns only the
    aggregates); classes absent from both ground truth and prediction are NaN, as in IoUMetric."""
    import numpy as np
    import torch
    from mmseg.evaluation.metrics import IoUMetric
    inter = union = 0
    for _, gt, pred in predictions:
        i, u, _, _ = IoUMetric.intersect_and_union(torch.from_numpy(pred), torch.from_numpy(gt), num_classes,
                                                  ignore_index)
        inter, union = inter + i.double(), union + u.double()
    with np.errstate(invalid='ignore', divide='ignore'):
        return 100.0 * inter.numpy() / union.numpy()


def render_predictions(predictions, out_png, num_show=6, title=None):
    """Rows of image | ground truth | prediction (VOC colour map) with a class legend."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Patch
    from PIL import Image

    from normdense.data.writers import voc_palette
    palette = np.array(voc_palette()[:3 * 256], dtype=np.uint8).reshape(256, 3)
    palette[255] = (255, 255, 255)  # ignore label

    rows = predictions[:num_show]
    fig, axes = plt.subplots(len(rows), 3, figsize=(7.2, 2.4 * len(rows) + 0.6), squeeze=False)
    for r, (img_path, gt, pred) in enumerate(rows):
        image = np.asarray(Image.open(img_path).convert('RGB'))
        acc = float(np.mean(pred[gt != 255] == gt[gt != 255])) * 100
        panels = ((image, osp.basename(img_path)), (palette[gt], 'ground truth'),
                  (palette[pred], f'prediction ({acc:.0f}% px)'))
        for c, (panel, label) in enumerate(panels):
            ax = axes[r][c]
            ax.imshow(panel, interpolation='nearest')
            ax.set_title(label, fontsize=8)
            ax.axis('off')
    handles = [Patch(color=palette[i] / 255.0, label=f'{i} {SHAPE_NAMES[i]} ({CLASS_NAMES[i]})')
               for i in range(len(SHAPE_NAMES))]
    fig.legend(handles=handles, loc='lower center', ncol=3, fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97 if title else 1))
    os.makedirs(osp.dirname(osp.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def main(argv=None):
    args = parse_args(argv)
    os.chdir(ROOT)
    sys.path.insert(0, ROOT)
    py = sys.executable
    work_dir = args.work_dir
    test_dir = osp.join(work_dir, 'test')
    pkl = osp.join(test_dir, 'predictions.pkl')
    png = args.png or osp.join(work_dir, 'predictions.png')
    options = list(args.cfg_options)
    if args.iters:
        n = args.iters
        warmup = min(50, max(1, n // 10))  # the config warms up for 50 of its 5000 iterations
        options += [f'train_cfg.max_iters={n}', f'train_cfg.val_interval={n}',
                    f'default_hooks.checkpoint.interval={n}', f'param_scheduler.0.end={warmup}',
                    f'param_scheduler.1.begin={warmup}', f'param_scheduler.1.end={n}']
    cfg_opts = ['--cfg-options', *options] if options else []
    timings = {}
    total_start = time.perf_counter()
    env = dict(os.environ)
    for var in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS'):
        env.setdefault(var, str(args.threads))
    print(f'OMP_NUM_THREADS={env["OMP_NUM_THREADS"]}, load average {os.getloadavg()[0]:.1f} '
          f'on {os.cpu_count()} cores')
    load_before = os.getloadavg()[0]

    if osp.isfile(osp.join(DATA_ROOT, 'ImageSets', 'Segmentation', 'val.txt')):
        print(f'toy VOC found in {DATA_ROOT}')
    else:
        run_stage('make_toy_voc', [py, 'tools/make_toy_voc.py'], timings, env)

    run_stage('train', [py, 'tools/train.py', args.config, '--work-dir', work_dir, *cfg_opts], timings, env)
    with open(osp.join(work_dir, 'last_checkpoint')) as f:
        checkpoint = f.read().strip()
    run_stage('test', [py, 'tools/test.py', args.config, checkpoint, '--work-dir', test_dir,
                       '--out', pkl, *cfg_opts], timings, env)
    metrics = latest_test_metrics(test_dir)

    start = time.perf_counter()
    cpu0 = time.process_time()
    predictions = load_predictions(pkl)
    ious = per_class_iou(predictions, len(CLASS_NAMES))
    import numpy as np
    miou_check = float(np.nanmean(ious))
    render_predictions(predictions, png, args.num_show,
                       title=f'DeepLabV3 R-18-d8 BCN+WS, toy VOC val: mIoU {metrics["mIoU"]:.1f}')
    timings['render'] = dict(wall_s=round(time.perf_counter() - start, 1),
                             cpu_s=round(time.process_time() - cpu0, 1))
    total_wall = time.perf_counter() - total_start
    total_cpu = sum(t['cpu_s'] for t in timings.values())

    summary = dict(
        config=args.config, checkpoint=checkpoint, num_val_images=len(predictions),
        mIoU=metrics['mIoU'], aAcc=metrics.get('aAcc'), mAcc=metrics.get('mAcc'),
        mIoU_recomputed=round(miou_check, 2),
        per_class_IoU={f'{n} ({s})': round(float(v), 2) for n, s, v in zip(CLASS_NAMES, SHAPE_NAMES, ious)},
        target_mIoU=TARGET_MIOU, target_met=bool(metrics['mIoU'] >= TARGET_MIOU),
        timings=timings, total_wall_s=round(total_wall, 1), total_cpu_s=round(total_cpu, 1),
        png=png, cfg_options=options, omp_num_threads=env['OMP_NUM_THREADS'],
        load_average_start=round(load_before, 2), load_average_end=round(os.getloadavg()[0], 2))
    with open(osp.join(work_dir, 'summary.json'), 'w') as f:
        json.dump(summary, f, indent=2)

    print('\n| class (VOC name) | IoU % |\n| --- | --- |')
    for name, value in summary['per_class_IoU'].items():
        print(f'| {name} | {value:.2f} |')
    print(f'\nmIoU (tools/test.py, IoUMetric): {metrics["mIoU"]:.2f}  (recomputed from the dumped '
          f'predictions: {miou_check:.2f}; target >= {TARGET_MIOU:.0f}: '
          f'{"met" if summary["target_met"] else "NOT met"})')
    print('| stage | wall s | CPU s |\n| --- | --- | --- |')
    for name, t in timings.items():
        print(f'| {name} | {t["wall_s"]} | {t["cpu_s"]} |')
    print(f'| total | {total_wall:.1f} | {total_cpu:.1f} |')
    print(f'PNG: {png}\nsummary: {osp.join(work_dir, "summary.json")}')
    if total_wall > TIME_LIMIT_S:
        print(f'WARNING: took {total_wall:.0f} s, over the {TIME_LIMIT_S:.0f} s budget '
              '(a busy machine? compare the CPU times)')
    return summary


if __name__ == '__main__':
    main()
