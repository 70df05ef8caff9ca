"""Host cost of one training call of each StatNorm layer: time per forward+backward on a tiny tensor (2x64x4x4:
its compute is negligible, so the time is what the host spends dispatching), Python calls per forward+backward
(cProfile, builtins included: deterministic) and launches, against nn.GroupNorm and nn.BatchNorm2d on the same
tensor. On a GPU the host is what a detection step waits on at small maps (the first GPU run measured P2 and P3
alike, docs/gpu.md).

    python benchmarks/host.py                      # CPU: Triton's launches stubbed; benchmarks/results/host_cpu.*
    python benchmarks/host.py --device cuda        # GPU: real launches, N calls then one synchronize
    python benchmarks/host.py --quick              # a few rounds: the code path only

Rows: BCN estimate and batch, GN+PN with one activation of each family, Unitization batch and estimate, each on
``backend='triton'`` and ``backend='aten'``; IterNorm against nn.GroupNorm and WSConv2d against nn.Conv2d without a
target; ``autograd.Function floor``: one custom Function with BCN's parameters that does nothing (what autograd,
the output and the gradients alone cost). Two forms of the step, timed interleaved round by round (medians): ``sum``, ``layer(x).sum().backward()``
(the form the host-path issue measured), and ``dy``, ``layer(x).backward(dy)`` with the gradients set to None
after it (a training loop's: a contiguous dy, no accumulation).

On a machine without a GPU the Triton backend runs on CPU tensors with Triton's interpreter, and every launch is
stubbed at one point, ``normdense.kernels.launch.stub_launches``: the compiled kernel's launcher is a no-op (a C
builtin that ignores its arguments, as cheap to call as a real launcher's entry), so everything above the driver
call is measured (the launch cache's lookup included), nothing below.

Targets (the Triton rows, ``sum`` form): <= 2.0x nn.GroupNorm's time and <= 200 Python calls per forward+backward.
"""
import argparse
import cProfile
import json
import os
import os.path as osp
import pstats
import statistics
import sys
import timeit

if __name__ == '__main__':
    import importlib.util
    if not all(importlib.util.find_spec(m) for m in ('mmengine', 'mmcv')):
        os.environ.setdefault('NORMDENSE_LAYERS_ONLY', '1')  # a torch-only machine: the layers need neither
    if '--device' not in sys.argv or 'cpu' in sys.argv:
        os.environ.setdefault('TRITON_INTERPRET', '1')  # read when the kernels are defined: before any import

import contextlib  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

sys.path.insert(0, osp.join(osp.dirname(osp.abspath(__file__)), '..'))
from benchmarks._timing import conditions  # noqa: E402

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
SHAPE = (2, 64, 4, 4)
GROUPS = 8
# one activation of each family: piecewise linear, with a slope parameter, exponential, the erf/sigmoid-based
# smooth ones, softplus, piecewise polynomial, saturating
ACTIVATIONS = ('relu', 'leaky_relu', 'elu', 'gelu', 'silu', 'softplus', 'hardswish', 'tanh')
MAX_VS_GN, MAX_CALLS = 2.0, 200
GN, BN = 'nn.GroupNorm', 'nn.BatchNorm2d'


def engine_layers(c=SHAPE[1], groups=GROUPS):
    """{name: factory(backend)} of every engine layer and mode."""
    from normdense.layers.bcn import BatchChannelNorm2d
    from normdense.layers.proxy_norm import GroupProxyNorm
    from normdense.layers.unitization import Unitization2d
    rows = {'BCN estimate': lambda be: BatchChannelNorm2d(c, groups, mode='estimate', update_rate=0.01, backend=be),
            'BCN batch': lambda be: BatchChannelNorm2d(c, groups, mode='batch', backend=be)}
    for act in ACTIVATIONS:
        rows[f'GN+PN {act}'] = lambda be, act=act: GroupProxyNorm(c, groups, act=act, backend=be)
    rows['Unitization batch'] = lambda be: Unitization2d(c, backend=be)
    rows['Unitization estimate'] = lambda be: Unitization2d(c, mode='estimate', update_rate=0.01, backend=be)
    return rows


class _NoWork(torch.autograd.Function):
    """x and the parameters in, an uninitialized output; in backward, uninitialized gradients: nothing else."""

    @staticmethod
    def forward(ctx, x, *params):
        ctx.save_for_backward(x, *params)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        return tuple(torch.empty_like(t) for t in ctx.saved_tensors)


