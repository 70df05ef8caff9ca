"""Compiles the pass kernels (normdense/kernels/passes.py) for an H100 (sm_90) as the launchers pick them at the
FPN shapes and lists every global load and store of the PTX: the activation (x, dy, y, dx) must be read and
written 16 bytes per access (``ld.global.v4.b32``, ``v2.b64``), which is what makes the passes run at memory
speed. No GPU needed; run without TRITON_INTERPRET:

    python tests/kernels/vec_probe.py [--quick]      # one line per variant; exit 1 on a scalar access

The launchers run on 'meta' tensors with the kernels' launches recorded (nothing executes). Pointers are
marked 16-byte aligned as Triton's launcher marks torch's allocations at run time. The per-row tensors (m, v,
coefficients, partials, buffers) are compiled with a tag dtype (float64, or float32 for float64
activations): their scalar accesses then differ in width from any scalar access of the activation, so every
access narrower than 16 bytes that is not of the tag's width is the activation's.
"""
import argparse
import os
import re
import sys
import time
import warnings

assert os.environ.get('TRITON_INTERPRET') != '1', 'run without TRITON_INTERPRET: the kernels must be JIT ones'
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# triton 3.9 warns on stderr that its default (FP fusion on, as 3.7's and 3.8's) changes in 3.10; the summary line
# must stay the output's last (tests/kernels/test_vectorized.py reads stdout + stderr)
warnings.filterwarnings('ignore', message='TRITON_DEFAULT_FP_FUSION is unset')

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from tests.kernels.sm90_compile import _sig  # noqa: E402

FPN_HW = [200 * 304, 100 * 152, 50 * 76, 25 * 38, 13 * 19, 7 * 10]  # P2-P7 of an 800 x 1216 image
ACTIVATION = {'x_ptr', 'dy_ptr', 'y_ptr', 'dx_ptr'}
_ACCESS = re.compile(r'\b(ld|st)\.global((?:\.[\w:]+)*)')
_BITS = {'b8': 8, 'u8': 8, 's8': 8, 'b16': 16, 'u16': 16, 's16': 16, 'f16': 16, 'b32': 32, 'u32': 32, 's32': 32,
         'f32': 32, 'b64': 64, 'u64': 64, 's64': 64, 'f64': 64}


def accesses(ptx):
    """[(op, bits per access, vector count)] of every global load / store in ``ptx``."""
    out = []
    for op, mods in _ACCESS.findall(ptx):
        parts = mods.split('.')
        vec = next((int(p[1:]) for p in parts if re.fullmatch(r'v\d', p)), 1)
        bits = next(_BITS[p] for p in parts if p in _BITS)
        out.append((op, bits * vec, vec))
    return out


def record(cases):
    """{key: (kernel, signature, constexprs, activation dtype)} of the launches of ``cases``."""
    variants = {}
    current = {}

    def run(self, *args, grid, warmup, **kwargs):
        bound = dict(zip(self.arg_names, args))
        bound.update(kwargs)
        signature, constexprs = {}, {}
        act = current['dtype']
        tag = '*fp32' if act == torch.float64 else '*fp64'
        itag = 'i32' if act == torch.float64 else 'i64'
        for i, name in enumerate(self.arg_names):
            if self.params[i].is_constexpr:
                signature[name] = 'constexpr'
                constexprs[name] = bound[name]
                continue
            sig = _sig(bound[name])
            if sig.startswith('*') and name not in ACTIVATION:
                sig = '*i32' if sig in ('*i64', '*i32') and itag == 'i32' else ('*i64' if sig == '*i64' else tag)
            signature[name] = sig
        key = (self.fn.__name__, tuple(signature.items()), tuple((k, str(v)) for k, v in constexprs.items()))
        variants.setdefault(key, (self, signature, constexprs, current['case']))

    JITFunction.run = run
    from tests.kernels import passes as P  # the passes launched on their own
    from normdense.kernels.activations import act_args
    for case in cases:
        layout, xdt, dydt, ydt, n, hw, act = case
        current.update(dtype=xdt, case=case)
        dev = 'meta'
        shape = (n, 256, hw)
        x = torch.empty(shape, dtype=xdt, device=dev)
        dy = torch.empty(shape, dtype=dydt, device=dev)
        if layout == 'cl':
            x = torch.empty(n, hw, 256, dtype=xdt, device=dev).transpose(1, 2)
            dy = torch.empty(n, hw, 256, dtype=dydt, device=dev).transpose(1, 2)
        acc = torch.float64 if xdt == torch.float64 else torch.float32
        m = torch.empty(n, 256, dtype=acc, device=dev)
        spec = None if act is None else act_args(act, {})
        coeffs = tuple(torch.empty(n, 256, dtype=acc, device=dev) for _ in range(2 if act is None else 4))
        P.moment_partials(x)
        P.apply(x, m, m, coeffs, spec, out_dtype=ydt)
        P.sums(x, dy, m, m, coeffs, spec)
        P.dx(x, dy, m, m, coeffs, m, m, m, spec)
        c = torch.empty(256, dtype=acc, device=dev)
        P.dx(x, dy, m, m, coeffs, m, m, m, spec, batch=(c, c, c, 0.5))
    return variants


