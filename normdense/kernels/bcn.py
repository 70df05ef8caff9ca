"""Batch-Channel Normalization's coefficient map and its closed-form VJP as one Triton launch each (Qiao et al.,
"Micro-Batch Training with Batch-Channel Normalization and Weight Standardization", arXiv:1903.10520,
Sec. 7, Eq. 40-42): the Triton transcription of ``coeff_map`` / ``coeff_vjp`` in ``normdense/layers/bcn.py``.

For per-(n, c) moments m, v of x and first-stage statistics mean, var (C,):

    a = gamma^b / sqrt(var + eps),  u_m = a (m - mean) + beta^b,  u_v = a^2 v         (Eq. 40-41)
    d = u_m - mean_g(u_m),  r = (mean_g(u_v + d^2) + eps)^-1/2,  s = gamma^c r          (Eq. 42)
    A = s a,  B = s d + beta^c                                   (y = A (x - m) + B)

with gamma^c, beta^c per group (``group_affine``) or per channel.

Layout: [BLOCK_N, BLOCK_G, BLOCK_P] tiles of (sample, group, channel in group); the map on a grid of (group
block, sample block) programs, each running the deferred first stage (``first=``) for its own groups and
samples first (``first_stage.fold``); the VJP one program per (group block[, chunk], sample block), whose
per-channel sums over N dx finishes at large N (``common.BlockSums``). A group wider than ``chunk`` channels
is walked in chunks (passes for the group sums, then the outputs). The VJP recomputes d, r, s.
"""
import functools
from typing import Any, NamedTuple, Optional

import triton
import triton.language as tl
from torch import Tensor

from .backend import Row
from .common import CHUNK, BlockSums, cdiv, grad_buffer, group_tiles, rsqrt, sample_blocks, split_sum
from .first_stage import FOLD_SIZES, fold, fold_args, fold_consts
from .launch import launcher

_CHANNELS = 128  # channels (whole groups) of a tile when the groups are small
_TILE = 512  # elements of a [BLOCK_N, BLOCK_G, BLOCK_P] tile (no spills in float64)


@triton.jit
def _channels(pid_g, p0, G, PER, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr):
    """[1, BLOCK_G, BLOCK_P] channel tile: groups of program pid_g, channels p0 .. p0 + BLOCK_P of each."""
    grp = pid_g * BLOCK_G + tl.arange(0, BLOCK_G)[None, :, None]
    j = p0 + tl.arange(0, BLOCK_P)[None, None, :]
    gmask = grp < G
    return grp, gmask, grp * PER + j, gmask & (j < PER)


@triton.jit
def _first_stage(mean_ptr, var_ptr, bw_ptr, bb_ptr, ch, cmask, dt, EPS: tl.constexpr):
    """Per channel (Eq. 40): mean, rs = 1 / sqrt(var + eps) (EPS constexpr: exact in float64; a float argument
    would be float32), gamma^b, beta^b, in the compute dtype dt (parameters may come in another one)."""
    mean = tl.load(mean_ptr + ch, mask=cmask, other=0.0).to(dt)
    rs = rsqrt(tl.load(var_ptr + ch, mask=cmask, other=0.0).to(dt) + EPS)
    bw = tl.load(bw_ptr + ch, mask=cmask, other=0.0).to(dt)
    bb = tl.load(bb_ptr + ch, mask=cmask, other=0.0).to(dt)
    return mean, rs, bw, bb


@triton.jit
def _channel_affine(ptr, grp, gmask, ch, cmask, dt, GROUP_AFFINE: tl.constexpr):
    """The channel stage's gamma^c or beta^c on the tile: per group (Eq. 42) or per channel."""
    if GROUP_AFFINE:
        out = tl.load(ptr + grp, mask=gmask, other=0.0).to(dt)
    else:
        out = tl.load(ptr + ch, mask=cmask, other=0.0).to(dt)
    return out


