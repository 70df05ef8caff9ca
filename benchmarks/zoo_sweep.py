"""The norm switch on the installed mmdet / mmseg (/ mmpretrain) model zoo: one config per folder of their packaged configs,
every norm name; switch, build without pretrained weights, one training forward + backward of the feature
extractor (+ decode head) at batch 2 on random images. Each (architecture, norm) is ``ok`` or one line saying
why not (normdense.zoo). Writes JSON and a Markdown table (architecture x norm) and prints progress with ETA.

    python benchmarks/zoo_sweep.py                                  # the whole zoo, every norm (~1 h, 1 core)
    python benchmarks/zoo_sweep.py --codebases mmseg --folders unet deeplabv3plus --norms gn bcn-ws
    python benchmarks/zoo_sweep.py --codebases mmpretrain --out benchmarks/results/zoo_sweep_mmpretrain  # classifiers (head included)
"""
import argparse
import json
import os
import os.path as osp
import platform
import sys
import time
from collections import Counter

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
# offline: configs that build a text or diffusion model from a hub fail at once instead of waiting on the network
for var in ('HF_HUB_OFFLINE', 'TRANSFORMERS_OFFLINE', 'HF_DATASETS_OFFLINE'):
    os.environ.setdefault(var, '1')
sys.path.insert(0, ROOT)

from normdense.norm_switch import CHOICES  # noqa: E402
from normdense.zoo import representative_configs, sweep  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--codebases', nargs='+', default=['mmdet', 'mmseg'], choices=['mmdet', 'mmseg', 'mmpretrain'])
    p.add_argument('--norms', nargs='+', default=list(CHOICES), choices=list(CHOICES))
    p.add_argument('--folders', nargs='+', help='only these config folders (default: every folder)')
    p.add_argument('--size', type=int, default=64, help='input height and width (default 64)')
    p.add_argument('--batch', type=int, default=2)
    p.add_argument('--timeout', type=int, default=300, help='seconds per (architecture, norm) case (default 300)')
    p.add_argument('--out', default=osp.join(ROOT, 'benchmarks', 'results', 'zoo_sweep'),
                   help='output path without extension: writes OUT.json and OUT.md')
    return p.parse_args(argv)


def reason_of(line: str) -> str:
    """The category of a row: 'ok', or the text before the first ':' ('build fails', 'nothing to switch')."""
    return 'ok' if line.startswith('ok') else line.split(':')[0]


def markdown(table: dict, norms, meta: dict) -> str:
    lines = [f"# Norm switch on the model zoo ({meta['date']}, {meta['packages']})", '',
             f"One config per folder; input {meta['batch']} x 3 x {meta['size']} x {meta['size']}, one training "
             'forward + backward of the feature extractor (+ decode head), no pretrained weights, CPU.', '',
             '| codebase/folder | config | as packaged | ' + ' | '.join(norms) + ' |',
             '|---|---|---|' + '---|' * len(norms)]
    for folder, row in table.items():
        cells = [row['as packaged']] + [row[n] for n in norms]
        cells = [c.replace('|', '/') for c in cells]
        lines.append(f"| {folder} | {row['config']} | " + ' | '.join(cells) + ' |')
    counts = Counter(reason_of(row[n]) for row in table.values() for n in norms)
    lines += ['', '## Totals (architecture x norm)', ''] + [f'- {k}: {v}' for k, v in counts.most_common()]
    return '\n'.join(lines) + '\n'


def main(argv=None):
    args = parse_args(argv)
    import importlib

    import torch
    configs = []
    for codebase in args.codebases:
        configs += [(f'{codebase}/{folder}', path) for folder, path in representative_configs(codebase, args.folders)]
    if not configs:
        sys.exit(f'zoo_sweep: no config folder matches --folders {args.folders}')
    print(f'zoo_sweep: {len(configs)} architectures x {len(args.norms) + 1} (as packaged + {len(args.norms)} norms)',
          flush=True)
    table = sweep(configs, args.norms, args.size, args.batch, log=lambda s: print(s, flush=True), timeout=args.timeout)
    meta = dict(date=time.strftime('%Y-%m-%d'), size=args.size, batch=args.batch, norms=args.norms,
                packages=', '.join(f'{c} {importlib.import_module(c).__version__}' for c in args.codebases)
                + f', torch {torch.__version__}',
                machine=f'{platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}')
    os.makedirs(osp.dirname(args.out) or '.', exist_ok=True)
    with open(args.out + '.json', 'w') as f:
        json.dump(dict(meta=meta, table=table), f, indent=1)
    with open(args.out + '.md', 'w') as f:
        f.write(markdown(table, args.norms, meta))
    counts = Counter(reason_of(row[n]) for row in table.values() for n in args.norms)
    print('totals: ' + ', '.join(f'{k} {v}' for k, v in counts.most_common()))
    print(f'wrote {args.out}.json and {args.out}.md')


if __name__ == '__main__':
    main()
