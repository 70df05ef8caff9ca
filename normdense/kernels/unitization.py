"""Unitization's channel-sized coefficient map and its closed-form VJP as one Triton launch each: the Triton
transcription of ``normdense.layers.unitization.coeff_map`` / ``coeff_vjp`` (Huang et al., "An Internal Covariate Shift
Bounding Algorithm for Deep Neural Networks by Unitizing Layers' Outputs", CVPR 2020, arXiv:2001.02814;
Algorithm 2 lines 5-14, Eq. 16).

Per (n, c), with the moments m, v of x[n, c, :], stage 1's statistics mean, var (C,) and L positions::

    rs = 1 / sqrt(f var + eps)        f = the training variance factor (1, or m / (m - 1 - eps))
    e  = v + (m - mean)^2             mean over positions of (x - mean)^2
    p  = 1 / sqrt(k sum_c e rs^2 + eps)     per sample; k = L / divisor (Algorithm 2 lines 9-10)
    A  = gamma (p alpha + 1 - alpha) rs,    B = A (m - mean) + beta

The options (``n``, ``norm_divisor``, ``var_correction``, batch or fixed statistics) reach the kernels only
as the scalars k and f, computed by the launchers as the torch method does. Python floats reach a kernel as
fp32, so each scalar travels as an fp32 pair (hi, lo) with hi + lo equal to it to ~2^-48 (float64 inputs).

Layout: the map runs one program per block of samples (two loops over the channel blocks: p, then A, B); the
VJP one program per (block of channels, block of samples), which first sums its samples' d p terms over all
channels (recomputed by every program) and then sums over its samples (``common.BlockSums`` at large N).
"""
import functools
from typing import Any, NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import (BlockSums, cdiv, from_hi_lo, grad_buffer, hi_lo, next_pow2, rsqrt, sample_blocks,
                     split_sum)
from .backend import Row
from .first_stage import FOLD_SIZES, fold, fold_args, fold_consts
from .launch import launcher


