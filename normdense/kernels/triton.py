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
from typing import NamedTuple

import torch

from .activations import act_args
from .backend import Statistics, StatsRequest, compile_errors, device_guard, ncl
from .common import FINISH_BLOCK, acc_dtype, cdiv, cl_blocks, hi_lo, stacked
from .first_stage import FirstStage
from .launch import launcher
from .passes import _apply_kernel, _dx_kernel, _merge_kernel, _moments_kernel, _sums_kernel

ACT_NONE = -1  # y = A t + B, no activation
_NO_ACT = (ACT_NONE, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)  # (id, p0 hi, lo, p1 hi, lo) and the raw p0, p1

_TARGET_PROGRAMS = 1024  # enough programs to fill an H100's 132 SMs several times over
# rows: the pointers a site may give as an address (launch.Launcher): the coefficients (common.stacked), dm and dv,
# the first stage's update and mean (first_stage.FirstStage)
_MOMENTS, _MERGE = launcher(_moments_kernel), launcher(_merge_kernel)
_APPLY = launcher(_apply_kernel, rows=('a_ptr', 'b_ptr', 'k_ptr', 'l_ptr', 'upd_ptr'))
_SUMS = launcher(_sums_kernel, rows=('a_ptr', 'b_ptr', 'k_ptr'))
_DX = launcher(_dx_kernel, rows=('a_ptr', 'b_ptr', 'k_ptr', 'dm_ptr', 'dv_ptr', 'mean_ptr'))


def block_for(dtype: torch.dtype) -> int:
    return 512 if dtype == torch.float64 else 1024


def split_for(rows: int, length: int, block: int, split=None):
    """(SPLIT, CHUNK): how many programs share a row and how many positions each takes; ``split``: this many
    chunks per row (at most one per tile) instead of enough programs to fill the GPU."""
    tiles = cdiv(length, block)
    split = max(1, min(tiles, split or cdiv(_TARGET_PROGRAMS, max(rows, 1))))
    chunk = cdiv(tiles, split) * block
    return cdiv(length, chunk), chunk


_CL_FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}


def _cl_contiguous(t: torch.Tensor) -> bool:
    """t (N, C, *positions) lies in memory as (N, *positions, C): (N, C, L) viewed from (N, L, C), a
    channels_last map (N, C, H, W) or a channels_last_3d one."""
    if t.dim() == 3:
        return t.transpose(1, 2).is_contiguous()
    fmt = _CL_FORMATS.get(t.dim())
    return fmt is not None and t.is_contiguous(memory_format=fmt)


def _to_cl(t: torch.Tensor) -> torch.Tensor:
    """t copied into the (N, *positions, C) layout (t 3-, 4- or 5-dimensional)."""
    if t.dim() == 3:
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.contiguous(memory_format=_CL_FORMATS[t.dim()])


def channels_last(x3: torch.Tensor) -> bool:
    """x3 (N, C, *positions) is channels-last (``_cl_contiguous``) and not also contiguous."""
    return not x3.is_contiguous() and _cl_contiguous(x3)


def read_layout(x3: torch.Tensor):
    """(x3 as the passes read it, channels_last): x3 itself if NCL or CL, else a contiguous copy."""
    if x3.is_contiguous():
        return x3, False
    if _cl_contiguous(x3):
        return x3, True
    return x3.contiguous(), False


def as_read(x3: torch.Tensor) -> torch.Tensor:
    """x3 itself when the passes read its layout (NCL or CL), else a contiguous copy."""
    return read_layout(x3)[0]


def like(t: torch.Tensor, x3: torch.Tensor, cl=None) -> torch.Tensor:
    """t (x3's shape) in x3's layout: dy as the passes read it alongside x3 (a copy only if it differs);
    ``cl``: x3's layout, if known."""
    if channels_last(x3) if cl is None else cl:
        return t if _cl_contiguous(t) else _to_cl(t)
    return t.contiguous()


class Geometry(NamedTuple):
    """A pass's launch over x3: grid (3 axes), CHUNK and the constexprs."""
    grid: tuple
    chunk: int
    block: int
    block_c: int
    v: int
    cl: bool
    small: bool
    n: int  # x3's (N, C, L): the launches' integers
    c: int
    length: int


_GEOMETRY = {}  # (N, C, L, CL, x3's dtype, narrowest element size, split) -> Geometry: once per shape
_MAX_GEOMETRY = 4096  # variable input sizes (detection): past it the oldest goes


def _new_geometry(key) -> 'Geometry':
    if len(_GEOMETRY) >= _MAX_GEOMETRY:
        del _GEOMETRY[next(iter(_GEOMETRY))]
    g = _GEOMETRY[key] = _geometry(*key)
    return g


