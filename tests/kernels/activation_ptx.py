"""Compiles ``act_forward`` and ``act_grad`` (normdense.kernels.activations) for an H100 (sm_90) on a machine
without a GPU, for every activation id in float32 and float64, and prints per-variant PTX statistics as JSON.
Run without TRITON_INTERPRET (the kernels must be JIT ones); ``--portable`` turns the compiled-only fast forms
off (``activations.FAST``, set before anything is compiled) to compare against them; ``--sass`` adds the
SASS instruction and MUFU (special-function unit) counts from the cubin (Triton's bundled cuobjdump).

    python tests/kernels/activation_ptx.py [--portable] [--sass]
"""
import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

assert os.environ.get('TRITON_INTERPRET') != '1', 'run without TRITON_INTERPRET: the kernels must be JIT ones'
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from normdense.kernels import activations as K  # noqa: E402

# parameters as the layers pass them (constexpr floats); PART 1 = act_forward, 2 = act_grad (the apply and
# dx passes use one each)
PARAMS = {'leaky_relu': (0.01, 0.0), 'elu': (1.0, 0.0), 'celu': (2.5, 0.0), 'softplus': (1.0, 20.0)}
NAMES = {**{i: n for n, i in K.ACTIVATION_IDS.items()}, K.GELU_TANH: 'gelu_tanh'}
LIBDEVICE = ('expm1', 'log1p', 'tanh')


@triton.jit
def _act(x_ptr, y_ptr, n, ACT: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, PART: tl.constexpr,
         BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    z = tl.load(x_ptr + i, mask=i < n, other=0.0)
    if PART == 1:
        y = K.act_forward(z, ACT, P0, P1)
    else:
        y = K.act_grad(z, ACT, P0, P1)
    tl.store(y_ptr + i, y, mask=i < n)


def _libdevice_lines():
    """{line of activations.py: 'expm1' | 'log1p' | 'tanh'} for each libdevice call."""
    with open(K.__file__) as f:
        return {i: name for i, line in enumerate(f, 1) for name in LIBDEVICE if f'libdevice.{name}(' in line}


def ptx_stats(ptx, libdevice_lines):
    """Instructions (and their opcodes) of a PTX text, ``mov`` aside (constants ptxas folds into immediates
    and register renames); those attributed by ``.loc`` to a libdevice call line of
    activations.py are libdevice's inlined code."""
    files = {int(m.group(1)): os.path.basename(m.group(2)) for m in re.finditer(r'\.file\s+(\d+)\s+"([^"]+)"', ptx)}
    where, body, inlined = None, [], collections.Counter()
    inline = None  # inside an inline asm block: its .loc lines so far (sm90_compile.ptx_accesses: 3.8 and 3.9
    # write one before each of its lines, the line number counted up; the block's location is the first)
    for line in ptx.splitlines():
        marker = line.strip()
        if marker in ('// begin inline asm', '// end inline asm'):
            inline = 0 if marker == '// begin inline asm' else None
            continue
        line = line.split('//')[0].strip()
        if line.startswith('.loc'):
            if inline:
                continue
            inline = None if inline is None else inline + 1
            _, file, row = line.split()[:3]
            where = libdevice_lines.get(int(row)) if files.get(int(file)) == 'activations.py' else None
        elif line.endswith(';') and not line.startswith(('.', '{', '}')) and not line.startswith('mov'):
            body.append(line)
            if where:
                inlined[where] += 1
    opcodes = collections.Counter(line.rstrip(';').split()[1 if line.startswith('@') else 0] for line in body)
    return dict(instructions=len(body), opcodes=dict(opcodes), libdevice=dict(inlined), text=body)


def sass_stats(cubin):
    tool = os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia', 'bin', 'cuobjdump')
    with tempfile.NamedTemporaryFile(suffix='.cubin') as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, '-sass', f.name], capture_output=True, text=True, check=True).stdout
    body = [line for line in sass.splitlines() if re.match(r'\s+/\*[0-9a-f]{4}\*/', line)]
    return dict(sass=len(body), mufu=sum('MUFU' in line for line in body))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--portable', action='store_true', help='the interpreter\'s forms, compiled')
    parser.add_argument('--sass', action='store_true')
    args = parser.parse_args()
    if args.portable:
        K.FAST = tl.constexpr(False)  # before the first compile: Triton reads (and hashes) the global then
    lines = _libdevice_lines()
    out = {'FAST': bool(K.FAST), 'variants': {}}
    for dtype in ('fp32', 'fp64'):
        for act, name in sorted(NAMES.items()):
            p0, p1 = PARAMS.get(name, (0.0, 0.0))
            for part in (1, 2):
                signature = {'x_ptr': '*' + dtype, 'y_ptr': '*' + dtype, 'n': 'i32', 'ACT': 'constexpr',
                             'P0': 'constexpr', 'P1': 'constexpr', 'PART': 'constexpr', 'BLOCK': 'constexpr'}
                constexprs = {'ACT': act, 'P0': p0, 'P1': p1, 'PART': part, 'BLOCK': 128}
                attrs = {(0, ): [['tt.divisibility', 16]], (1, ): [['tt.divisibility', 16]]}
                compiled = triton.compile(ASTSource(fn=_act, signature=signature, constexprs=constexprs, attrs=attrs),
                                          target=GPUTarget('cuda', 90, 32))
                stats = ptx_stats(compiled.asm['ptx'], lines)
                if args.sass:
                    stats.update(sass_stats(compiled.asm['cubin']))
                out['variants'][f'{dtype} {name} {"forward" if part == 1 else "grad"}'] = stats
    print(json.dumps(out))


if __name__ == '__main__':
    main()
