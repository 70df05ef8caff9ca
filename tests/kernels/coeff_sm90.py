"""Compiles the layers' channel-sized coefficient kernels (BCN, Unitization, GN+PN: map and VJP) for an H100
(sm_90) on a machine without a GPU, and checks what the interpreter cannot show:

* float64 variants hold no approximate instruction (``rsqrt.approx.f64``, ``rcp.approx...f64``,
  ``div.approx``, ``sqrt.approx``): ``tl.rsqrt`` lowers to one, so the float64 results would differ from the
  interpreter's (and torch's) on a GPU;
* no variant spills registers (the bundled ptxas -v: "0 bytes spill stores, 0 bytes spill loads").

Run without TRITON_INTERPRET: each layer's ``_coeff_maps(True)`` runs on CPU tensors with the kernels' launches
replaced by a record of their arguments; every distinct variant is compiled to PTX and assembled by ptxas.

    python tests/kernels/coeff_sm90.py [--quick] [--layers bcn unitization proxy_norm] [--dtypes float64]
"""
import argparse
import contextlib
import io
import os
import re
import sys
import time

assert os.environ.get('TRITON_INTERPRET') != '1', 'run without TRITON_INTERPRET: the kernels must be JIT ones'
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from tests.kernels.sm90_compile import _sig, ptxas_resources, run_ptxas  # noqa: E402

PER = (1, 2, 8, 16, 32, 64, 256, 4096)  # channels per group
BATCH = (1, 2, 256)
# float64 instructions that are approximations (PTX ISA: rsqrt.approx.f64, rcp.approx.ftz.f64, and the
# approx forms of div / sqrt)
APPROX = re.compile(r'\b(rsqrt|rcp|div|sqrt)\.approx\S*')