def _geometry(n, c, length, cl, dtype, narrowest, split):
    vec = 16 // narrowest  # V lanes of the narrowest dtype are 16 bytes (common.vector_width)
    if cl:
        block_c, block = cl_blocks(c, dtype.itemsize)
        groups = n * cdiv(c, block_c)
        split, chunk = split_for(groups, length, block, split)
        return Geometry((groups, split, 1), chunk, block, block_c, vec if c % vec == 0 else 1, True, False, n, c,
                        length)
    block = block_for(dtype)
    split, chunk = split_for(n * c, length, block, split)
    vec = vec if (n * c * length) % vec == 0 else 1
    return Geometry((n * c, split, 1), chunk, block, 1, vec, False, length < vec, n, c, length)


def _geom(x3, cl, other, split=None):
    """The geometry of a pass over x3 with the activation tensor ``other`` (y or dy): one dict lookup."""
    n, c, length = ncl(x3)
    size = x3.dtype.itemsize
    if other.dtype.itemsize < size:
        size = other.dtype.itemsize
    key = (n, c, length, cl, x3.dtype, size, split)
    g = _GEOMETRY.get(key)
    if g is None:
        g = _new_geometry(key)
    return g


# --- forward ------------------------------------------------------------------------------------------------
def _moment_partials(x3, cl, split=None, key=None):
    """(partials, the pass's :class:`Geometry`: the other passes' too where y and dy have x3's dtype)."""
    n, c, length = ncl(x3)
    g = _geom(x3, cl, x3, split)
    # new_empty with integers: a tuple or a dtype keyword costs the host twice as much
    part = x3.new_empty(g.grid[1], 2, n * c) if x3.dtype == torch.float32 or x3.dtype == torch.float64 else \
        x3.new_empty(g.grid[1], 2, n * c, dtype=torch.float32)
    args = (x3, part, n * c, c, length, g.chunk)
    if key is None or not _MOMENTS.hit(g.grid, args, key):
        _MOMENTS.launch(g.grid, args, {'BLOCK': g.block, 'BLOCK_C': g.block_c, 'V': g.v, 'CL': cl,
                                       'ACC': acc_dtype(x3.dtype)}, key)
    return part, g


_ACTS = {}  # id(Activation) -> (activation, its kernel arguments): one Activation object per configuration


def _act(act):
    """(ACT, p0 hi, p0 lo, p1 hi, p1 lo, p0, p1) of ``act``: an Activation, the (id, p0, p1) of
    :func:`normdense.kernels.activations.act_args`, or None."""
    if act is None:
        return _NO_ACT
    if isinstance(act, tuple):
        return (act[0], *hi_lo(act[1]), *hi_lo(act[2]), act[1], act[2])
    hit = _ACTS.get(id(act))
    if hit is None or hit[0] is not act:  # (kept alive in the entry: its id is not reused)
        ids = act_args(act.name, act.kwargs)
        hit = _ACTS[id(act)] = (act, (ids[0], *hi_lo(ids[1]), *hi_lo(ids[2]), ids[1], ids[2]))
    return hit[1]


def _apply(x3, cl, m, v, coeffs, act, out_dtype, write, nbt, split=None, key=None, out=None, first=None):
    """``first``: the engine's deferred first stage (``first_stage.FirstStage``): its geometry (the moments
    pass's, for a y of x3's dtype; else computed here), the tensor of its update's address (``write[0]``)."""
    g = None if first is None else first.geometry
    act_id = act[0]
    if out is not None:  # the engine's (x3's shape and layout, out_dtype)
        y = out
    elif out_dtype is None or out_dtype == x3.dtype:
        y = torch.empty_like(x3)
    else:
        y = torch.empty_like(x3, dtype=out_dtype)
    if g is None or y.dtype != x3.dtype:
        g = _geom(x3, cl, y, split)
    # the coefficients (``common.stacked``): their rows by address (_APPLY's rows)
    a, step = coeffs.data_ptr(), g.n * g.c * coeffs.itemsize
    upd, rm, rv = write if write is not None else (m, m, m)
    args = (x3, y, m, v,
            a, a + step,  # A, B
            *((a + 2 * step, a + 3 * step) if act_id >= 0 else (a, a + step)),  # K, L' (not read without act)
            upd, rm, rv,  # the buffers' new values (an address in the deferred first stage's), the buffers
            m if nbt is None else nbt,  # num_batches_tracked (not read without INC)
            g.c, g.length, g.chunk, int(write is not None), int(nbt is not None), act[1], act[2], act[3], act[4])
    if key is None or not _APPLY.hit(g.grid, args, key):
        _APPLY.launch(g.grid, _APPLY.bind(args, coeffs, first and first.chan),
                      {'ACT': act_id, 'BLOCK': g.block, 'BLOCK_C': g.block_c, 'V': g.v, 'SMALL': g.small, 'CL': cl,
                       'ACC': acc_dtype(x3.dtype)}, key)
    return y