def cases(quick=False):
    """(layout, x dtype, dy dtype, y dtype, N, HW, activation): every dtype at every FPN shape, both layouts;
    float32 dy for bf16 x (autocast) and a bf16 y of float32 x; the activation variants in float32 only."""
    dtypes = [(torch.float32,) * 3, (torch.float16,) * 3, (torch.bfloat16,) * 3, (torch.float64,) * 3,
              (torch.bfloat16, torch.float32, torch.bfloat16), (torch.float32, torch.float32, torch.bfloat16)]
    out = []
    for layout in ('ncl', 'cl'):
        for xdt, dydt, ydt in dtypes:
            for n in (1, 2):
                for hw in FPN_HW[:2] if quick else FPN_HW:
                    acts = [None, 'relu'] if xdt == ydt == torch.float32 else [None]
                    out += [(layout, xdt, dydt, ydt, n, hw, act) for act in acts]
    return out


def registers(ptx, arch):
    """'R registers, S B spill stores' of ``ptx`` from the bundled ptxas Triton picks for ``arch``
    (``sm90_compile.run_ptxas``: 3.9 takes ptxas-blackwell for sm_90)."""
    from tests.kernels.sm90_compile import ptxas_resources, run_ptxas
    regs, spills, _ = ptxas_resources(run_ptxas(ptx, arch))
    return f'{"?" if regs is None else regs} registers, {"?" if spills is None else spills} B spill stores'


def check(variants, arch=90, verbose=True, ptxas=False):
    """Compiles each variant; returns the lines of those with a narrow access of the activation."""
    target = GPUTarget('cuda', arch, 32)
    bad = []
    for (name, _, consts), (fn, signature, constexprs, case) in sorted(variants.items(), key=lambda kv: kv[0][0]):
        start = time.time()
        attrs = {(i,): [['tt.divisibility', 16]] for i, (arg, sig) in enumerate(signature.items())
                 if sig.startswith('*')}
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                  target=target)
        xdt = case[1]
        tag_bits = 32 if xdt == torch.float64 else 64
        found = accesses(compiled.asm['ptx'])
        narrow = [a for a in found if a[1] < 128 and a[1] != tag_bits]
        counts = {}
        for op, bits, vec in found:
            name = f'{op}{bits}' + (f'(v{vec})' if vec > 1 else '')
            counts[name] = counts.get(name, 0) + 1
        short = {k: str(v) for k, v in constexprs.items() if k not in ('ACC',)}
        line = (f'{"BAD " if narrow else "ok  "} {name} {case[0]} {str(xdt)[6:]} dy {str(case[2])[6:]} '
                f'y {str(case[3])[6:]} {short}: {counts} ({time.time() - start:.1f} s)')
        if ptxas:
            line += '; ' + registers(compiled.asm['ptx'], arch)
        if verbose:
            print(line, flush=True)
        if narrow:
            bad.append(line)
    return bad


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--quick', action='store_true', help='two FPN levels: the variants, fewer shapes')
    parser.add_argument('--ptxas', action='store_true', help="also each variant's registers and spills")
    args = parser.parse_args()
    variants = record(cases(args.quick))
    bad = check(variants, ptxas=args.ptxas)
    print(f'{len(variants)} variants, {len(bad)} with a narrow activation access')
    sys.exit(1 if bad else 0)


if __name__ == '__main__':
    main()