def _shapes(quick):
    """(N, C, groups): every channels-per-group count at C = per (one group), C = 64 and C = 4096 where
    they hold it, each at every batch size; --quick: the largest tiles and a chunked group."""
    out = []
    for per in PER:
        for c in sorted({per, max(per, 64), 4096}):
            for n in BATCH:
                out.append((n, c, c // per))
    if quick:  # one group of 4096 (chunked), groups of 256 (the widest unchunked), 64 x 1 (the largest tile)
        out = [(256, 4096, 1), (2, 4096, 16), (256, 64, 64)]
    return out


def _bcn(n, c, g, dtype, quick=False):
    from normdense.layers.bcn import BatchChannelNorm2d
    for group_affine in (True, False):
        layer = BatchChannelNorm2d(c, num_groups=g, group_affine=group_affine).to(dtype)
        yield layer


def _unitization(n, c, g, dtype, quick=False):
    from normdense.layers import Unitization2d
    if g == 1:  # Unitization has no groups: its blocks are keyed on C alone
        for affine in (True, False):
            yield Unitization2d(c, affine=affine).to(dtype)


def _proxy_norm(n, c, g, dtype, quick=False):
    from normdense.layers.proxy_norm import GroupProxyNorm
    options = (('relu', True, True), ('mish', True, True), ('gelu', False, False))
    for act, scaling, affine in options[:1] if quick else options:
        yield GroupProxyNorm(c, num_groups=g, act=act, proxy_scaling=scaling, proxy_affine=affine).to(dtype)


LAYERS = {'bcn': _bcn, 'unitization': _unitization, 'proxy_norm': _proxy_norm}


def record(layers, dtypes, shapes, quick=False):
    """{key: (fn, signature, constexprs, num_warps)} of the coefficient kernels' launches."""
    variants = {}

    def run(self, *args, grid, warmup, **kwargs):
        bound = dict(zip(self.arg_names, args))
        bound.update(kwargs)
        signature, constexprs = {}, {}
        for i, name in enumerate(self.arg_names):
            if self.params[i].is_constexpr:
                signature[name] = 'constexpr'
                constexprs[name] = bound[name]
            else:
                signature[name] = _sig(bound[name])
        warps = kwargs.get('num_warps', 4)
        key = (self.fn.__name__, self.fn.__module__, tuple(signature.items()),
               tuple((k, str(v)) for k, v in constexprs.items()), warps)
        variants.setdefault(key, (self, signature, constexprs, warps))

    saved = JITFunction.run
    JITFunction.run = run
    try:
        for dtype in dtypes:
            for n, c, g in shapes:
                for name in layers:
                    for layer in LAYERS[name](n, c, g, dtype, quick):
                        m = torch.randn(n, c, dtype=dtype)
                        v = torch.rand(n, c, dtype=dtype)
                        mean, var = torch.zeros(c, dtype=dtype), torch.ones(c, dtype=dtype)
                        params = tuple(None if p is None else p.detach() for p in layer._statnorm_params())
                        cmap, cvjp = layer._coeff_maps(True)
                        for count in (None, n * 7):
                            coeffs, res = cmap(m, v, mean, var, params, 7, count)
                            cvjp(res, [torch.ones_like(m) for _ in coeffs], count is not None)
    finally:
        JITFunction.run = saved
    return variants


def check(variant, target):
    """(problems, registers, spill stores, spill loads) of one variant: the resources from the ptxas Triton itself
    runs, with its options (its log, ``knobs.nvidia.dump_ptxas_log``; where the cubin came from Triton's cache,
    :func:`run_ptxas`: the same ptxas and options). Triton 3.9 assembles sm_90 with its ptxas-blackwell (CUDA
    13.x), 3.7 and 3.8 with ptxas (12.8, 12.9): not the same binary, so not a fixed path here. A log without
    resource lines is a problem, not a pass."""
    from triton import knobs
    fn, signature, constexprs, warps = variant
    log = io.StringIO()
    saved = knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target,
                                      options={'num_warps': warps})
    finally:
        knobs.nvidia.dump_ptxas_log = saved
    ptx = compiled.asm['ptx']
    problems = []
    if any(t == '*fp64' for t in signature.values()):
        found = sorted({m.group(0) for m in APPROX.finditer(ptx)})
        if found:
            problems.append(f'approximate float64 instructions {found}')
    out = log.getvalue() if 'Used' in log.getvalue() else run_ptxas(ptx, target.arch)
    regs, stores, loads = ptxas_resources(out)  # every function's (noinline callees too)
    if regs is None or stores is None:
        problems.append(f'ptxas reported no resource usage: {out.strip()[-300:]!r}')
    elif stores or loads:
        problems.append(f'register spills: {stores} B stores, {loads} B loads')
    return problems, regs, stores, loads


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--layers', nargs='+', default=list(LAYERS))
    parser.add_argument('--dtypes', nargs='+', default=['float32', 'float64'])
    parser.add_argument('--quick', action='store_true',
                        help='three shapes (the largest tiles, a chunked group), GN+PN with relu only')
    args = parser.parse_args()
    variants = record(args.layers, [getattr(torch, d) for d in args.dtypes], _shapes(args.quick), args.quick)
    target = GPUTarget('cuda', 90, 32)
    failed = 0
    print(f'triton {triton.__version__}, torch {torch.__version__}, sm_{target.arch}', flush=True)
    for key, variant in sorted(variants.items(), key=lambda kv: str(kv[0])):
        name, module, signature, consts, warps = key
        start = time.time()
        dt = 'fp64' if any(t == '*fp64' for _, t in signature) else 'fp32'
        label = f'{module.rsplit(".", 1)[-1]}.{name} {dt} {dict(consts)} warps={warps}'
        try:
            problems, regs, _, _ = check(variant, target)
        except Exception as e:  # report every failing variant, then fail
            problems, regs = [f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}'], '?'
        failed += bool(problems)
        print(f'{"FAIL" if problems else "ok  "}  {label}: {regs} registers ({time.time() - start:.1f} s)'
              + ''.join(f'\n      {p}' for p in problems), flush=True)
    print(f'{len(variants)} variants, {failed} failed')
    sys.exit(1 if failed else 0)


if __name__ == '__main__':
    main()
