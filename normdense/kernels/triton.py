"""The Triton backend of the StatNorm engine: ``backend.Backend`` on the kernels of ``passes.py``
(CUDA; CPU tensors under Triton's interpreter). Launches per training step of a layer: moments, the layer's
coefficient kernel (with the first stage folded in), apply (forward); sums, the layer's VJP kernel (adding
the chunks' partial sums as it loads them), dx (backward): 6. With ``sync_stats`` across processes the
statistics go through torch code between the kernels: the stats kernel, the all-reduces, a merge.

x3 (N, C, L) comes contiguous (NCL) or as a channels_last map viewed as (N, C, HW) (read as it is; y and dx
are written with x3's strides). A pass runs on a grid of (row groups, splits), each program on a chunk of
CHUNK positions of its rows; reductions write one partial per (split, row), which the kernel that reads them
adds in a fixed order (deterministic, no atomics). The sizes are ``do_not_specialize`` (a new image or batch
size never recompiles a kernel); the constexpr variants: layout, vector width V, SMALL (NCL, L < V).

The module's state changes (estimates, running statistics, num_batches_tracked) happen in the forward's last
kernel (apply), so a kernel failing to compile under backend 'auto' leaves the module as it was. Imports no
layer."""
import torch
import triton

from .activations import act_args
from .backend import Statistics, StatsRequest, compile_errors, device_guard
from .common import FINISH_BLOCK, acc_dtype, cl_blocks, hi_lo, vector_width
from .first_stage import FirstStage
from .passes import _apply_kernel, _dx_kernel, _merge_kernel, _moments_kernel, _sums_kernel

ACT_NONE = -1  # y = A t + B, no activation

_TARGET_PROGRAMS = 1024  # enough programs to fill an H100's 132 SMs several times over


def block_for(dtype: torch.dtype) -> int:
    return 512 if dtype == torch.float64 else 1024


def split_for(rows: int, length: int, block: int, split=None):
    """(SPLIT, CHUNK): how many programs share a row and how many positions each takes; ``split``: this many
    chunks per row (at most one per tile) instead of enough programs to fill the GPU."""
    tiles = triton.cdiv(length, block)
    split = max(1, min(tiles, split or triton.cdiv(_TARGET_PROGRAMS, max(rows, 1))))
    chunk = triton.cdiv(tiles, split) * block
    return triton.cdiv(length, chunk), chunk


def channels_last(x3: torch.Tensor) -> bool:
    """x3 (N, C, L) is a channels_last map viewed as (N, C, HW) (and not also contiguous)."""
    return not x3.is_contiguous() and x3.transpose(1, 2).is_contiguous()


def as_read(x3: torch.Tensor) -> torch.Tensor:
    """x3 itself when the passes read its layout (NCL or CL), else a contiguous copy."""
    return x3 if x3.is_contiguous() or channels_last(x3) else x3.contiguous()


def like(t: torch.Tensor, x3: torch.Tensor) -> torch.Tensor:
    """t (x3's shape) in x3's layout: dy as the passes read it alongside x3 (a copy only if it differs)."""
    if channels_last(x3):
        return t if channels_last(t) or t.transpose(1, 2).is_contiguous() else \
            t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.contiguous()


def _plan(x3: torch.Tensor, *others, split=None):
    """Launch geometry of a pass over x3 (read layout) with the activation tensors ``others`` (dy, y):
    dict(grid, CHUNK and the constexprs BLOCK, BLOCK_C, V, CL[, SMALL]); ``split``: as :func:`split_for`."""
    n, c, length = x3.shape
    vec = vector_width(x3, *others)
    if channels_last(x3):
        block_c, block = cl_blocks(c, x3.element_size())
        groups = n * triton.cdiv(c, block_c)
        split, chunk = split_for(groups, length, block, split)
        return dict(grid=(groups, split), CHUNK=chunk, BLOCK=block, BLOCK_C=block_c,
                    V=vec if c % vec == 0 else 1, CL=True, SMALL=False)
    block = block_for(x3.dtype)
    split, chunk = split_for(n * c, length, block, split)
    vec = vec if (n * c * length) % vec == 0 else 1
    return dict(grid=(n * c, split), CHUNK=chunk, BLOCK=block, BLOCK_C=1, V=vec, CL=False, SMALL=length < vec)


