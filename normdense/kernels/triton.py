"""The Triton backend of the StatNorm engine: ``backend.Backend`` on the kernels of ``passes.py``
(CUDA; CPU tensors under Triton's interpreter). Launches per training step of a layer: moments, the layer's
coefficient kernel (with the first stage folded in), apply (forward); sums, the layer's VJP kernel (adding
the chunks' partial sums as it loads them), dx (backward): 6. With ``sync_stats`` across processes the
statistics go through torch code between the kernels: the stats kernel, the all-reduces, a merge.

The module's state changes (estimates, running statistics, num_batches_tracked) happen in the forward's last
kernel (apply), so a kernel failing to compile under backend 'auto' leaves the module as it was. Imports no
layer."""
from . import passes as P
from .activations import act_args
from .backend import Statistics, StatsRequest, compile_errors, device_guard
from .first_stage import FirstStage


def _act(act):
    return None if act is None else act_args(act.name, act.kwargs)


class TritonBackend:
    """:class:`normdense.kernels.backend.Backend` on the Triton passes; x3 in one of the layouts of
    ``passes.as_read``, dy in x3's."""
    name = 'triton'
    kernel_maps = True

    @staticmethod
    def first_stage(x3, request: StatsRequest, deferred: bool = True):
        """The chunks' moments (one launch); the first stage planned for the coefficient map's launch
        (``deferred``), or merged now in the stats kernel (where torch code reads m, v first: ``sync_stats``)."""
        x3 = P.as_read(x3)  # (N, C, L) rows or channels_last (N, L, C) in place, else a copy
        partials, split, chunk = P.moment_partials(x3)
        plan = FirstStage(partials, split, chunk, x3.shape, *request)
        m, v, mean, var, moved, upd = plan.outputs if deferred else plan.launch()
        return x3, Statistics(m, v, mean, var, moved, upd, plan if deferred else None, None, request)

    @staticmethod
    def prepare(coeffs, v):
        return [c.contiguous() for c in coeffs]  # the kernels mask A where v = 0 themselves

    @staticmethod
    def apply(x3, stats: Statistics, coeffs, act=None, out_dtype=None):
        pc = TritonBackend.prepare(coeffs, stats.v)
        request = stats.request
        write = None if stats.update is None else (stats.update, request.stat_mean, request.stat_var)
        return P.apply(x3, stats.m, stats.v, pc, _act(act), out_dtype, write, request.nbt), pc

    @staticmethod
    def grad_layout(dy, x3):
        """dy in x3's layout, in whatever dtype it came (the kernels read it as it is: no cast pass)."""
        return P.like(dy, x3)

    @staticmethod
    def sums(x3, dy, stats: Statistics, pc, act=None, merged=True):
        """The coefficients' gradients, each (N, C), or (``merged`` False) the chunks' (SPLIT, N, C) partials that
        the layers' Triton VJP kernels and dx add as they load them."""
        return P.sums(x3, dy, stats.m, stats.v, pc, _act(act), merged=merged), None

    @staticmethod
    def dx(x3, dy, stats: Statistics, pc, dm, dv, gsum, act=None, batch=None, state=None, pending=None):
        """dx; ``pending``: a layer VJP's ``second_stage.BlockSums`` (large N), summed in this launch."""
        return P.dx(x3, dy, stats.m, stats.v, pc, dm.contiguous(), dv.contiguous(), gsum, _act(act), batch,
                    pending)

    @staticmethod
    def guard(t):
        return device_guard(t)  # every launch on t's device and its current stream

    @staticmethod
    def compile_errors():
        return compile_errors()