@triton.jit
def _um(m_ptr, off, mask, mean, a, bb):
    """(m, m - mean, u_m) on a tile; u_m = 0 off the mask (out of the group sums)."""
    m = tl.load(m_ptr + off, mask=mask, other=0.0)
    mc = m - mean
    return mc, tl.where(mask, mc * a + bb, 0.0)


@triton.jit
def _group_stats(m_ptr, v_ptr, mean_ptr, var_ptr, bw_ptr, bb_ptr, pid_g, rows, rmask, C, G, PER, inv,
                 EPS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr):
    """mean_g(u_m) and r ([BLOCK_N, BLOCK_G, 1]) of a chunked group: two passes over its chunks (the
    centred second one, as the torch method: no cancellation)."""
    dt = m_ptr.dtype.element_ty
    su = tl.zeros([rows.shape[0], BLOCK_G], dtype=dt)
    for p0 in range(0, PER, BLOCK_P):
        grp, gmask, ch, cmask = _channels(pid_g, p0, G, PER, BLOCK_G, BLOCK_P)
        mean, rs, bw, bb = _first_stage(mean_ptr, var_ptr, bw_ptr, bb_ptr, ch, cmask, dt, EPS)
        mc, um = _um(m_ptr, rows * C + ch, rmask & cmask, mean, bw * rs, bb)
        su += tl.sum(um, axis=2)
    mu = (su * inv)[:, :, None]
    sq = tl.zeros([rows.shape[0], BLOCK_G], dtype=dt)
    for p0 in range(0, PER, BLOCK_P):
        grp, gmask, ch, cmask = _channels(pid_g, p0, G, PER, BLOCK_G, BLOCK_P)
        mean, rs, bw, bb = _first_stage(mean_ptr, var_ptr, bw_ptr, bb_ptr, ch, cmask, dt, EPS)
        mask = rmask & cmask
        a = bw * rs
        mc, um = _um(m_ptr, rows * C + ch, mask, mean, a, bb)
        d = tl.where(mask, um - mu, 0.0)
        v = tl.load(v_ptr + rows * C + ch, mask=mask, other=0.0)
        sq += tl.sum(v * (a * a) + d * d, axis=2)
    return mu, rsqrt(sq * inv + EPS)[:, :, None]