# --- backward -----------------------------------------------------------------------------------------------
def _sums(x3, cl, dy, m, v, coeffs, act, merged=True, split=None, key=None, g=None):
    """``g``: as :func:`_apply`'s, for a dy of x3's dtype."""
    act_id = act[0]
    count = 2 if act_id < 0 else 4
    if g is None or dy.dtype != x3.dtype:
        g = _geom(x3, cl, dy, split)
    n, c, length = g.n, g.c, g.length
    split = g.grid[1]
    part = m.new_empty(split, count, n, c)
    a, step = coeffs.data_ptr(), n * c * coeffs.itemsize  # ``common.stacked``, as in _apply
    args = (x3, dy, part, m, v,
            a, a + step, a + 2 * step if act_id >= 0 else a,  # A, B, K (not read without act)
            n * c, c, length, g.chunk, act[1], act[2], act[3], act[4])
    if key is None or not _SUMS.hit(g.grid, args, key):
        _SUMS.launch(g.grid, _SUMS.bind(args, coeffs), {'ACT': act_id, 'BLOCK': g.block, 'BLOCK_C': g.block_c, 'V': g.v,
                                                         'CL': cl, 'ACC': acc_dtype(x3.dtype)}, key)
    if not merged:  # the layers' VJP kernels and dx read this buffer as it is (common.grad_buffer)
        return part
    if split > 1:
        out = m.new_empty(count, n, c)
        size = count * n * c
        _MERGE((cdiv(size, 1024), 1, 1), (part, out, size, split), {'BLOCK': 1024}, key)
    else:
        out = part[0]
    return out.unbind(0)


def _dx(x3, cl, dy, m, v, coeffs, dmv, gsum, act, batch=None, finish=None, split=None,
        finish_block=FINISH_BLOCK.value, key=None, g=None, first=None):
    """``coeffs``, ``dmv`` (dm and dv) as ``common.stacked`` makes them; ``g``: the moments pass's geometry, for
    a dy of x3's dtype; ``first``: the deferred first stage whose mean's address ``batch`` may hold."""
    act_id = act[0]
    out = torch.empty_like(x3)  # x3's shape (the engine's: x's), dtype and layout
    if g is None or dy.dtype != x3.dtype:
        g = _geom(x3, cl, dy, split)
    # the coefficients and [dm; dv] (``common.stacked``): their rows by address on a kept launch
    a, d, step = coeffs.data_ptr(), dmv.data_ptr(), g.n * g.c * coeffs.itemsize
    mean, dmean, dvar, scale = batch if batch is not None else (m, m, m, 0.0)
    # sum_l g: (N, C), its (SPLIT, N, C) chunk partials, or the second of the sums kernel's (SPLIT, count, N, C)
    if gsum.dim() == 2:
        goff, gsplit, gstride = 0, 1, 0
    else:
        goff, gsplit, gstride = gsum.stride(1) if gsum.dim() == 4 else 0, gsum.shape[0], gsum.stride(0)
    # dmean, dvar: the rows of one BlockSums buffer (one stride) at large N
    bsplit, bstride = (dmean.shape[0], dmean.stride(0)) if batch is not None and dmean.dim() == 2 else (1, 0)
    src, dst, fin_p, fin_sb, fin_stride = finish.dx_args(g.grid[0], finish_block) if finish is not None else \
        (m, m, 0, 1, 0)
    args = (x3, dy, out, m, v,
            a, a + step, a + 2 * step if act_id >= 0 else a,  # A, B, K (not read without act)
            d, d + g.n * g.c * dmv.itemsize,  # dm, dv
            gsum,
            mean, dmean, dvar,  # the batch statistics' mean (an address in the deferred first stage's) and VJP
            src, dst, g.c, g.length, g.chunk, goff, gsplit, gstride, bsplit, bstride, fin_p, fin_sb, fin_stride,
            *hi_lo(scale), act[1], act[2], act[3], act[4])
    if key is None or not _DX.hit(g.grid, args, key):
        _DX.launch(g.grid, _DX.bind(args, coeffs, dmv, first and first.chan),
                   {'ACT': act_id, 'BATCH': batch is not None, 'BLOCK': g.block, 'BLOCK_C': g.block_c, 'V': g.v,
                    'SMALL': g.small, 'CL': cl, 'ACC': acc_dtype(x3.dtype), 'FINISH': fin_p > 0}, key)
    return out


def _dy_key(key, dy):
    """The call's launch-cache key for the passes that read dy (its dtype too): None where dy is not 16-byte
    aligned."""
    return None if key is None or dy.data_ptr() & 15 else key + (dy.dtype, )


