"""The Triton backend of the StatNorm engine: ``aten.AtenBackend``'s interface on the kernels of ``passes.py``
(CUDA; CPU tensors under Triton's interpreter). Launches per training step of a layer: moments, the layer's
coefficient kernel (with the first stage folded in), apply (forward); sums, the layer's VJP kernel (adding
the chunks' partial sums as it loads them), dx (backward): 6. With ``sync_stats`` across processes the
statistics go through torch code between the kernels: the stats kernel, the all-reduces, a merge.

The module's state changes (estimates, running statistics, num_batches_tracked) happen in the forward's last
kernel (apply), so a kernel failing to compile under backend 'auto' leaves the module as it was. Imports no
layer."""
import torch

from . import passes as P
from .activations import act_args
from .first_stage import FirstStage
from .aten import STATS_BATCH, STATS_ESTIMATE, STATS_FIXED, STATS_NONE  # noqa: F401  (the same modes)


def _act(act):
    return None if act is None else act_args(act.name, act.kwargs)


class TritonBackend:
    name = 'triton'  # x3 in one of the layouts of layout(), dy in x3's

    @staticmethod
    def prepare(coeffs, v):
        return [c.contiguous() for c in coeffs]  # the kernels mask A where v = 0 themselves

    @staticmethod
    def moments(x3):
        return P.moment_partials(x3)

    @staticmethod
    def stats(part, shape, mode=STATS_NONE, stat_mean=None, stat_var=None, base=None, rate=0.0, momentum=0.1,
              write=False, nbt=None):
        """(m, v, mean, var, moved, upd): the chunks' moments merged and the first stage in one launch
        (``passes._stats_kernel``: eval, Algorithm 1's update, batch statistics and their tracking)."""
        partials, split, chunk = part
        return P.stats(partials, split, chunk, shape, mode, stat_mean, stat_var, base, rate=rate,
                       momentum=momentum, write=write, nbt=nbt)

    @staticmethod
    def layout(x3):
        """x3 (N, C, L) as the passes read it: (N, C, L) rows or channels_last (N, L, C) in place, else a copy."""
        return P.as_read(x3)

    @staticmethod
    def grad_layout(dy, x3):
        """dy in x3's layout, in whatever dtype it came (the kernels read it as it is: no cast pass)."""
        return P.like(dy, x3)

    @staticmethod
    def plan_stats(part, shape, mode=STATS_NONE, stat_mean=None, stat_var=None, base=None, rate=0.0, momentum=0.1,
                   write=False, nbt=None):
        """(:meth:`stats`'s outputs, the planned first stage): the outputs are allocated, and filled by the
        layer's coefficient map kernel, which runs the first stage in its own launch (``first=``)."""
        partials, split, chunk = part
        plan = FirstStage(partials, split, chunk, shape, mode, stat_mean, stat_var, base, rate, momentum, write, nbt)
        return plan.outputs, plan

    @staticmethod
    def apply(x3, m, v, coeffs, act=None, out_dtype=None, write=None, nbt=None, buf=None):
        return P.apply(x3, m, v, coeffs, _act(act), out_dtype, write, nbt)

    @staticmethod
    def sums(x3, dy, m, v, coeffs, act=None, merged=True):
        """The coefficients' gradients, each (N, C), or (``merged`` False) the chunks' (SPLIT, N, C) partials that
        the layers' Triton VJP kernels and dx add as they load them."""
        return P.sums(x3, dy, m, v, coeffs, _act(act), merged=merged), None

    @staticmethod
    def dx(x3, dy, m, v, coeffs, dm, dv, gsum, act=None, batch=None, state=None, finish=None):
        """dx; ``finish``: a layer VJP's ``second_stage.BlockSums`` (large N), summed in this launch."""
        return P.dx(x3, dy, m, v, coeffs, dm.contiguous(), dv.contiguous(), gsum, _act(act), batch, finish)

