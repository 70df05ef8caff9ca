"""The passes of the StatNorm engine over the activation, in Triton: per-(n, c) moments, the first-stage
statistics, y = A (x - m) + B (or K act(A (x - m) + B) + L'), the backward's per-(n, c) sums and dx. The
kernels over the activation live in ``passes_fwd`` / ``passes_bwd``, where they read and write it with
16-byte vectors (``passes_tiles``); this module holds their launchers (the first stage is ``first_stage``).

x3 (N, C, L) comes contiguous (NCL: R = N * C rows of L positions) or as a channels_last map viewed as
(N, C, HW) (strides (C L, 1, C): read as it is, no copy; y and dx are written with x3's strides). A pass runs
on a grid of (row groups, splits): each program takes its rows (NCL: one; CL: a block of channels of one
sample) and a chunk of CHUNK consecutive positions (a runtime integer, a multiple of the tile), loops over it
in tiles and loads x, dy in their own dtype, accumulating in float32 (float64 for float64 inputs).
Reductions write one partial per (split, row); the kernel that reads them adds them in a fixed order
(deterministic, no atomics). The tiles depend on the dtype (and CL's on C), SPLIT is a grid size and the sizes are
``do_not_specialize`` (no variant for a size divisible by 16 or equal to 1): a new image size or batch
size never recompiles a kernel. The constexpr variants: layout (NCL / CL), vector width V (16 bytes, or 1
when the flat size (NCL) or C (CL) is not a multiple of it) and SMALL (NCL, L < V).

Launches per training step of a layer: forward moments, the layer's coefficients (the first stage folded
in), apply (3); backward sums, the layer's coefficient VJP (adding the chunks' sums), dx (3): 6. The stats
and merge kernels run only where torch code reads m, v or the sums in between (``sync_stats``).

Moments per chunk: each tile's mean and centred sum of squares in registers (two passes over the tile,
one read of memory), merged into the chunk's with Chan et al.'s update; chunks merged likewise by the
first stage. No E[x^2] - E[x]^2 anywhere.
"""
import torch
import triton
import triton.language as tl

from .backend import STATS_BATCH, STATS_ESTIMATE, STATS_FIXED, STATS_NONE  # noqa: F401  (the stats modes)
from .first_stage import _stats_kernel, stats  # noqa: F401  (the first stage: its own file, shared with the maps)
from .passes_bwd import _dx_kernel, _merge_kernel, _sums_kernel
from .passes_fwd import _apply_kernel, _moments_kernel
from .passes_tiles import cl_blocks, vector_width
from .scalars import hi_lo

ACT_NONE = -1  # y = A t + B, no activation

_TARGET_PROGRAMS = 1024  # enough programs to fill an H100's 132 SMs several times over


def acc_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def block_for(dtype: torch.dtype) -> int:
    return 512 if dtype == torch.float64 else 1024


FORCE_SPLIT = None  # tests: this many chunks per row (at most one per tile)


def split_for(rows: int, length: int, block: int):
    """(SPLIT, CHUNK): how many programs share a row and how many positions each takes."""
    tiles = triton.cdiv(length, block)
    split = max(1, min(tiles, FORCE_SPLIT or triton.cdiv(_TARGET_PROGRAMS, max(rows, 1))))
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


def _plan(x3: torch.Tensor, *others):
    """Launch geometry of a pass over x3 (read layout) with the activation tensors ``others`` (dy, y):
    dict(grid, CHUNK and the constexprs BLOCK, BLOCK_C, V, CL[, SMALL])."""
    n, c, length = x3.shape
    vec = vector_width(x3, *others)
    if channels_last(x3):
        block_c, block = cl_blocks(c, x3.element_size())
        groups = n * triton.cdiv(c, block_c)
        split, chunk = split_for(groups, length, block)
        return dict(grid=(groups, split), CHUNK=chunk, BLOCK=block, BLOCK_C=block_c,
                    V=vec if c % vec == 0 else 1, CL=True, SMALL=False)
    block = block_for(x3.dtype)
    split, chunk = split_for(n * c, length, block)
    vec = vec if (n * c * length) % vec == 0 else 1
    return dict(grid=(n * c, split), CHUNK=chunk, BLOCK=block, BLOCK_C=1, V=vec, CL=False, SMALL=length < vec)


def layout(x3: torch.Tensor):
    """(BLOCK, SPLIT, CHUNK) of every pass over x3 (N, C, L): positions per tile, chunks per row, positions
    per chunk."""
    plan = _plan(as_read(x3))
    return plan['BLOCK'], plan['grid'][1], plan['CHUNK']


# --- forward ------------------------------------------------------------------------------------------------
def moment_partials(x3: torch.Tensor):
    """(partials (SPLIT, 2, N*C): each chunk's mean and centred sum of squares; SPLIT; CHUNK) of x3 (N, C, L)."""
    x3 = as_read(x3)
    n, c, length = x3.shape
    rows = n * c
    plan = _plan(x3)
    acc = torch.float64 if x3.dtype == torch.float64 else torch.float32
    split = plan['grid'][1]
    part = torch.empty(split, 2, rows, dtype=acc, device=x3.device)
    _moments_kernel[plan['grid']](x3, part, rows, c, length, plan['CHUNK'], BLOCK=plan['BLOCK'],
                                  BLOCK_C=plan['BLOCK_C'], V=plan['V'], CL=plan['CL'], ACC=acc_dtype(x3.dtype))
    return part, split, plan['CHUNK']