class TritonBackend:
    """:class:`normdense.kernels.backend.Backend` on the Triton passes; x3 in one of the layouts of
    ``as_read``, dy in x3's, ``act`` as :meth:`act_form` makes it. The launches go through ``launch.Launcher``
    under the request's ``key``."""
    name = 'triton'
    kernel_maps = True

    @staticmethod
    def first_stage(x3, request: StatsRequest, deferred: bool = True):
        """The chunks' moments (one launch); the first stage deferred to the coefficient map's launch
        (``deferred``), or merged now in the stats kernel (where torch code reads m, v first: ``sync_stats``)."""
        cl = False  # (N, C, L) rows or channels_last (N, L, C) in place, else a copy
        if not x3.is_contiguous():
            x3, cl = read_layout(x3)
        r = request
        partials, g = _moment_partials(x3, cl, None, r.key)
        first = FirstStage(partials, g.grid[1], g.chunk, (g.n, g.c, g.length), mode=r.mode, stat_mean=r.stat_mean,
                           stat_var=r.stat_var, base=r.base, rate=r.rate, momentum=r.momentum, write=r.write, nbt=r.nbt,
                           key=r.key)
        first.geometry = g  # the later passes' where y and dy have x3's dtype
        if deferred:  # mean, var and the update by address (the kept launches take them so; ``FirstStage``)
            return x3, Statistics(m=first.m, v=first.v, mean=first.mean, var=first.var, moved=first.moved,
                                  update=first.update, first=first, out=None, request=request)
        o = first.launch()
        return x3, Statistics(m=o.m, v=o.v, mean=o.mean, var=o.var, moved=o.moved, update=o.update, first=None,
                              out=None, request=request)

    read_input = staticmethod(as_read)

    @staticmethod
    def prepare(coeffs, v):
        return stacked(coeffs)  # the kernels mask A where v = 0 themselves

    @staticmethod
    def apply(x3, stats: Statistics, coeffs, act=None, out_dtype=None, out=None):
        pc = coeffs if stats.first is not None else TritonBackend.prepare(coeffs, stats.v)  # kernel maps' own
        request = stats.request
        write = None if stats.update is None else (stats.update, request.stat_mean, request.stat_var)
        first = stats.first
        y = _apply(x3, not x3.is_contiguous(), stats.m, stats.v, pc, act or _NO_ACT, out_dtype, write, request.nbt,
                   key=request.key, out=out, first=first)
        if first is not None:
            first.fold = None  # the map's launch ran it: the moments' partials go (the record may live to backward)
        return y, pc

    @staticmethod
    def grad_layout(dy, x3):
        """dy (in x3's shape: x's) in x3's layout, in whatever dtype it came (the kernels read it as it is: no
        cast pass)."""
        if x3.is_contiguous():
            return dy.contiguous()
        return dy if _cl_contiguous(dy) else _to_cl(dy)  # like(dy, x3, True), inlined: every backward

    @staticmethod
    def sums(x3, dy, stats: Statistics, pc, act=None, merged=True):
        """The coefficients' gradients, each (N, C), or (``merged`` False) the chunks' partials of all of them in one
        (SPLIT, count, N, C) buffer, which the layers' Triton VJP kernels and dx add as they load them."""
        key = _dy_key(stats.request.key, dy)
        # the state for dx: whether the VJP was torch's (merged sums; its dm, dv may be strided), dy's launch key
        g = None if stats.first is None else stats.first.geometry  # the forward's (kept with its first stage)
        return _sums(x3, not x3.is_contiguous(), dy, stats.m, stats.v, pc, act or _NO_ACT, merged, key=key, g=g), \
            (merged, key, g)

    @staticmethod
    def dx(x3, dy, stats: Statistics, pc, dm, dv, grads, act=None, batch=None, state=None, pending=None):
        """dx; ``grads``: what :meth:`sums` returned (the kernel's buffer as it is: no view of sum_l g);
        ``pending``: a layer VJP's ``common.BlockSums`` (large N), summed in this launch. ``dv`` None: ``dm`` is a
        kernel VJP's stacked [dm; dv] (its ``defer``)."""
        merged, key, g = state
        if merged:  # the torch VJP's dm, dv (separate, maybe strided) and merged sums
            grads = grads[1]
        return _dx(x3, not x3.is_contiguous(), dy, stats.m, stats.v, pc, dm if dv is None else stacked((dm, dv)), grads,
                   act or _NO_ACT, batch, pending, key=key, g=g, first=stats.first)

    @staticmethod
    def act_form(act):
        return _act(act)  # (ACT, p0 hi, lo, p1 hi, lo, p0, p1): once per layer plan

    @staticmethod
    def guard(t):
        return device_guard(t)  # every launch on t's device and its current stream

    @staticmethod
    def compile_errors():
        return compile_errors()
