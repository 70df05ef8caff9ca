"""Where a Triton input gradient leaves float64 (issue 52: GN+PN relu, P3, fp16): the program
scripts/gpu_check.sh runs first.

    PYTHONPATH=. python scripts/gpu_grad_diag.py OUT_DIR         # on a GPU; writes grad_diag.json, grad_diag.pt

For each case (layer, FPN level, dtype, data source) it takes the three training steps of
tests/cuda/test_triton_cuda.py (the same layers, data and tolerance) and records, per step and for the input
gradient: Triton's and ATen's error from float64 (relative to the gradient's scale), how many elements exceed the
test's bound, and the worst elements: position (n, c, h, w), x, dy, the three gradients and the float64
pre-activation z = GN(x) there (for relu, |z| below float32's rounding means a kink: a subgradient choice, not
a wrong map). Each case's first step is run twice more on the same tensors: are the kernels deterministic?
The worst case's group (the (n, group) slice of x and dy, all GN+PN needs for dx) is saved with the layer's
state, so the CPU interpreter can replay it.

Data sources: 'cuda' (torch's CUDA generator, as the test), 'cpu' (the CPU generator, moved: the same numbers
on every machine, so the CPU interpreter can run the identical case).
"""
import importlib.util
import json
import os
import sys
import time

if not all(importlib.util.find_spec(m) for m in ('mmengine', 'mmcv')):
    os.environ.setdefault('NORMDENSE_LAYERS_ONLY', '1')

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from tests.cuda.test_triton_cuda import (DTYPES, LAYERS, LEVELS, STEPS, _build, _step, _tolerance,  # noqa: E402
                                         near_kinks, off_kinks, pre_activation)

CASES = [  # (layer, level, dtype, source, seed[, kinks]): the failing one first (as drawn and as the test now draws
    # it: off the kinks), then its neighbours; cpu:8 holds an element at |z| = 3e-10 (ATen's CPU path flips it)
    ('GNPN-relu', 'P3', 'fp16', 'cuda', 1), ('GNPN-relu', 'P3', 'fp16', 'cuda', 1, 'off'),
    ('GNPN-relu', 'P3', 'fp16', 'cpu', 8),
    ('GNPN-relu', 'P3', 'fp16', 'cuda', 2),
    ('GNPN-relu', 'P4', 'fp16', 'cuda', 1), ('GNPN-relu', 'P2', 'fp16', 'cuda', 1),
    ('GNPN-relu', 'P3', 'bf16', 'cuda', 1), ('GNPN-relu', 'P3', 'fp32', 'cuda', 1),
    ('GNPN-gelu', 'P3', 'fp16', 'cuda', 1),
]
TOP = 8


def _data(shape, dtype, source, seed, device, ref=None, steps=STEPS):
    gen = torch.Generator(device=source).manual_seed(seed)
    for _ in range(steps):
        x = (torch.randn(shape, generator=gen, device=source) * 2 + 0.5).to(dtype).to(device)
        dy = torch.randn(shape, generator=gen, device=source).to(dtype).to(device)
        yield (x if ref is None else off_kinks(ref, x)), dy