# --- forward ------------------------------------------------------------------------------------------------
def moment_partials(x3: torch.Tensor, split=None):
    """(partials (SPLIT, 2, N*C): each chunk's mean and centred sum of squares; SPLIT; CHUNK) of x3 (N, C, L);
    ``split`` (here and below): the chunks per row, as :func:`split_for`."""
    x3 = as_read(x3)
    n, c, length = x3.shape
    rows = n * c
    plan = _plan(x3, split=split)
    acc = torch.float64 if x3.dtype == torch.float64 else torch.float32
    split = plan['grid'][1]
    part = torch.empty(split, 2, rows, dtype=acc, device=x3.device)
    _moments_kernel[plan['grid']](x3, part, rows, c, length, plan['CHUNK'], BLOCK=plan['BLOCK'],
                                  BLOCK_C=plan['BLOCK_C'], V=plan['V'], CL=plan['CL'], ACC=acc_dtype(x3.dtype))
    return part, split, plan['CHUNK']


def _act_ids(act):
    return (ACT_NONE, 0.0, 0.0) if act is None else act


def apply(x3, m, v, coeffs, act=None, out_dtype=None, write=None, nbt=None, split=None):
    """y (N, C, L) of x3 with the per-(n, c) coefficients (A, B[, K, L']), in x3's layout (NCL or
    channels_last); ``act`` (id, p0, p1) from :func:`normdense.kernels.activations.act_args` or None;
    ``write`` = (upd, running_mean, running_var): the new values to copy into the buffers; ``nbt``: a
    num_batches_tracked to add 1 to."""
    x3 = as_read(x3)
    n, c, length = x3.shape
    act_id, p0, p1 = _act_ids(act)
    y = torch.empty_like(x3, dtype=out_dtype or x3.dtype)
    plan = _plan(x3, y, split=split)
    a, b = coeffs[0], coeffs[1]
    k, l_ = (coeffs[2], coeffs[3]) if act_id >= 0 else (a, b)
    upd, rm, rv = write if write is not None else (m, m, m)
    _apply_kernel[plan['grid']](x3, y, m, v, a, b, k, l_, upd, rm, rv, m if nbt is None else nbt, c, length,
                                plan['CHUNK'], int(write is not None), int(nbt is not None), *hi_lo(p0),
                                *hi_lo(p1), ACT=act_id, BLOCK=plan['BLOCK'], BLOCK_C=plan['BLOCK_C'],
                                V=plan['V'], SMALL=plan['SMALL'], CL=plan['CL'], ACC=acc_dtype(x3.dtype))
    return y


# --- backward -----------------------------------------------------------------------------------------------
def sums(x3, dy, m, v, coeffs, act=None, merged=True, split=None):
    """The gradients of the coefficients: [sum_l g t, sum_l g] (and sum_l dy act(z), sum_l dy with an
    activation), each (N, C) in the coefficients' dtype; a merge launch only when rows are split. ``merged``
    False: each as the chunks' partials (SPLIT, N, C) instead, for kernels that add them as they load them
    (the layers' VJP kernels, :func:`dx`): no merge launch. dy in any floating dtype, in x3's layout (else
    copied into it)."""
    x3 = as_read(x3)
    dy = like(dy, x3)
    n, c, length = x3.shape
    act_id, p0, p1 = _act_ids(act)
    count = 2 if act_id < 0 else 4
    plan = _plan(x3, dy, split=split)
    split = plan['grid'][1]
    part = torch.empty(split, count, n * c, dtype=m.dtype, device=x3.device)
    a, b = coeffs[0], coeffs[1]
    k = coeffs[2] if act_id >= 0 else a
    _sums_kernel[plan['grid']](x3, dy, part, m, v, a, b, k, n * c, c, length, plan['CHUNK'], *hi_lo(p0),
                               *hi_lo(p1), ACT=act_id, BLOCK=plan['BLOCK'], BLOCK_C=plan['BLOCK_C'], V=plan['V'],
                               CL=plan['CL'], ACC=acc_dtype(x3.dtype))
    if not merged:
        return [part[:, i].view(split, n, c) for i in range(count)]
    if split > 1:
        out = torch.empty(count, n * c, dtype=m.dtype, device=x3.device)
        size = count * n * c
        _merge_kernel[(triton.cdiv(size, 1024), )](part, out, size, split, BLOCK=1024)
    else:
        out = part[0]
    return [t.view(n, c) for t in out.unbind(0)]


