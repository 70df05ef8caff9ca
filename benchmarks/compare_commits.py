"""A/B of two checkouts: one fwd+bwd training step of BCN / GN+PN / Unitization against nn.GroupNorm(32, C),
each checkout in its own worker process, timed side by side in one run.

    python benchmarks/compare_commits.py --a ../normdense-old --b . --out /tmp/ab
    python benchmarks/compare_commits.py --a OLD --b NEW --rounds 9 --shapes 2x256x64x64 --threads 2 \
        --malloc retain --out /tmp/ab          # writes /tmp/ab.json and /tmp/ab.md

Each checkout (a directory holding ``normdense/``) runs in a worker subprocess of this script with cwd and
PYTHONPATH set to it (the worker checks that ``normdense`` was imported from there) and
``torch.set_num_threads(--threads)``; both workers build the same rows from the same seeded x and dy:
``BCN estimate`` (update_rate 0.01), ``BCN batch``, ``GNPN (GN+PN)``, ``Unitization batch``,
``Unitization estimate`` (update_rate 0.01) and ``nn.GroupNorm(32)``, all in training mode. One step is
``x.grad = None; layer(x).backward(dy)``. A round is one timed step of every row in one worker (the starting
row rotating, as ``_timing.interleaved_times``); rounds alternate A, B, A, B, ... so both checkouts see the
same machine state, after 2 warm-up steps per row (``--order abba``: B first in odd rounds). Per row and
checkout: the median time, and the median over rounds of the ratio to nn.GroupNorm timed in the same round of
the same process; ``B/A`` is the quotient of the two median ratios (> 1: B slower against GroupNorm). ``ops``
are ATen ops per step (``_timing.count_ops``), ``faults`` the median minor page faults per step.

``--malloc retain`` starts the workers with glibc keeping freed memory (``_timing.RETAIN_MALLOC_ENV``): on this
CPU a re-allocated activation page-faults on first touch with the default allocator, which costs more than
the pass filling it and depends on what ran before; 'default' keeps glibc's behaviour (both are worth a run).
The machine may be shared: read the numbers with the load average recorded in the output.
"""
import argparse
import json
import os
import os.path as osp
import statistics
import subprocess
import sys
import time

HERE = osp.dirname(osp.abspath(__file__))
GN = 'nn.GroupNorm(32)'
ROWS = ('BCN estimate', 'BCN batch', 'GNPN (GN+PN)', 'Unitization batch', 'Unitization estimate', GN)
DEFAULT_SHAPES = ('2x256x64x64', '1x256x100x168')


# --- worker: one checkout ------------------------------------------------------------------------------------
def build_rows(c):
    import torch.nn as nn
    from normdense.layers.bcn import BatchChannelNorm2d
    from normdense.layers.proxy_norm import GroupProxyNorm
    from normdense.layers.unitization import Unitization2d
    return {'BCN estimate': BatchChannelNorm2d(c, 32, mode='estimate', update_rate=0.01),
            'BCN batch': BatchChannelNorm2d(c, 32, mode='batch'),
            'GNPN (GN+PN)': GroupProxyNorm(c, 32),
            'Unitization batch': Unitization2d(c),
            'Unitization estimate': Unitization2d(c, mode='estimate', update_rate=0.01),
            GN: nn.GroupNorm(32, c)}


def worker(checkout, threads):
    import torch
    sys.path.insert(0, HERE)  # this script's _timing, whatever the checkout holds
    from _timing import count_ops, malloc_mode, minor_faults
    import normdense
    if not osp.abspath(normdense.__file__).startswith(osp.join(osp.abspath(checkout), '')):
        raise SystemExit(f'normdense imported from {normdense.__file__}, not from {checkout}')
    torch.set_num_threads(threads)
    steps = {}
    send = sys.stdout
    for line in sys.stdin:
        req = json.loads(line)
        if req['cmd'] == 'setup':  # one shape: rows built, warmed up, ops counted
            torch.manual_seed(0)
            shape = req['shape']
            x = torch.randn(*shape, requires_grad=True)
            dy = torch.randn(*shape)
            steps.clear()
            for name, mod in build_rows(shape[1]).items():
                mod.train()

                def step(mod=mod):
                    x.grad = None
                    mod(x).backward(dy)
                steps[name] = step
            for _ in range(2):
                for s in steps.values():
                    s()
            reply = dict(ops={n: count_ops(s) for n, s in steps.items()},
                         file=osp.relpath(normdense.__file__, checkout), malloc=malloc_mode(),
                         threads=torch.get_num_threads())
        else:  # one round: every row once, starting at row k
            names = list(steps)
            k = req['round'] % len(names)
            reply = {}
            for n in names[k:] + names[:k]:
                f0 = minor_faults()
                t0 = time.perf_counter()
                steps[n]()
                reply[n] = (time.perf_counter() - t0, minor_faults() - f0)
        send.write(json.dumps(reply) + '\n')
        send.flush()