class FunctionFloor(nn.Module):
    """The floor under any layer written as one custom autograd Function with BCN's four parameters (C, C, G, G),
    called through its C apply as the engine does: what autograd, the output and the gradients cost with no work
    and no launch. The 2.0x target leaves the
    engine the difference between 2.0x nn.GroupNorm and this row."""

    def __init__(self, c=SHAPE[1], groups=GROUPS):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c))
        self.gw, self.gb = nn.Parameter(torch.ones(groups)), nn.Parameter(torch.zeros(groups))

    def forward(self, x):
        return _no_work(x, self.w, self.b, self.gw, self.gb)


_no_work = super(torch.autograd.Function, _NoWork).apply  # the C apply, as the engine calls its Function


def other_layers(c=SHAPE[1], groups=GROUPS):
    """{name: (factory, baseline name)} reported without a target."""
    from normdense.layers.iternorm import IterNorm
    from normdense.layers.ws import WSConv2d
    return {'autograd.Function floor': (lambda: FunctionFloor(c, groups), GN),
            'IterNorm': (lambda: IterNorm(c, group_size=c // groups), GN),
            'WSConv2d 3x3': (lambda: WSConv2d(c, c, 3, padding=1), 'nn.Conv2d 3x3')}


def triton_problem(device) -> str:
    """Why the Triton backend cannot run here (one line), or ''."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return 'triton is not installed'
    if device == 'cpu' and os.environ.get('TRITON_INTERPRET') != '1':
        return 'Triton runs CPU tensors only under TRITON_INTERPRET=1 (set before anything imports triton)'
    return ''


def steps(module, x, dy):
    """(the ``sum`` step, the ``dy`` step) of ``module`` on x."""
    params = [p for p in module.parameters() if p.requires_grad]

    def sum_step():
        module(x).sum().backward()

    def dy_step():
        module(x).backward(dy)
        x.grad = None
        for p in params:
            p.grad = None
    return sum_step, dy_step


def python_calls(step) -> int:
    """Python calls (builtins included) of one ``step()``, by cProfile: deterministic."""
    profile = cProfile.Profile()
    profile.enable()
    step()
    profile.disable()
    return pstats.Stats(profile).total_calls


def launches(step) -> dict:
    """Triton launches and ATen operators (no views, no allocations) of one ``step()``."""
    from benchmarks._launches import count_triton_launches
    from benchmarks._timing import count_ops
    return dict(triton=count_triton_launches(step), aten_ops=count_ops(step))


def timer(step, device, number):
    """Seconds per call of ``number`` back-to-back calls (one synchronize at the end on CUDA)."""
    if device == 'cuda':
        def run():
            for _ in range(number):
                step()
            torch.cuda.synchronize()
        return lambda: timeit.timeit(run, number=1) / number
    return lambda: timeit.timeit(step, number=number) / number


def measure(rows, device, rounds, number, warmup=20):
    """{name: {form: median seconds}} of ``rows`` ({name: (sum step, dy step)}), interleaved round by round."""
    timers = {name: {form: timer(step, device, number) for form, step in zip(('sum', 'dy'), pair)}
              for name, pair in rows.items()}
    for pair in rows.values():
        for step in pair:
            for _ in range(warmup):
                step()
    samples = {name: {'sum': [], 'dy': []} for name in rows}
    for _ in range(rounds):
        for name, forms in timers.items():
            for form, t in forms.items():
                samples[name][form].append(t())
    return {name: {form: statistics.median(v) for form, v in forms.items()} for name, forms in samples.items()}


def run(device='cpu', rounds=15, number=100, backends=('triton', 'aten'), warmup=20):
    from normdense.kernels.launch import stub_launches
    torch.manual_seed(0)
    x = torch.randn(*SHAPE, device=device, requires_grad=True)
    dy = torch.randn(*SHAPE, device=device)
    problem = triton_problem(device)
    backends = [b for b in backends if b != 'triton' or not problem]
    modules = {GN: nn.GroupNorm(GROUPS, SHAPE[1]), BN: nn.BatchNorm2d(SHAPE[1]),
               'nn.Conv2d 3x3': nn.Conv2d(SHAPE[1], SHAPE[1], 3, padding=1)}
    targets = {}
    for name, factory in engine_layers().items():
        for be in backends:
            modules[f'{name} [{be}]'] = factory(be)
            targets[f'{name} [{be}]'] = be == 'triton'
    baselines = {GN: GN, BN: BN, 'nn.Conv2d 3x3': 'nn.Conv2d 3x3'}
    for name, (factory, base) in other_layers().items():
        modules[name], baselines[name] = factory(), base
    for name in modules:
        modules[name] = modules[name].to(device).train()
        baselines.setdefault(name, GN)
    stub = stub_launches() if device == 'cpu' and 'triton' in backends else contextlib.nullcontext()
    with stub:
        pairs = {name: steps(m, x, dy) for name, m in modules.items()}
        times = measure(pairs, device, rounds, number, warmup)
        counted = {name: dict(python_calls=python_calls(pairs[name][0]), **launches(pairs[name][0]))
                   for name in modules}
    results = []
    for name in modules:
        base = baselines[name]
        row = dict(name=name, baseline=base, **counted[name])
        for form in ('sum', 'dy'):
            row[f'{form}_us'] = times[name][form] * 1e6
            for tag, other in (('gn', GN), ('bn', BN), ('baseline', base)):
                row[f'{form}_vs_{tag}'] = times[name][form] / times[other][form]
        if targets.get(name):
            row['target'] = ('PASS' if row['sum_vs_gn'] <= MAX_VS_GN and row['python_calls'] <= MAX_CALLS
                             else 'FAIL')
        results.append(row)
    return dict(device=device, shape=list(SHAPE), rounds=rounds, number=number,
                launches_stubbed=device == 'cpu' and 'triton' in backends, triton_problem=problem or None,
                targets=dict(max_vs_gn=MAX_VS_GN, max_python_calls=MAX_CALLS, form='sum', rows='backend triton'),
                conditions=dict(conditions(1), device=_device_name(device), triton=_triton_version()),
                results=results)


def _device_name(device) -> str:
    import platform
    return torch.cuda.get_device_name() if device == 'cuda' else (platform.processor() or platform.machine())


def _triton_version():
    try:
        import triton
        return triton.__version__
    except ImportError:
        return None


def markdown(data) -> str:
    lines = [f"Host cost per training call, {data['device']} ({data['conditions'].get('device', '')}), "
             f"x {tuple(data['shape'])}; medians of {data['rounds']} interleaved rounds of {data['number']} calls"
             + ('; Triton launches stubbed (normdense.kernels.launch.stub_launches)' if data['launches_stubbed']
                else ''), '',
             '| layer | sum step (us) | x GN | x BN | dy step (us) | x GN | Python calls | Triton launches | ATen ops '
             '| target |', '|---|---|---|---|---|---|---|---|---|---|']
    for r in data['results']:
        base = r['baseline']
        vs = f"{r['sum_vs_gn']:.2f}" + ('' if base in (GN, BN) else f" ({r['sum_vs_baseline']:.2f}x {base})")
        lines.append(f"| {r['name']} | {r['sum_us']:.0f} | {vs} | {r['sum_vs_bn']:.2f} | {r['dy_us']:.0f} | "
                     f"{r['dy_vs_gn']:.2f} | {r['python_calls']} | {r['triton']} | {r['aten_ops']} | "
                     f"{r.get('target', '')} |")
    return '\n'.join(lines) + '\n'


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--device', default='cpu', choices=('cpu', 'cuda'))
    parser.add_argument('--rounds', type=int, default=None, help='interleaved timed rounds (default 15; 3 quick)')
    parser.add_argument('--number', type=int, default=None, help='calls per timing (default 100; 10 quick)')
    parser.add_argument('--quick', action='store_true', help='a few rounds: the code path only')
    parser.add_argument('--backends', default='triton,aten')
    parser.add_argument('--out', default=None, help='JSON (default benchmarks/results/host_<device>.json)')
    parser.add_argument('--md', default=None, help='markdown (default: the JSON path with .md)')
    args = parser.parse_args(argv)
    if args.device == 'cuda' and not torch.cuda.is_available():
        raise SystemExit('--device cuda: torch sees no CUDA device (use --device cpu: launches stubbed)')
    torch.set_num_threads(1)  # the host path is single-threaded; the baselines too
    data = run(args.device, args.rounds or (3 if args.quick else 15), args.number or (10 if args.quick else 100),
               tuple(args.backends.split(',')), 2 if args.quick else 20)
    out = args.out or osp.join(ROOT, 'benchmarks', 'results', f'host_{args.device}.json')
    md = args.md or osp.splitext(out)[0] + '.md'
    os.makedirs(osp.dirname(osp.abspath(out)), exist_ok=True)
    with open(out, 'w') as f:
        json.dump(data, f, indent=1)
    text = markdown(data)
    with open(md, 'w') as f:
        f.write(text)
    print(text)
    print(f'wrote {out} and {md}')
    if data['triton_problem']:
        print(f"backend='triton' not measured: {data['triton_problem']}")


if __name__ == '__main__':
    main()