@functools.lru_cache(maxsize=256)
def _blocks(channels: int, dtype=torch.float32):
    """(BLOCK_N, BLOCK_C) for C channels: tiles of at most 1024 elements (256 in float64: no spills)."""
    block_c = min(next_pow2(channels), 128)
    return min(16, (256 if dtype == torch.float64 else 1024) // block_c), block_c


@triton.jit
def _stage1_tile(rows, rmask, cols, C, mean_ptr, var_ptr, f, eps, dt):
    """A (samples, channels) tile: (channel mask, tile mask, offsets, stage 1's mean, var * f + eps)."""
    cmask = cols < C
    mask = rmask[:, None] & cmask[None, :]
    mean = tl.load(mean_ptr + cols, mask=cmask, other=0.0).to(dt)
    den = tl.load(var_ptr + cols, mask=cmask, other=1.0).to(dt) * f + eps
    return cmask, mask, rows[:, None] * C + cols[None, :], mean, den


@triton.jit(do_not_specialize=['N', 'C'] + FOLD_SIZES)
def _coeff_map_kernel(m_ptr, v_ptr, mean_ptr, var_ptr, alpha_ptr, w_ptr, b_ptr, a_ptr, bo_ptr, p_ptr, rs_ptr, N, C,
                      eps_hi, eps_lo, k_hi, k_lo, f_hi, f_lo, F, fL, fCHUNK, fSPLIT, fWRITE,
                      AFFINE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, FOLD: tl.constexpr,
                      FMODE: tl.constexpr, FCUM: tl.constexpr, FBLOCK_N: tl.constexpr,
                      FBLOCK_C: tl.constexpr):
    dt = m_ptr.dtype.element_ty
    eps, k, f = from_hi_lo(eps_hi, eps_lo, dt), from_hi_lo(k_hi, k_lo, dt), from_hi_lo(f_hi, f_lo, dt)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    if FOLD:  # the first stage of every channel (p sums over all) and this program's samples, in this launch
        n_lo = tl.program_id(0) * BLOCK_N
        fold(F, N, C, fL, fCHUNK, fSPLIT, fWRITE, 0, C, n_lo,
             tl.minimum(n_lo + BLOCK_N, N), tl.program_id(0) == 0, FMODE, FCUM, FBLOCK_N, FBLOCK_C, dt)
    cols0 = tl.arange(0, BLOCK_C)
    # sum_c e rs^2 per sample (Algorithm 2 lines 9-10); padded lanes give e = 0
    s = tl.zeros([BLOCK_N], dtype=dt)
    for c0 in range(0, C, BLOCK_C):
        cmask, mask, idx, mean, den = _stage1_tile(rows, rmask, c0 + cols0, C, mean_ptr, var_ptr, f, eps, dt)
        rs2 = 1.0 / den
        mc = tl.load(m_ptr + idx, mask=mask, other=0.0) - mean[None, :]
        e = tl.load(v_ptr + idx, mask=mask, other=0.0) + mc * mc
        s += tl.sum(tl.where(mask, e * rs2[None, :], 0.0), axis=1)
    p = rsqrt(s * k + eps)  # Eq. 16
    tl.store(p_ptr + rows, p, mask=rmask)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + cols0
        cmask, mask, idx, mean, den = _stage1_tile(rows, rmask, cols, C, mean_ptr, var_ptr, f, eps, dt)
        alpha = tl.load(alpha_ptr + cols, mask=cmask, other=0.0).to(dt)
        rs = rsqrt(den)
        # for the VJP (no float64 division there: no spills)
        tl.store(rs_ptr + cols, rs, mask=cmask & (tl.program_id(0) == 0))
        mc = tl.load(m_ptr + idx, mask=mask, other=0.0) - mean[None, :]
        scale = p[:, None] * alpha[None, :] + (1.0 - alpha)[None, :]
        if AFFINE:
            w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(dt)
            beta = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(dt)
            a = scale * (w * rs)[None, :]
            b = a * mc + beta[None, :]
        else:
            a = scale * rs[None, :]
            b = a * mc
        tl.store(a_ptr + idx, a, mask=mask)
        tl.store(bo_ptr + idx, b, mask=mask)


@triton.jit
def _own(mean_ptr, rs_ptr, alpha_ptr, w_ptr, cols, cmask, dt, AFFINE: tl.constexpr):
    """A VJP program's channels: stage 1's mean, rs = 1 / sqrt(f var + eps) as the map computed it, alpha, gamma."""
    mean = tl.load(mean_ptr + cols, mask=cmask, other=0.0).to(dt)
    rs = tl.load(rs_ptr + cols, mask=cmask, other=0.0)
    alpha = tl.load(alpha_ptr + cols, mask=cmask, other=0.0).to(dt)
    if AFFINE:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(dt)
    else:
        w = tl.full(cols.shape, 1.0, dt)
    return mean, rs, alpha, w


@triton.jit(do_not_specialize=['N', 'C', 'GSPLIT', 'GSTRIDE', 'GK', 'N_PER', 'PSTRIDE'])
def _coeff_vjp_kernel(m_ptr, v_ptr, mean_ptr, rs_ptr, alpha_ptr, w_ptr, p_ptr, ga_ptr,
                      dm_ptr, de_ptr, dmean_ptr, dvar_ptr, dalpha_ptr, dw_ptr, db_ptr, N, C, GSPLIT, GSTRIDE, GK,
                      N_PER, PSTRIDE, k_hi, k_lo, f_hi, f_lo,
                      AFFINE: tl.constexpr, WANTS_STATS: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    dt = m_ptr.dtype.element_ty
    k, f = from_hi_lo(k_hi, k_lo, dt), from_hi_lo(f_hi, f_lo, dt)
    # gradient k of the sums' buffer at offset k GK (common.grad_buffer): offsets, not pointers derived from
    # ga_ptr (one held across the loops spilled fp64 registers in BCN's VJP kernel)
    rows0 = tl.arange(0, BLOCK_N)
    cols0 = tl.arange(0, BLOCK_C)
    # this program's channels (mean, rs, alpha, gamma loaded where used: no spills across the channel loop)
    cols = tl.program_id(0) * BLOCK_C + cols0
    cmask = cols < C
    dalpha = tl.zeros([BLOCK_C], dtype=dt)
    dw = tl.zeros([BLOCK_C], dtype=dt)
    db = tl.zeros([BLOCK_C], dtype=dt)
    dmean = tl.zeros([BLOCK_C], dtype=dt)
    g_scale_sum = tl.zeros([BLOCK_C], dtype=dt)  # sum_n ga_t scale
    ds_e_sum = tl.zeros([BLOCK_C], dtype=dt)  # sum_n ds e
    # this program's samples: block program_id(1) of N_PER, a multiple of BLOCK_N
    for n0 in range(0, N_PER, BLOCK_N):
        rows = tl.program_id(1) * N_PER + n0 + rows0
        rmask = rows < N
        p = tl.load(p_ptr + rows, mask=rmask, other=1.0)
        # t_n = sum over ALL channels of d loss / d sc0 * alpha (every program recomputes it)
        t = tl.zeros([BLOCK_N], dtype=dt)
        for c0 in range(0, C, BLOCK_C):
            cj = c0 + cols0
            cjm = cj < C
            mask = rmask[:, None] & cjm[None, :]
            idx = rows[:, None] * C + cj[None, :]
            mean_j = tl.load(mean_ptr + cj, mask=cjm, other=0.0).to(dt)
            coef = tl.load(alpha_ptr + cj, mask=cjm, other=0.0).to(dt) * tl.load(rs_ptr + cj, mask=cjm, other=0.0)
            if AFFINE:
                coef = coef * tl.load(w_ptr + cj, mask=cjm, other=0.0).to(dt)
            ga_t = (split_sum(ga_ptr, idx, mask, GSPLIT, GSTRIDE, dt)
                    + split_sum(ga_ptr, idx + GK, mask, GSPLIT, GSTRIDE, dt)
                    * (tl.load(m_ptr + idx, mask=mask, other=0.0) - mean_j[None, :]))
            t += tl.sum(tl.where(mask, ga_t * coef[None, :], 0.0), axis=1)
        ds = t * p * p * p * (-0.5 * k)  # d loss / d (sum_c e rs^2), per sample
        mean, rs, alpha, w = _own(mean_ptr, rs_ptr, alpha_ptr, w_ptr, cols, cmask, dt, AFFINE)
        rs2 = rs * rs
        mask = rmask[:, None] & cmask[None, :]
        idx = rows[:, None] * C + cols[None, :]
        ga = split_sum(ga_ptr, idx, mask, GSPLIT, GSTRIDE, dt)
        gb = split_sum(ga_ptr, idx + GK, mask, GSPLIT, GSTRIDE, dt)
        mc = tl.load(m_ptr + idx, mask=mask, other=0.0) - mean[None, :]
        ga_t = ga + gb * mc  # B = A mc + beta
        sc0 = p[:, None] * alpha[None, :] + (1.0 - alpha)[None, :]
        scale = sc0 * w[None, :]
        g_scale = ga_t * rs[None, :]
        de = ds[:, None] * rs2[None, :]
        dm = gb * (scale * rs[None, :]) + 2.0 * de * mc
        tl.store(dm_ptr + idx, dm, mask=mask)
        tl.store(de_ptr + idx, de, mask=mask)
        dalpha += tl.sum(tl.where(mask, g_scale * w[None, :] * (p[:, None] - 1.0), 0.0), axis=0)
        if AFFINE:
            dw += tl.sum(tl.where(mask, g_scale * sc0, 0.0), axis=0)
            db += tl.sum(tl.where(mask, gb, 0.0), axis=0)
        if WANTS_STATS:
            dmean -= tl.sum(tl.where(mask, dm, 0.0), axis=0)
            g_scale_sum += tl.sum(tl.where(mask, ga_t * scale, 0.0), axis=0)
            e = tl.load(v_ptr + idx, mask=mask, other=0.0) + mc * mc
            ds_e_sum += tl.sum(tl.where(mask, ds[:, None] * e, 0.0), axis=0)
    cols = cols + tl.program_id(1) * PSTRIDE  # this sample block's row of partial sums (0: the final values)
    tl.store(dalpha_ptr + cols, dalpha, mask=cmask)
    if AFFINE:
        tl.store(dw_ptr + cols, dw, mask=cmask)
        tl.store(db_ptr + cols, db, mask=cmask)
    if WANTS_STATS:
        tl.store(dmean_ptr + cols, dmean, mask=cmask)
        # the channels' rs again (cols shifted back: fewer spills)
        rs = tl.load(rs_ptr + cols - tl.program_id(1) * PSTRIDE, mask=cmask, other=0.0)
        rs2 = rs * rs
        g_rs = g_scale_sum + 2.0 * rs * ds_e_sum
        tl.store(dvar_ptr + cols, g_rs * rs2 * rs * (-0.5 * f), mask=cmask)


@functools.lru_cache(maxsize=1024)
class Scalars(NamedTuple):
    """The map's float arguments, each as its (hi, lo) pair (``common.hi_lo``): eps, k = positions / divisor and
    f, ``Unitization2d._var_factor``."""
    eps_hi: float
    eps_lo: float
    k_hi: float
    k_lo: float
    f_hi: float
    f_lo: float


@functools.lru_cache(maxsize=1024)
def _scalars(eps, positions, count, n, norm_divisor, var_correction) -> Scalars:
    """The :class:`Scalars` as ``Unitization2d`` computes them: once per configuration and size (``count``: an
    int or None; the kernel maps never take an all-reduced one)."""
    if n is not None:
        divisor = float(n)
    else:
        divisor = float(positions) ** (2 if norm_divisor == 'hw_squared' else 1)
    f = count / (count - 1 - eps) if count is not None and var_correction == 'keras' else 1.0
    return Scalars(*hi_lo(float(eps)), *hi_lo(positions / divisor), *hi_lo(f))


class LaunchConfig(NamedTuple):
    """The launches of one configuration and size: the map's grid and constexprs, the VJP's grid, its sample
    blocks (``common.sample_blocks``) and constexprs."""
    map_grid: tuple
    map_consts: dict
    vjp_grid: tuple
    blocks: int
    n_per: int
    vjp_consts: dict


@functools.lru_cache(maxsize=1024)
def _launch_config(n: int, c: int, dtype, affine: bool, wants_stats: bool) -> LaunchConfig:
    block_n, block_c = _blocks(c, dtype)
    grid = cdiv(c, block_c)
    blocks, n_per = sample_blocks(n, block_n, grid)
    return LaunchConfig((cdiv(n, block_n), 1, 1), {'AFFINE': affine, 'BLOCK_N': block_n, 'BLOCK_C': block_c},
                        (grid, blocks, 1), blocks, n_per,
                        {'AFFINE': affine, 'WANTS_STATS': wants_stats, 'BLOCK_N': block_n, 'BLOCK_C': block_c,
                         # tiny tiles (small C): fewer idle threads, fewer spills
                         'num_warps': max(1, min(4, block_n * block_c // 32))})


class Residuals(NamedTuple):
    """What :func:`coeff_vjp` reads of :func:`coeff_map`'s call."""
    m: Tensor
    v: Tensor
    mean: Row  # (C,), or the address of a deferred first stage's row
    rs: Tensor  # 1 / sqrt(var + eps) (C,), written by the map
    alpha: Tensor
    w: Optional[Tensor]  # gamma, or None without affine
    p: Tensor  # Eq. 16's p per sample (N,), written by the map
    scalars: Scalars
    key: Optional[tuple]  # the call's launch-cache key
    first: Any  # the deferred first stage (a ``first_stage.FirstStage``), or None


# rows (launch.Launcher): the deferred first stage's mean and var, A and B; the mean again, dm and dv
_MAP = launcher(_coeff_map_kernel, rows=('mean_ptr', 'var_ptr', 'a_ptr', 'bo_ptr'))
_VJP = launcher(_coeff_vjp_kernel, rows=('mean_ptr', 'dm_ptr', 'de_ptr'))


def coeff_map(m, v, mean, var, params, positions, count, *, eps, affine, n=None, norm_divisor='hw',
              var_correction='none', first=None):
    """``normdense.layers.unitization.coeff_map`` in one launch: ((A, B), res) for y = A (x - m) + B, each (N, C),
    the rows of one (2, N, C) tensor.

    ``count`` (an int) marks batch statistics (its variance factor applies), None fixed ones (estimate mode,
    eval). ``res`` holds the inputs, p, rs = 1 / sqrt(f var + eps) (C,) and the scalars: the VJP recomputes
    the rest. ``first``: the engine's deferred first stage (``first_stage.FirstStage``, whose outputs m, v,
    mean, var are): run in this launch, its launch-cache key extended by this launch's.
    """
    alpha, w, b = params
    N, C = m.shape
    if first is None:  # the deferred stage's outputs are contiguous allocations
        m, v, mean, var = m.contiguous(), v.contiguous(), mean.contiguous(), var.contiguous()
    launch = _launch_config(N, C, m.dtype, affine, False)
    grid, consts = launch.map_grid, launch.map_consts
    coeffs = m.new_empty(2, N, C)  # A, B: one tensor object (its rows by address on a kept launch)
    p, rs = m.new_empty(N), m.new_empty(C)
    scalars = _scalars(eps, positions, count, n, norm_divisor, var_correction)
    fargs, fconst = fold_args(None, m) if first is None else (first.fold, None)  # its constexprs on a miss
    key = None if first is None else first.key  # the call's (``launch.Launcher``)
    a = coeffs.data_ptr()
    args = (m, v, mean, var,  # mean, var: addresses in a deferred first stage's rows
            alpha, w if affine else alpha, b if affine else alpha,  # (alpha in the unused places: not read)
            a, a + N * C * coeffs.itemsize,  # A, B
            p, rs, N, C, *scalars, *fargs)
    if key is None or not _MAP.hit(grid, args, key):
        _MAP.launch(grid, _MAP.bind(args, coeffs, first and first.chan), {**consts, **(fconst or fold_consts(first))},
                    key)
    return coeffs, Residuals(m=m, v=v, mean=mean, rs=rs, alpha=alpha, w=w if affine else None, p=p, scalars=scalars,
                             key=key, first=first)


def coeff_vjp(res, grads, wants_stats, *, affine, defer=False):
    """``Unitization2d.coeff_vjp`` in one launch: (dm, dv, dmean, dvar, (d alpha, d weight, d bias)),
    dmean/dvar only when ``wants_stats``, d weight/d bias only with ``affine``; for ``grads`` (gA, gB): the sums
    kernel's (SPLIT, 2, N, C) chunk partials (added in the kernel), or each (N, C) or (SPLIT, N, C)
    (``common.grad_buffer``). dm, dv, dmean, dvar in m's dtype, the
    parameter gradients in the parameters' dtypes. Many samples run on sample blocks too (``common.BlockSums``):
    ``defer`` returns their partials, dmean, dvar (SB, C) and a ``BlockSums`` in place of the parameter
    gradients, for dx to sum; else they are summed here. ``defer`` (the engine's: dx follows) also returns
    dm, dv as one (2, N, C) buffer in dm's place, dv None (``triton.dx`` takes them so)."""
    m, v, mean, rs, alpha, w, p = res.m, res.v, res.mean, res.rs, res.alpha, res.w, res.p
    scalars, key, first = res.scalars, res.key, res.first
    g, gsplit, gstride, gk = grad_buffer(grads)
    N, C = m.shape
    launch = _launch_config(N, C, m.dtype, affine, bool(wants_stats))
    grid, blocks, n_per, consts = launch.vjp_grid, launch.blocks, launch.n_per, launch.vjp_consts
    dmv = m.new_empty(2, N, C)  # dm, dv: one tensor object
    out = BlockSums(blocks, m, (alpha, w, w if affine else None), wants_stats)
    dalpha, dw, db, dmean, dvar = out.slots
    d = dmv.data_ptr()
    args = (m, v, mean,  # as in coeff_map
            rs, alpha, w if affine else alpha, p, g,
            d, d + N * C * dmv.itemsize,  # dm, dv
            dmean, dvar, dalpha, dw, db, N, C, gsplit, gstride, gk, n_per, out.stride,
            scalars.k_hi, scalars.k_lo, scalars.f_hi, scalars.f_lo)
    if key is None or not _VJP.hit(grid, args, key):  # the forward's key: the VJP's arguments follow from it
        _VJP.launch(grid, _VJP.bind(args, dmv, first and first.chan), consts, key)
    return ((dmv, None) if defer else (dmv[0], dmv[1])) + out.result(defer)