@triton.jit(do_not_specialize=['N', 'C', 'G', 'PER'] + FOLD_SIZES)
def _bcn_map_kernel(m_ptr, v_ptr, mean_ptr, var_ptr, bw_ptr, bb_ptr, w_ptr, b_ptr, a_ptr, bo_ptr,
                    N, C, G, PER, F, fL, fCHUNK, fSPLIT, fWRITE,
                    EPS: tl.constexpr, GROUP_AFFINE: tl.constexpr, CHUNKED: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, FOLD: tl.constexpr,
                    FMODE: tl.constexpr, FCUM: tl.constexpr, FBLOCK_N: tl.constexpr, FBLOCK_C: tl.constexpr):
    pid_g = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None, None]
    rmask = rows < N
    dt = m_ptr.dtype.element_ty
    if FOLD:  # the first stage of this program's groups and samples, in this launch (m, v, mean, var written)
        n_lo = tl.program_id(1) * BLOCK_N
        fold(F, N, C, fL, fCHUNK, fSPLIT, fWRITE, pid_g * BLOCK_G * PER,
             tl.minimum(pid_g * BLOCK_G + BLOCK_G, G) * PER, n_lo, tl.minimum(n_lo + BLOCK_N, N),
             tl.program_id(1) == 0, FMODE, FCUM, FBLOCK_N, FBLOCK_C, dt)
    inv = 1.0 / tl.cast(PER, dt)  # one division (a float64 one is a subroutine call: register saves)
    if CHUNKED:
        mu, r = _group_stats(m_ptr, v_ptr, mean_ptr, var_ptr, bw_ptr, bb_ptr, pid_g, rows, rmask, C, G, PER,
                             inv, EPS, BLOCK_G, BLOCK_P)
        for p0 in range(0, PER, BLOCK_P):
            grp, gmask, ch, cmask = _channels(pid_g, p0, G, PER, BLOCK_G, BLOCK_P)
            mean, rs, bw, bb = _first_stage(mean_ptr, var_ptr, bw_ptr, bb_ptr, ch, cmask, dt, EPS)
            w = _channel_affine(w_ptr, grp, gmask, ch, cmask, dt, GROUP_AFFINE)
            b = _channel_affine(b_ptr, grp, gmask, ch, cmask, dt, GROUP_AFFINE)
            mask = rmask & cmask
            a = bw * rs
            mc, um = _um(m_ptr, rows * C + ch, mask, mean, a, bb)
            s = r * w
            tl.store(a_ptr + rows * C + ch, s * a, mask=mask)
            tl.store(bo_ptr + rows * C + ch, s * (um - mu) + b, mask=mask)
    else:  # whole groups in the tile: one load of everything
        grp, gmask, ch, cmask = _channels(pid_g, 0, G, PER, BLOCK_G, BLOCK_P)
        mean, rs, bw, bb = _first_stage(mean_ptr, var_ptr, bw_ptr, bb_ptr, ch, cmask, dt, EPS)
        mask = rmask & cmask
        off = rows * C + ch
        a = bw * rs
        mc, um = _um(m_ptr, off, mask, mean, a, bb)
        d = tl.where(mask, um - (tl.sum(um, axis=2) * inv)[:, :, None], 0.0)
        v = tl.load(v_ptr + off, mask=mask, other=0.0)
        r = rsqrt(tl.sum(v * (a * a) + d * d, axis=2) * inv + EPS)[:, :, None]
        w = _channel_affine(w_ptr, grp, gmask, ch, cmask, dt, GROUP_AFFINE)  # after the division: no spills
        b = _channel_affine(b_ptr, grp, gmask, ch, cmask, dt, GROUP_AFFINE)
        s = r * w
        tl.store(a_ptr + off, s * a, mask=mask)
        tl.store(bo_ptr + off, s * d + b, mask=mask)


@triton.jit
def _vjp_out(dm_ptr, dv_ptr, off, mask, mc, d, ga, gb, v, a, r, s, dvg, mean_gd):
    """The per-(n, c) gradients of a tile from its group's r, s, dvg = d loss / d var_g / P and mean_g(gd);
    returns what the tile adds to the per-channel sums (d a, d beta^b, d m)."""
    gd = gb * s + 2.0 * d * dvg
    dum = tl.where(mask, gd - mean_gd, 0.0)  # d = u_m - mean_g(u_m)
    dm = dum * a
    tl.store(dm_ptr + off, dm, mask=mask)
    tl.store(dv_ptr + off, dvg * (a * a), mask=mask)
    # a enters A = s a, u_m = a mc + beta^b and u_v = a^2 v
    return ga * s + dum * mc + 2.0 * (dvg * v) * a, dum, dm


