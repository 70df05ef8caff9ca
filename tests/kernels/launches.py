"""Counting what a step launches: Triton kernel launches (the interpreter's or the GPU's launch path) and the
ATen operators issued outside them (no views, no allocations: neither launches a kernel)."""
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_FREE = {'empty', 'empty_strided', 'empty_like', 'new_empty', 'new_empty_strided', 'detach', 'alias',
         'lift_fresh', 'is_nonzero', '_to_copy_noop'}


def _launch_classes():
    import triton.runtime.jit as jit
    classes = [jit.JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:
        pass
    return classes


@contextlib.contextmanager
def count_launches():
    """Yields a dict: 'triton' (launches, by kernel name in 'names') and 'aten' (non-view, non-allocation ATen
    operators outside the launches: each a kernel launch on CUDA)."""
    counts = {'triton': 0, 'aten': 0, 'names': [], 'ops': []}
    inside = [0]
    patched = []
    for cls in _launch_classes():
        original = cls.run

        def run(self, *args, __original=original, **kwargs):
            counts['triton'] += 1
            counts['names'].append(getattr(self, '__name__', None) or getattr(getattr(self, 'fn', None), '__name__', '?'))
            inside[0] += 1
            try:
                return __original(self, *args, **kwargs)
            finally:
                inside[0] -= 1
        cls.run = run
        patched.append((cls, original))

    # a kept launcher (normdense.kernels.launch, on a GPU) bypasses JITFunction.run: every launch takes
    # kernel[grid] while counting, so that it is counted
    from normdense.kernels.launch import Launcher
    hit = Launcher.hit
    Launcher.hit = lambda self, grid, args, key: False

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not inside[0]:
                name = func.overloadpacket.__name__
                if name not in _FREE and not func.is_view:
                    counts['aten'] += 1
                    counts['ops'].append(name)
            return func(*args, **(kwargs or {}))

    try:
        with Ops():
            yield counts
    finally:
        Launcher.hit = hit
        for cls, original in patched:
            cls.run = original