# --- driver --------------------------------------------------------------------------------------------------
class Worker:
    def __init__(self, checkout, threads, malloc):
        sys.path.insert(0, HERE)
        from _timing import RETAIN_MALLOC_ENV
        env = dict(os.environ, PYTHONPATH=checkout, OMP_NUM_THREADS=str(threads))
        if malloc == 'retain':
            env.update(RETAIN_MALLOC_ENV)
        self.proc = subprocess.Popen([sys.executable, osp.abspath(__file__), '--worker', checkout,
                                      '--threads', str(threads)], cwd=checkout, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def ask(self, **req):
        self.proc.stdin.write(json.dumps(req) + '\n')
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f'worker exited with {self.proc.wait()}')
        return json.loads(line)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def commit_of(d):
    try:
        return subprocess.run(['git', '-C', d, 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True,
                              check=True).stdout.strip() + (' (dirty)' if subprocess.run(
                                  ['git', '-C', d, 'status', '--porcelain', '--', 'normdense'],
                                  capture_output=True, text=True).stdout.strip() else '')
    except (OSError, subprocess.CalledProcessError):
        return '?'


def setting(workers, shape, rounds, order='ab'):
    info = {k: w.ask(cmd='setup', shape=shape) for k, w in workers.items()}
    raw = {k: [] for k in workers}
    for r in range(rounds):
        keys = ('b', 'a') if order == 'abba' and r % 2 else ('a', 'b')  # A, B, A, B, ... (or A B B A A B)
        for k in keys:
            raw[k].append(workers[k].ask(cmd='round', round=r))
    out = {}
    for name in ROWS:
        row = {}
        for k in workers:
            t = [rd[name][0] for rd in raw[k]]
            ratios = [rd[name][0] / rd[GN][0] for rd in raw[k]]
            row[k] = dict(time_ms=statistics.median(t) * 1e3, ratio_vs_gn=statistics.median(ratios),
                          ratio_min=min(ratios), ratio_max=max(ratios), ops=info[k]['ops'][name],
                          faults=int(statistics.median(rd[name][1] for rd in raw[k])))
        row['b_over_a'] = row['b']['ratio_vs_gn'] / row['a']['ratio_vs_gn']
        row['b_over_a_time'] = row['b']['time_ms'] / row['a']['time_ms']
        out[name] = row
    return out, info


def markdown(res):
    lines = [f"A = {res['a']} ({res['commit_a']}), B = {res['b']} ({res['commit_b']}); {res['threads']} threads, "
             f"malloc {res['malloc']}, {res['rounds']} rounds, loadavg {res['loadavg_start']} -> "
             f"{res['loadavg_end']} (shared machine: timings are noisy)", '']
    for key, rows in res['settings'].items():
        lines += [f'### {key}', '', '| layer | A ms | B ms | A /GN | B /GN | B/A (ratio) | A ops | B ops | '
                  'A faults | B faults |', '|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|']
        for name, r in rows.items():
            a, b = r['a'], r['b']
            lines.append(f"| {name} | {a['time_ms']:.2f} | {b['time_ms']:.2f} | {a['ratio_vs_gn']:.2f} | "
                         f"{b['ratio_vs_gn']:.2f} | {r['b_over_a']:.3f} | {a['ops']} | {b['ops']} | "
                         f"{a['faults']} | {b['faults']} |")
        lines.append('')
    return '\n'.join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--a', help='checkout directory A (e.g. the old commit)')
    p.add_argument('--b', help='checkout directory B')
    p.add_argument('--shapes', nargs='+', default=list(DEFAULT_SHAPES))
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--rounds', type=int, default=9)
    p.add_argument('--malloc', choices=('default', 'retain'), default='default')
    p.add_argument('--order', choices=('ab', 'abba'), default='ab',
                   help="'abba': B runs first in odd rounds (cancels a bias of running first in a round)")
    p.add_argument('--out', default='/tmp/compare_commits', help='writes OUT.json and OUT.md')
    p.add_argument('--worker', help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.threads)
    if not (args.a and args.b):
        p.error('--a and --b are required')
    dirs = {'a': osp.abspath(args.a), 'b': osp.abspath(args.b)}
    shapes = [[int(s) for s in sh.split('x')] for sh in args.shapes]
    res = dict(a=osp.basename(dirs['a']), b=osp.basename(dirs['b']), commit_a=commit_of(dirs['a']), commit_b=commit_of(dirs['b']),
               threads=args.threads, malloc=args.malloc, rounds=args.rounds, order=args.order,
               loadavg_start=[round(v, 2) for v in os.getloadavg()], settings={})
    workers = {k: Worker(d, args.threads, args.malloc) for k, d in dirs.items()}
    try:
        for sh in shapes:
            key = f"{args.threads}thr {'x'.join(map(str, sh))}"
            res['settings'][key], info = setting(workers, sh, args.rounds, args.order)
            res.setdefault('workers', {})[key] = {k: {n: v for n, v in i.items() if n != 'ops'}
                                                  for k, i in info.items()}
            print(f'{key} done', file=sys.stderr)
    finally:
        for w in workers.values():
            w.close()
    res['loadavg_end'] = [round(v, 2) for v in os.getloadavg()]
    md = markdown(res)
    base = args.out[:-5] if args.out.endswith('.json') else args.out
    os.makedirs(osp.dirname(osp.abspath(base)) or '.', exist_ok=True)
    with open(base + '.json', 'w') as f:
        json.dump(res, f, indent=1)
    with open(base + '.md', 'w') as f:
        f.write(md + '\n')
    print(md)
    print(f'wrote {base}.json and {base}.md')


if __name__ == '__main__':
    main()