@triton.jit(do_not_specialize=['N', 'C', 'G', 'PER', 'GSPLIT', 'GSTRIDE', 'N_PER', 'PSTRIDE'])
def _bcn_vjp_kernel(m_ptr, v_ptr, mean_ptr, var_ptr, bw_ptr, bb_ptr, w_ptr, ga_ptr, gb_ptr,
                    dm_ptr, dv_ptr, dmean_ptr, dvar_ptr, dbw_ptr, dbb_ptr, dw_ptr, db_ptr,
                    N, C, G, PER, GSPLIT, GSTRIDE, N_PER, PSTRIDE, EPS: tl.constexpr, GROUP_AFFINE: tl.constexpr,
                    WANTS_STATS: tl.constexpr,
                    CHUNKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr):
    pid_g = tl.program_id(0)
    dt = m_ptr.dtype.element_ty
    inv = 1.0 / tl.cast(PER, dt)
    # this program's channels: whole groups, or (CHUNKED) chunk program_id(1) of one group
    grp, gmask, ch, cmask = _channels(pid_g, tl.program_id(1) * BLOCK_P, G, PER, BLOCK_G, BLOCK_P)
    mean, rs, bw, bb = _first_stage(mean_ptr, var_ptr, bw_ptr, bb_ptr, ch, cmask, dt, EPS)
    w = _channel_affine(w_ptr, grp, gmask, ch, cmask, dt, GROUP_AFFINE)
    a = bw * rs
    zero = tl.zeros([BLOCK_N, BLOCK_G, BLOCK_P], dtype=dt)
    acc_dw, acc_db, acc_da, acc_dbb, acc_dm = zero, zero, zero, zero, zero  # per-channel sums over N
    acc_gw = tl.zeros([BLOCK_N, BLOCK_G, 1], dtype=dt)  # CHUNKED, GROUP_AFFINE: per-group sums over N
    acc_gb = tl.zeros([BLOCK_N, BLOCK_G, 1], dtype=dt)
    # this program's samples: block program_id(2) of N_PER (its sums: row program_id(2) of the outputs, PSTRIDE
    # apart; common.BlockSums)
    for n0 in range(0, N_PER, BLOCK_N):  # N_PER: a multiple of BLOCK_N
        rows = tl.program_id(2) * N_PER + n0 + tl.arange(0, BLOCK_N)[:, None, None]
        rmask = rows < N
        mask = rmask & cmask
        off = rows * C + ch
        v = tl.load(v_ptr + off, mask=mask, other=0.0)
        if CHUNKED:  # the group sums over all chunks (recomputed by each chunk's program)
            mu, r = _group_stats(m_ptr, v_ptr, mean_ptr, var_ptr, bw_ptr, bb_ptr, pid_g, rows, rmask, C, G, PER,
                                 inv, EPS, BLOCK_G, BLOCK_P)
            sgs = tl.zeros([BLOCK_N, BLOCK_G], dtype=dt)  # sum_g gs (gamma^c)
            sgb = tl.zeros([BLOCK_N, BLOCK_G], dtype=dt)  # sum_g gb (gamma^c)
            sd = tl.zeros([BLOCK_N, BLOCK_G], dtype=dt)  # sum_g d (0 up to rounding)
            for p0 in range(0, PER, BLOCK_P):
                grp_j, gmask_j, ch_j, cmask_j = _channels(pid_g, p0, G, PER, BLOCK_G, BLOCK_P)
                mean_j, rs_j, bw_j, bb_j = _first_stage(mean_ptr, var_ptr, bw_ptr, bb_ptr, ch_j, cmask_j, dt, EPS)
                mask_j = rmask & cmask_j
                a_j = bw_j * rs_j
                mc_j, um_j = _um(m_ptr, rows * C + ch_j, mask_j, mean_j, a_j, bb_j)
                d_j = tl.where(mask_j, um_j - mu, 0.0)
                ga_j = split_sum(ga_ptr, rows * C + ch_j, mask_j, GSPLIT, GSTRIDE, dt)
                gb_j = split_sum(gb_ptr, rows * C + ch_j, mask_j, GSPLIT, GSTRIDE, dt)
                gs_j = ga_j * a_j + gb_j * d_j
                if not GROUP_AFFINE:
                    w_j = tl.load(w_ptr + ch_j, mask=cmask_j, other=0.0).to(dt)
                    gs_j = gs_j * w_j
                    gb_j = gb_j * w_j
                sgs += tl.sum(gs_j, axis=2)
                sgb += tl.sum(gb_j, axis=2)
                sd += tl.sum(d_j, axis=2)
            sgs, sgb = sgs[:, :, None], sgb[:, :, None]
            if GROUP_AFFINE:
                acc_gw += sgs * r
                acc_gb += sgb
                sgs, sgb = sgs * w, sgb * w
            # r = (var_g + eps)^-1/2 with var_g = mean over the group of (u_v + d^2)
            dvg = (sgs * r * r * r) * (-0.5 * inv)
            mean_gd = (r * sgb + 2.0 * dvg * sd[:, :, None]) * inv  # mean_g(gb s + 2 d dvg)
            ga = split_sum(ga_ptr, off, mask, GSPLIT, GSTRIDE, dt)
            gb = split_sum(gb_ptr, off, mask, GSPLIT, GSTRIDE, dt)
            mc, um = _um(m_ptr, off, mask, mean, a, bb)
            d = tl.where(mask, um - mu, 0.0)
            s = r * w
            gs = ga * a + gb * d
        else:  # whole groups in the tile
            mc, um = _um(m_ptr, off, mask, mean, a, bb)
            d = tl.where(mask, um - (tl.sum(um, axis=2) * inv)[:, :, None], 0.0)
            r = rsqrt(tl.sum(v * (a * a) + d * d, axis=2) * inv + EPS)[:, :, None]
            ga = split_sum(ga_ptr, off, mask, GSPLIT, GSTRIDE, dt)
            gb = split_sum(gb_ptr, off, mask, GSPLIT, GSTRIDE, dt)
            s = r * w
            gs = ga * a + gb * d  # d loss / d s; zero on padding lanes
            dvg = (tl.sum(gs * w, axis=2)[:, :, None] * r * r * r) * (-0.5 * inv)
            mean_gd = tl.sum(tl.where(mask, gb * s + 2.0 * d * dvg, 0.0), axis=2)[:, :, None] * inv
        da, dum, dm = _vjp_out(dm_ptr, dv_ptr, off, mask, mc, d, ga, gb, v, a, r, s, dvg, mean_gd)
        acc_dw += gs * r  # summed over the group below for a per-group gamma^c
        acc_db += gb
        acc_da += da
        acc_dbb += dum
        if WANTS_STATS:
            acc_dm += dm
    acc_da = tl.sum(acc_da, axis=0, keep_dims=True)
    out = tl.program_id(2) * PSTRIDE  # this sample block's row of partial sums (0: the final values)
    ch = ch + out
    grp = grp + out
    tl.store(dbw_ptr + ch, acc_da * rs, mask=cmask)
    tl.store(dbb_ptr + ch, tl.sum(acc_dbb, axis=0, keep_dims=True), mask=cmask)
    if WANTS_STATS:  # batch statistics: the engine chains dmean, dvar into the moments
        tl.store(dmean_ptr + ch, -tl.sum(acc_dm, axis=0, keep_dims=True), mask=cmask)
        tl.store(dvar_ptr + ch, acc_da * bw * (rs * rs * rs) * -0.5, mask=cmask)
    if GROUP_AFFINE:
        if CHUNKED:  # every chunk's program holds the group's sums: the first one stores them
            gmask = gmask & (tl.program_id(1) == 0)
            gw, gbs = tl.sum(acc_gw, axis=0, keep_dims=True), tl.sum(acc_gb, axis=0, keep_dims=True)
        else:
            gw = tl.sum(tl.sum(acc_dw, axis=2, keep_dims=True), axis=0, keep_dims=True)
            gbs = tl.sum(tl.sum(acc_db, axis=2, keep_dims=True), axis=0, keep_dims=True)
        tl.store(dw_ptr + grp, gw, mask=gmask)
        tl.store(db_ptr + grp, gbs, mask=gmask)
    else:
        tl.store(dw_ptr + ch, tl.sum(acc_dw, axis=0, keep_dims=True), mask=cmask)
        tl.store(db_ptr + ch, tl.sum(acc_db, axis=0, keep_dims=True), mask=cmask)


