"""Compiles every Triton kernel variant that the layers launch, for an H100 (sm_90), on a machine without a
GPU: Triton's compiler and its bundled ptxas need no device. Run in a process without TRITON_INTERPRET: the
layers run on CPU tensors with each kernel's launch replaced by a record of its arguments (no kernel
executes, no value is read); each distinct (kernel, signature, constexprs) is then compiled to a cubin.

    python tests/kernels/sm90_compile.py [--dtypes float32 bfloat16 ...]     # prints one line per variant
"""
import argparse
import os
import sys
import time

assert os.environ.get('TRITON_INTERPRET') != '1', 'run without TRITON_INTERPRET: the kernels must be JIT ones'
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

# the size arguments: declared do_not_specialize, so a new image or batch size (divisible by 16 or not, 1 or
# not) never makes Triton compile another variant
SIZES = {'N', 'C', 'G', 'L', 'ROWS', 'CHUNK', 'SPLIT', 'SIZE', 'PER', 'per', 'S'}

_TYPES = {torch.float32: 'fp32', torch.float64: 'fp64', torch.float16: 'fp16', torch.bfloat16: 'bf16',
          torch.int64: 'i64', torch.int32: 'i32', torch.bool: 'i1'}


def _sig(value):
    if isinstance(value, torch.Tensor):
        return '*' + _TYPES[value.dtype]
    if isinstance(value, bool):
        return 'i1'
    if isinstance(value, int):
        return 'i64' if abs(value) >= 2 ** 31 else 'i32'
    if isinstance(value, float):
        return 'fp32'
    raise TypeError(f'unexpected kernel argument {value!r}')


def record_variants(dtypes):
    """{key: (fn, signature, constexprs)} of every launch of the layers' training and eval steps."""
    from normdense.kernels import backend
    from tests.layers.test_fused import CASES, C
    variants = {}

    def run(self, *args, grid, warmup, **kwargs):
        names = self.arg_names
        bound = dict(zip(names, args))
        bound.update(kwargs)
        signature, constexprs = {}, {}
        for i, name in enumerate(names):
            if i in self.constexprs or (hasattr(self, 'params') and self.params[i].is_constexpr):
                signature[name] = 'constexpr'
                constexprs[name] = bound[name]
            else:
                signature[name] = _sig(bound[name])
        key = (self.fn.__name__, tuple(signature.items()), tuple((k, str(v)) for k, v in constexprs.items()))
        variants.setdefault(key, (self, signature, constexprs))

    JITFunction.run = run
    backend.interpreted = lambda: True  # CPU tensors take the Triton path; nothing executes
    for dtype in dtypes:
        for name, make in sorted(CASES.items()):
            layer = make()
            layer.backend = 'triton'
            params_dtype = torch.float64 if dtype == torch.float64 else torch.float32
            layer = layer.to(params_dtype).train()
            x = torch.randn(2, C, 40, 40, dtype=dtype, requires_grad=True)
            layer(x).backward(torch.ones(2, C, 40, 40, dtype=dtype))
            layer.eval()
            with torch.no_grad():
                layer(x)
    return variants


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--dtypes', nargs='+', default=['float32', 'bfloat16', 'float64'])
    parser.add_argument('--arch', type=int, default=90)
    args = parser.parse_args()
    from normdense.kernels import passes
    passes.FORCE_SPLIT = 2  # the backward's merge kernel too
    variants = record_variants([getattr(torch, d) for d in args.dtypes])
    target = GPUTarget('cuda', args.arch, 32)
    failed = 0
    for name, _, _ in sorted(variants):
        fn = variants[next(k for k in variants if k[0] == name)][0]
        specialized = sorted(p.name for p in fn.params if p.name in SIZES and not p.do_not_specialize)
        if specialized:
            failed += 1
            print(f'FAIL  {name}: size arguments {specialized} not do_not_specialize (a new size would recompile)')
    for (name, _, consts), (fn, signature, constexprs) in sorted(variants.items(), key=lambda kv: kv[0][0]):
        start = time.time()
        try:
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target)
            shared = getattr(compiled.metadata, 'shared', '?')
            print(f'ok    {name} {dict(consts)}: cubin {len(compiled.asm["cubin"])} B, shared {shared} B '
                  f'({time.time() - start:.1f} s)')
        except Exception as e:  # report every failing variant, then fail
            failed += 1
            print(f'FAIL  {name} {dict(consts)}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}')
    print(f'{len(variants)} variants, {failed} failed to compile for sm_{args.arch}')
    sys.exit(1 if failed else 0)


if __name__ == '__main__':
    main()