def _act(act):
    return (ACT_NONE, 0.0, 0.0) if act is None else act


def apply(x3, m, v, coeffs, act=None, out_dtype=None, write=None, nbt=None):
    """y (N, C, L) of x3 with the per-(n, c) coefficients (A, B[, K, L']), in x3's layout (NCL or
    channels_last); ``act`` (id, p0, p1) from :func:`normdense.kernels.activations.act_args` or None;
    ``write`` = (upd, running_mean, running_var): the new values to copy into the buffers; ``nbt``: a
    num_batches_tracked to add 1 to."""
    x3 = as_read(x3)
    n, c, length = x3.shape
    act_id, p0, p1 = _act(act)
    y = torch.empty_like(x3, dtype=out_dtype or x3.dtype)
    plan = _plan(x3, y)
    a, b = coeffs[0], coeffs[1]
    k, l_ = (coeffs[2], coeffs[3]) if act_id >= 0 else (a, b)
    upd, rm, rv = write if write is not None else (m, m, m)
    _apply_kernel[plan['grid']](x3, y, m, v, a, b, k, l_, upd, rm, rv, m if nbt is None else nbt, c, length,
                                plan['CHUNK'], int(write is not None), int(nbt is not None), *hi_lo(p0),
                                *hi_lo(p1), ACT=act_id, BLOCK=plan['BLOCK'], BLOCK_C=plan['BLOCK_C'],
                                V=plan['V'], SMALL=plan['SMALL'], CL=plan['CL'], ACC=acc_dtype(x3.dtype))
    return y


# --- backward -----------------------------------------------------------------------------------------------
def sums(x3, dy, m, v, coeffs, act=None, merged=True):
    """The gradients of the coefficients: [sum_l g t, sum_l g] (and sum_l dy act(z), sum_l dy with an
    activation), each (N, C) in the coefficients' dtype; a merge launch only when rows are split. ``merged``
    False: each as the chunks' partials (SPLIT, N, C) instead, for kernels that add them as they load them
    (the layers' VJP kernels, :func:`dx`): no merge launch. dy in any floating dtype, in x3's layout (else
    copied into it)."""
    x3 = as_read(x3)
    dy = like(dy, x3)
    n, c, length = x3.shape
    act_id, p0, p1 = _act(act)
    count = 2 if act_id < 0 else 4
    plan = _plan(x3, dy)
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


def dx(x3, dy, m, v, coeffs, dm, dv, gsum, act=None, batch=None, finish=None):
    """dx (x3's shape, dtype and layout) from the coefficients' VJP (dm, dv) and sum_l g (``gsum``: (N, C), or
    the (SPLIT, N, C) partials of ``sums(merged=False)``, added in the kernel); ``batch``
    = (mean, dmean, dvar, 1 / N) adds the VJP of the (unsynchronized) batch statistics, dmean and dvar (C,) or
    the (SB, C) partials of the VJP's sample blocks (added in the kernel). ``finish``: the VJP's
    ``second_stage.BlockSums`` whose partial parameter gradients this launch sums. dy as for :func:`sums`."""
    x3 = as_read(x3)
    dy = like(dy, x3)
    n, c, length = x3.shape
    act_id, p0, p1 = _act(act)
    out = torch.empty_like(x3)
    plan = _plan(x3, dy)
    a, b = coeffs[0], coeffs[1]
    k = coeffs[2] if act_id >= 0 else a
    mean, dmean, dvar, scale = batch if batch is not None else (m, m, m, 0.0)
    gsplit, gstride = (gsum.shape[0], gsum.stride(0)) if gsum.dim() == 3 else (1, 0)
    # dmean, dvar: the rows of one BlockSums buffer (one stride) at large N
    bsplit, bstride = (dmean.shape[0], dmean.stride(0)) if batch is not None and dmean.dim() == 2 else (1, 0)
    src, dst, fin_p, fin_sb, fin_stride = finish.dx_args(plan['grid'][0]) if finish is not None else (m, m, 0, 1, 0)
    _dx_kernel[plan['grid']](x3, dy, out, m, v, a, b, k, dm, dv, gsum, mean, dmean, dvar, src, dst, c, length,
                             plan['CHUNK'], gsplit, gstride, bsplit, bstride, fin_p, fin_sb, fin_stride,
                             *hi_lo(scale), *hi_lo(p0), *hi_lo(p1), ACT=act_id,
                             BATCH=batch is not None, BLOCK=plan['BLOCK'], BLOCK_C=plan['BLOCK_C'], V=plan['V'],
                             SMALL=plan['SMALL'], CL=plan['CL'], ACC=acc_dtype(x3.dtype), FINISH=fin_p > 0)
    return out