def run_case(name, level, dname, source, seed, kinks='as drawn', device='cuda', n_steps=STEPS, repeats=2):
    shape, dtype = LEVELS[level], DTYPES[dname]
    triton, aten, ref = _build(LAYERS[name], device)
    steps, worst = [], None
    data = _data(shape, dtype, source, seed, device, ref if kinks == 'off' else None, n_steps)
    for i, (x, dy) in enumerate(data):
        state = {k: v.detach().cpu().clone() for k, v in triton.state_dict().items()}
        got, at, r = _step(triton, x, dy), _step(aten, x, dy), _step(ref, x.double(), dy.double())
        g, a, rr = got['input gradient'].double(), at['input gradient'].double(), r['input gradient']
        scale = float(rr.abs().max())
        err_t, err_a = (g - rr).abs() / scale, (a - rr).abs() / scale
        bound = 2 * float(err_a.max()) + _tolerance(got['input gradient'])
        z = pre_activation(ref, x) if hasattr(ref, 'proxy_gamma') else None  # GN+PN layers
        vals, idx = err_t.flatten().topk(TOP)
        top = []
        for v, j in zip(vals.tolist(), idx.tolist()):
            pos = torch.unravel_index(torch.tensor(j), shape)
            pos = tuple(int(p) for p in pos)
            top.append(dict(pos=pos, err=v, x=float(x[pos]), dy=float(dy[pos]), triton=float(g[pos]),
                            aten=float(a[pos]), float64=float(rr[pos]),
                            z64=None if z is None else float(z[pos])))
        row = dict(step=i, scale=scale, triton=float(err_t.max()), aten=float(err_a.max()), bound=bound,
                   above_bound=int((err_t > bound).sum()), numel=g.numel(), top=top)
        if z is not None:  # how close to the kink the data come, and what float32 makes of them
            row['min_abs_z64'] = float(z.abs().min())
            row['elements_with_abs_z64_below_1e-6'] = int((z.abs() < 1e-6).sum())
        found = near_kinks(ref, x)
        if found is not None:  # the worst element within the comparison's kink band (tests/cuda/test_triton_cuda.py)?
            row['near_kink_elements'] = int(found[0].sum())
            row['worst_near_kink'] = bool(found[0].flatten()[idx[0]])
        if i == 0:  # determinism: the same step twice more on the same tensors (a fresh copy of the layer)
            again = []
            for _ in range(repeats):
                t2, _a, _r = _build(LAYERS[name], device)
                again.append(bool(torch.equal(_step(t2, x, dy)['input gradient'], got['input gradient'])))
            row['bitwise_repeatable'] = again
        steps.append(row)
        if worst is None or row['triton'] > worst[0]:
            n, c = top[0]['pos'][:2]
            per = shape[1] // getattr(ref, 'num_groups', shape[1])
            c0 = c - c % per
            sl = (slice(n, n + 1), slice(c0, c0 + per))
            worst = (row['triton'], dict(step=i, n=n, channels=(c0, c0 + per), state=state,
                                         x=x[sl].cpu(), dy=dy[sl].cpu(), triton=g[sl].float().cpu(),
                                         float64=rr[sl].cpu()))
    return dict(case=f'{name} {level} {dname} {source}:{seed} {kinks}', shape=list(shape), steps=steps,
                passed=all(s['triton'] <= s['bound'] for s in steps)), worst


def main():
    if len(sys.argv) != 2:
        sys.exit('usage: gpu_grad_diag.py OUT_DIR')
    if not torch.cuda.is_available():
        sys.exit('gpu_grad_diag.py: no GPU (torch.cuda.is_available() is False)')
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    results, saved, t0 = [], {}, time.time()
    for case in CASES:
        t = time.time()
        res, worst = run_case(*case)
        res['seconds'] = round(time.time() - t, 1)
        results.append(res)
        if not res['passed'] or case == CASES[0]:
            saved[res['case']] = worst[1]
        s = max(res['steps'], key=lambda s: s['triton'])
        w = s['top'][0]
        print(f"{'ok  ' if res['passed'] else 'FAIL'} {res['case']}: worst step {s['step']} triton {s['triton']:.2e} "
              f"aten {s['aten']:.2e} bound {s['bound']:.2e}, {s['above_bound']} above; at {w['pos']} z64 "
              f"{w['z64']} (near a kink: {s.get('worst_near_kink')}) dy {w['dy']:.3g} x {w['x']:.4g}; repeatable "
              f"{res['steps'][0]['bitwise_repeatable']} ({res['seconds']} s)", flush=True)
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=importlib.util.find_spec('triton') and __import__('triton').__version__,
                       results=results), open(os.path.join(out, 'grad_diag.json'), 'w'), indent=1)
    torch.save(saved, os.path.join(out, 'grad_diag.pt'))
    print(f'gpu_grad_diag: {sum(r["passed"] for r in results)}/{len(results)} cases within the bound '
          f'({time.time() - t0:.0f} s)')


if __name__ == '__main__':
    main()
