"""The passes over x of the StatNorm engine (``_statnorm.py``) as torch.compile'd kernels: a backend beside the
ATen one (``_fused.py``), which it falls back to: opt-in
(``compiled=True`` on BCN, GN+PN and Unitization) because the first call compiles (tens of seconds on a
CPU, once per activation and kernel; inductor caches them on disk), and because it needs a working
compiler (CPU: inductor's C++ backend, a C++ compiler; CUDA: Triton).

Each kernel is one pass, with t = x - m formed inside it: forward y = K act(A t + B) + L; the
backward's sums over positions of g t, g, dy act(A t + B), dy with g = dy K act'(A t + B) in one
reduction; dx = A g + c1 t + c0 in one elementwise pass (act' through torch.func.vjp, so every activation of ``_activations.py`` works). If
compiling or running a compiled kernel fails, a warning says why and the ATen kernels take over for
the rest of the process: never an error from an opt-in speed-up.
"""
import warnings
from typing import Dict

import torch

from ._fused import AtenKernels

_BROKEN: Dict[str, str] = {}  # set once torch.compile failed: the reason


def _kernels(activation):
    act = None if activation is None else activation.forward
    # x (N, C, L), m and the coefficients (N, C, 1); t = x - m inside each kernel (see _fused.AtenKernels)
    if act is None:
        def forward(x, m, a, b):
            return a * (x - m) + b

        def sums(x, m, dy):
            return (dy * (x - m)).sum(2), dy.sum(2)

        def dx(x, m, dy, a, c1, c0):
            return a * dy + c1 * (x - m) + c0
    else:
        def _g(x, m, dy, a, b, k):
            out, vjp = torch.func.vjp(act, a * (x - m) + b)
            return vjp(dy * k)[0], out

        def forward(x, m, a, b, k, l):
            return k * act(a * (x - m) + b) + l

        def sums(x, m, dy, a, b, k):
            g, out = _g(x, m, dy, a, b, k)
            return (g * (x - m)).sum(2), g.sum(2), (dy * out).sum(2), dy.sum(2)

        def dx(x, m, dy, a, b, k, c1, c0):
            return a * _g(x, m, dy, a, b, k)[0] + c1 * (x - m) + c0
    return [torch.compile(f, dynamic=True) for f in (forward, sums, dx)]


class CompiledKernels(AtenKernels):
    _cache: Dict[object, 'CompiledKernels'] = {}

    @classmethod
    def get(cls, act):
        if act not in cls._cache:
            cls._cache[act] = cls(act)
        return cls._cache[act]

    def __init__(self, act):
        super().__init__(act)
        self._compiled = None

    def _call(self, index, eager, *args):
        if not _BROKEN:
            try:
                if self._compiled is None:
                    self._compiled = _kernels(self.act)
                return self._compiled[index](*args)
            except Exception as e:  # no compiler, an unsupported platform or op: the eager kernels
                _BROKEN['reason'] = f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}'
                warnings.warn(f'normdense: torch.compile of the fused norm kernels failed ({_BROKEN["reason"]}); '
                              'using the eager kernels (compiled=False) from here on', RuntimeWarning)
        return eager()

    def forward(self, x3, m, coeffs, buf=None):  # one pass from x: the moments' buffer is not needed
        cs = [c.unsqueeze(2) for c in coeffs]
        return self._call(0, lambda: super(CompiledKernels, self).forward(x3, m, coeffs, buf), x3,
                          m.unsqueeze(2), *cs)

    def sums(self, x3, m, dy, coeffs):
        cs = [c.unsqueeze(2) for c in coeffs]
        args = (x3, m.unsqueeze(2), dy) if self.act is None else (x3, m.unsqueeze(2), dy, *cs[:3])
        out = self._call(1, lambda: None, *args)
        return super().sums(x3, m, dy, coeffs) if out is None else (list(out), 'compiled')

    def dx(self, x3, m, dy, coeffs, c1, c0, state):
        if not isinstance(state, str):  # sums fell back to the ATen kernels, which computed what dx needs
            return super().dx(x3, m, dy, coeffs, c1, c0, state)
        cs = [c.unsqueeze(2) for c in coeffs]
        args = (x3, m.unsqueeze(2), dy, cs[0]) if self.act is None else (x3, m.unsqueeze(2), dy, *cs[:3])
        out = self._call(2, lambda: None, *args, c1.unsqueeze(2), c0.unsqueeze(2))
        if out is None:  # compiling dx failed after sums compiled: the ATen passes from scratch
            return super().dx(x3, m, dy, coeffs, c1, c0, super().sums(x3, m, dy, coeffs)[1])
        return out.to(x3.dtype)