@functools.lru_cache(maxsize=1024)
def _blocks(n: int, c: int, num_groups: int, vjp: bool = False, chunk: int = CHUNK, tile: int = _TILE):
    """(per, CHUNKED, BLOCK_N, BLOCK_G, BLOCK_P, num_warps) from a fixed menu keyed on the sizes (powers of 2:
    a few compiled variants, none per batch size): ``common.group_tiles`` of ``tile`` elements, groups wider
    than ``chunk`` channels walked in chunks; ``vjp``: the VJP's."""
    if num_groups <= 0 or c % num_groups:
        raise ValueError(f'BCN kernels: num_groups={num_groups} must be positive and divide C={c}')
    per = c // num_groups
    chunked, block_n, block_g, block_p = group_tiles(n, num_groups, per, _CHANNELS, tile, chunk, vjp)
    if chunked or (vjp and block_p >= chunk):  # at least 2 samples per tile (no spills: docs/gpu.md)
        block_n = max(2, block_n)
    # a VJP tile shrunk for sample blocks runs at least 4 warps, as GN+PN's: at 2, ptxas 12.9 and 13.4 (triton 3.8,
    # 3.9) spilled 20-24 B of the float64 [64, 2, 1] GROUP_AFFINE VJP (docs/gpu.md)
    num_warps = max(4 if vjp and cdiv(n, block_n) > 1 else 1, min(8, block_n * block_g * block_p // 64))
    return per, chunked, block_n, block_g, block_p, num_warps


@functools.lru_cache(maxsize=1024)
def _launch_config(n: int, c: int, num_groups: int, eps: float, group_affine: bool, vjp: bool, wants_stats: bool,
                 chunk: int, tile: int):
    """(per, grid, sample blocks, samples per block, constexprs) of the map's (``vjp`` False) or the VJP's launch:
    once per configuration and shape."""
    per, chunked, block_n, block_g, block_p, warps = _blocks(n, c, num_groups, vjp, chunk, tile)
    consts = {'EPS': float(eps), 'GROUP_AFFINE': bool(group_affine), 'CHUNKED': chunked, 'BLOCK_N': block_n,
              'BLOCK_G': block_g, 'BLOCK_P': block_p, 'num_warps': warps}
    if not vjp:
        return per, (cdiv(num_groups, block_g), cdiv(n, block_n), 1), 1, 0, consts
    grid = (cdiv(num_groups, block_g), cdiv(per, block_p) if chunked else 1)
    blocks, n_per = sample_blocks(n, block_n, grid[0] * grid[1])
    return per, grid + (blocks, ), blocks, n_per, {**consts, 'WANTS_STATS': bool(wants_stats)}


class Residuals(NamedTuple):
    """What :func:`coeff_vjp` reads of :func:`coeff_map`'s call: its inputs (the VJP recomputes the rest)."""
    m: Tensor
    v: Tensor
    mean: Row  # (C,), or the address of a deferred first stage's row
    var: Row
    bw: Optional[Tensor]
    bb: Optional[Tensor]
    w: Optional[Tensor]
    b: Optional[Tensor]
    key: Optional[tuple]  # the call's launch-cache key (the VJP launches under it)
    first: Any  # the deferred first stage, or None


# rows (launch.Launcher): the deferred first stage's mean and var, A and B, gB in the sums' buffer, dm and dv
_MAP = launcher(_bcn_map_kernel, rows=('mean_ptr', 'var_ptr', 'a_ptr', 'bo_ptr'))
_VJP = launcher(_bcn_vjp_kernel, rows=('mean_ptr', 'var_ptr', 'gb_ptr', 'dm_ptr', 'dv_ptr'))


def coeff_map(m, v, mean, var, params, positions, count, *, num_groups: int, eps: float, group_affine: bool,
              first=None, chunk: int = CHUNK, tile: int = _TILE):
    """Triton ``normdense.layers.bcn.coeff_map`` (Eq. 40-42), one launch: ((A, B), res) with A, B (N, C) in m's
    dtype, the rows of one (2, N, C) tensor. ``positions`` and ``count`` do not enter BCN's map (as in the torch
    method); ``res`` is the inputs, which :func:`coeff_vjp` recomputes the intermediates from. ``first``: the
    engine's deferred first stage (``first_stage.FirstStage``, whose outputs m, v, mean, var are): run in this
    launch, its launch-cache
    key (``first.key``) extended by this launch's. ``chunk``, ``tile``: :func:`_blocks`'s."""
    bw, bb, w, b = params[0].contiguous(), params[1].contiguous(), params[2].contiguous(), params[3].contiguous()
    if first is None:  # the deferred stage's outputs are contiguous allocations
        m, v, mean, var = m.contiguous(), v.contiguous(), mean.contiguous(), var.contiguous()
    n, c = m.shape
    per, grid, _, _, consts = _launch_config(n, c, num_groups, eps, group_affine, False, False, chunk, tile)
    coeffs = m.new_empty(2, n, c)  # A, B: one tensor object (its rows by address on a kept launch)
    fargs, fconst = fold_args(None, m) if first is None else (first.fold, None)  # its constexprs on a miss
    key = None if first is None else first.key  # the call's (``launch.Launcher``)
    a = coeffs.data_ptr()
    args = (m, v, mean, var,  # mean, var: addresses in a deferred first stage's rows
            bw, bb, w, b,
            a, a + n * c * coeffs.itemsize,  # A, B
            n, c, num_groups, per, *fargs)
    if key is None or not _MAP.hit(grid, args, key):
        _MAP.launch(grid, _MAP.bind(args, coeffs, first and first.chan), {**(fconst or fold_consts(first)), **consts},
                    key)
    return coeffs, Residuals(m=m, v=v, mean=mean, var=var, bw=bw, bb=bb, w=w, b=b, key=key, first=first)


def coeff_vjp(res, grads, wants_stats, *, num_groups: int, eps: float, group_affine: bool, defer: bool = False,
              chunk: int = CHUNK, tile: int = _TILE):
    """Triton ``BatchChannelNorm2d.coeff_vjp``, one launch: (dm, dv, dmean, dvar, (d batch_weight, d batch_bias,
    d weight, d bias)) for the gradients (gA, gB) of (A, B): the sums kernel's (SPLIT, 2, N, C) chunk partials, or
    each (N, C) or (SPLIT, N, C) (``common.grad_buffer``)
    (added in the kernel); dm, dv, dmean, dvar in m's dtype (dmean, dvar None unless ``wants_stats``: batch
    statistics), the parameter gradients in the parameters' dtypes. Many samples run on sample blocks too
    (``common.BlockSums``): ``defer`` returns their partials, dmean, dvar (SB, C) and the ``BlockSums`` in place
    of the parameter gradients, for dx to sum; else they are summed here. ``defer`` (the engine's: dx follows)
    also returns dm, dv as one (2, N, C) buffer in dm's place, dv None (``triton.dx`` takes them so).
    ``chunk``, ``tile``: as coeff_map's."""
    m, v, mean, var, key, first = res.m, res.v, res.mean, res.var, res.key, res.first
    bw, bb, w, b = res.bw, res.bb, res.w, res.b
    # gA at the buffer's start, gB its own pointer argument (one derived in the kernel spills fp64 registers): its
    # address on a kept launch, a view on the normal one
    ga, gsplit, gstride, gk = grad_buffer(grads)
    n, c = m.shape
    per, grid, blocks, n_per, consts = _launch_config(n, c, num_groups, eps, group_affine, True, bool(wants_stats),
                                                    chunk, tile)
    dmv = m.new_empty(2, n, c)  # dm, dv: one tensor object
    out = BlockSums(blocks, m, (bw, bb, w, b), wants_stats)
    dbw, dbb, dw, db, dmean, dvar = out.slots
    d = dmv.data_ptr()
    args = (m, v, mean, var,  # as in coeff_map
            bw, bb, w,
            ga, ga.data_ptr() + gk * ga.itemsize,  # gA, gB
            d, d + n * c * dmv.itemsize,  # dm, dv
            dmean, dvar, dbw, dbb, dw, db, n, c, num_groups, per, gsplit, gstride, n_per, out.stride)
    if key is None or not _VJP.hit(grid, args, key):  # the forward's key: the VJP's arguments follow from it
        _VJP.launch(grid, _VJP.bind(args, ga, dmv, first and first.chan), consts, key)
    return ((dmv, None) if defer else (dmv[0], dmv[1])) + out.result(defer)