def dx(x3, dy, m, v, coeffs, dm, dv, gsum, act=None, batch=None, finish=None, split=None,
       finish_block=FINISH_BLOCK.value):
    """dx (x3's shape, dtype and layout) from the coefficients' VJP (dm, dv) and sum_l g (``gsum``: (N, C), or
    the (SPLIT, N, C) partials of ``sums(merged=False)``, added in the kernel); ``batch``
    = (mean, dmean, dvar, 1 / N) adds the VJP of the (unsynchronized) batch statistics, dmean and dvar (C,) or
    the (SB, C) partials of the VJP's sample blocks (added in the kernel). ``finish``: the VJP's
    ``common.BlockSums`` whose partial parameter gradients this launch sums (if each of its programs can take
    ``finish_block`` columns, else torch sums them first). dy as for :func:`sums`."""
    x3 = as_read(x3)
    dy = like(dy, x3)
    n, c, length = x3.shape
    act_id, p0, p1 = _act_ids(act)
    out = torch.empty_like(x3)
    plan = _plan(x3, dy, split=split)
    a, b = coeffs[0], coeffs[1]
    k = coeffs[2] if act_id >= 0 else a
    mean, dmean, dvar, scale = batch if batch is not None else (m, m, m, 0.0)
    gsplit, gstride = (gsum.shape[0], gsum.stride(0)) if gsum.dim() == 3 else (1, 0)
    # dmean, dvar: the rows of one BlockSums buffer (one stride) at large N
    bsplit, bstride = (dmean.shape[0], dmean.stride(0)) if batch is not None and dmean.dim() == 2 else (1, 0)
    src, dst, fin_p, fin_sb, fin_stride = finish.dx_args(plan['grid'][0], finish_block) if finish is not None else (m, m, 0, 1, 0)
    _dx_kernel[plan['grid']](x3, dy, out, m, v, a, b, k, dm, dv, gsum, mean, dmean, dvar, src, dst, c, length,
                             plan['CHUNK'], gsplit, gstride, bsplit, bstride, fin_p, fin_sb, fin_stride,
                             *hi_lo(scale), *hi_lo(p0), *hi_lo(p1), ACT=act_id,
                             BATCH=batch is not None, BLOCK=plan['BLOCK'], BLOCK_C=plan['BLOCK_C'], V=plan['V'],
                             SMALL=plan['SMALL'], CL=plan['CL'], ACC=acc_dtype(x3.dtype), FINISH=fin_p > 0)
    return out


def _act(act):
    return None if act is None else act_args(act.name, act.kwargs)


class TritonBackend:
    """:class:`normdense.kernels.backend.Backend` on the Triton passes; x3 in one of the layouts of
    ``as_read``, dy in x3's."""
    name = 'triton'
    kernel_maps = True

    @staticmethod
    def first_stage(x3, request: StatsRequest, deferred: bool = True):
        """The chunks' moments (one launch); the first stage planned for the coefficient map's launch
        (``deferred``), or merged now in the stats kernel (where torch code reads m, v first: ``sync_stats``)."""
        x3 = as_read(x3)  # (N, C, L) rows or channels_last (N, L, C) in place, else a copy
        partials, split, chunk = moment_partials(x3)
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
        return apply(x3, stats.m, stats.v, pc, _act(act), out_dtype, write, request.nbt), pc

    @staticmethod
    def grad_layout(dy, x3):
        """dy in x3's layout, in whatever dtype it came (the kernels read it as it is: no cast pass)."""
        return like(dy, x3)

    @staticmethod
    def sums(x3, dy, stats: Statistics, pc, act=None, merged=True):
        """The coefficients' gradients, each (N, C), or (``merged`` False) the chunks' (SPLIT, N, C) partials that
        the layers' Triton VJP kernels and dx add as they load them."""
        return sums(x3, dy, stats.m, stats.v, pc, _act(act), merged=merged), None

    @staticmethod
    def dx(x3, dy, stats: Statistics, pc, dm, dv, gsum, act=None, batch=None, state=None, pending=None):
        """dx; ``pending``: a layer VJP's ``common.BlockSums`` (large N), summed in this launch."""
        return dx(x3, dy, stats.m, stats.v, pc, dm.contiguous(), dv.contiguous(), gsum, _act(act), batch,
                    pending)

    @staticmethod
    def guard(t):
        return device_guard(t)  # every launch on t's device and its current stream

    @staticmethod
    def compile_errors():
        return compile_errors()
