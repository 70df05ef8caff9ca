"""GN+PN's channel-sized coefficient map and its closed-form VJP, one Triton launch each: the transcriptions of
``coeff_map`` / ``coeff_vjp`` of ``normdense/layers/proxy_norm.py``.

Paper: Labatie et al., "Proxy-Normalizing Activations to Match Batch Normalization while Removing Batch
Dependence", arXiv:2106.03743, Eq. 7 and App. B. Per (n, c), from the moments m, v of x:

    GN stage      A = gamma / sigma_g,   B = beta + A (m - mu_g),   sigma_g^2 = mean_g(v + (m - mu_g)^2) + eps
    proxy (Eq. 7) Y = beta~ + (1 + gamma~) q  (q the deterministic quantiles, App. B),  z = gamma Y + beta
                  K = 1 / sqrt(Var_q[phi(z)] + eps_pn),   L = -E_q[phi(z)] K   (K = 1, L = -E_q[phi(z)] without
                  proxy scaling)

Layout: [BLOCK_N, BLOCK_G, BLOCK_P] tiles of (sample, group, channel in the group) for the GN stage, as BCN's
(``bcn.py``; the VJP's sample blocks add their part of the proxy terms, which are linear in the sums over N);
the proxy moments in [BLOCK_G, BLOCK_P, BLOCK_S] tiles of the quantiles, recomputed by each program.

The float configuration (eps, proxy_eps, the activation's parameters) is ``tl.constexpr``: a runtime float
argument is float32 on the GPU and would round them in float64 computations.
"""
import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .activations import act_args, act_forward, act_grad
from .common import (CHUNK, BlockSums, cdiv, grad_buffer, group_tiles, next_pow2, rsqrt, sample_blocks,
                     split_sum)
from .first_stage import FOLD_SIZES, fold, fold_args, fold_consts
from .launch import launcher

__all__ = ['coeff_map', 'coeff_vjp']

_CHANNELS = 64  # channels per program (whole groups), when the groups are smaller
_TILE = 512  # elements of a [BLOCK_N, BLOCK_G, BLOCK_P] tile of the GN stage


def _proxy_tile(dtype, vjp: bool, chunked: bool) -> int:
    """Elements of a [groups, channels, samples] tile of the proxy (8 warps): 1024, less or more where that
    spilled (docs/gpu.md, "Kernel tuning notes")."""
    if vjp and chunked:
        return 512 if dtype == torch.float64 else 2048
    return 256 if dtype == torch.float64 and not vjp else 1024


def _blocks(n: int, groups: int, per: int, samples: int, vjp: bool = False, dtype=torch.float32, chunk: int = CHUNK,
            tile: int = _TILE):
    """(CHUNKED, BLOCK_N, BLOCK_G, BLOCK_P, BLOCK_S, num_warps): ``common.group_tiles`` of ``tile`` elements,
    groups wider than ``chunk`` channels walked in chunks; ``vjp``: the VJP's."""
    chunked, bn, bg, bp = group_tiles(n, groups, per, _CHANNELS, tile, chunk, vjp)
    if chunked:  # at least 2 samples per tile, as BCN's
        bn = max(2, bn)
    bs = max(1, min(next_pow2(samples), _proxy_tile(dtype, vjp, chunked) // (bg * bp)))
    shrunk = vjp and bn * bg * bp < tile and cdiv(n, bn) > 1  # a VJP tile shrunk for sample blocks
    return chunked, bn, bg, bp, bs, 4 if shrunk else 8


@triton.jit
def _channels(pid_g, p0, G, per, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr):
    """[BLOCK_G, BLOCK_P] channel tile: groups of program pid_g, channels p0 .. p0 + BLOCK_P of each."""
    g = pid_g * BLOCK_G + tl.arange(0, BLOCK_G)[:, None]
    p = p0 + tl.arange(0, BLOCK_P)[None, :]
    return g * per + p, (g < G) & (p < per)


@triton.jit
def _gn_stage(m_ptr, v_ptr, off, mask, inv, EPS: tl.constexpr):
    """d = m - mu_g (0 off the tile) and r = 1 / sigma_g ([BLOCK_N, BLOCK_G, 1]) of a tile of whole groups."""
    mn = tl.load(m_ptr + off, mask=mask, other=0.0)
    vn = tl.load(v_ptr + off, mask=mask, other=0.0)
    d = tl.where(mask, mn - (tl.sum(mn, axis=2) * inv)[:, :, None], 0.0)
    r = rsqrt(tl.sum(vn + d * d, axis=2) * inv + EPS)
    return d, r[:, :, None]


@triton.jit
def _gn_chunked(m_ptr, v_ptr, pid_g, rows, rmask, C, G, per, inv, EPS: tl.constexpr, BLOCK_G: tl.constexpr,
                BLOCK_P: tl.constexpr):
    """mu_g and r = 1 / sigma_g ([BLOCK_N, BLOCK_G, 1]) of a group walked in chunks: two passes (the centred
    second one, as the torch method: no cancellation)."""
    dt = m_ptr.dtype.element_ty
    sm = tl.zeros([rows.shape[0], BLOCK_G], dtype=dt)
    for p0 in range(0, per, BLOCK_P):
        ch, cmask = _channels(pid_g, p0, G, per, BLOCK_G, BLOCK_P)
        sm += tl.sum(tl.load(m_ptr + rows * C + ch[None], mask=rmask & cmask[None], other=0.0), axis=2)
    mu = (sm * inv)[:, :, None]
    sq = tl.zeros([rows.shape[0], BLOCK_G], dtype=dt)
    for p0 in range(0, per, BLOCK_P):
        ch, cmask = _channels(pid_g, p0, G, per, BLOCK_G, BLOCK_P)
        mask = rmask & cmask[None]
        d = tl.where(mask, tl.load(m_ptr + rows * C + ch[None], mask=mask, other=0.0) - mu, 0.0)
        sq += tl.sum(tl.load(v_ptr + rows * C + ch[None], mask=mask, other=0.0) + d * d, axis=2)
    return mu, rsqrt(sq * inv + EPS)[:, :, None]


@triton.jit
def _proxy_block(w, b, pb, pg, q_ptr, s0, S, AFFINE: tl.constexpr, BLOCK_S: tl.constexpr):
    """z = gamma Y + beta, Y and q over the samples s0 .. s0 + BLOCK_S ([BLOCK_G, BLOCK_P, BLOCK_S])."""
    s = s0 + tl.arange(0, BLOCK_S)
    live = (s < S)[None, None, :]
    q = tl.load(q_ptr + s, mask=s < S, other=0.0).to(w.dtype)[None, None, :]
    if AFFINE:
        y = pb[:, :, None] + (1.0 + pg)[:, :, None] * q
    else:
        y = q + tl.zeros_like(w)[:, :, None]
    z = b[:, :, None] + w[:, :, None] * y
    return z, y, q, live


@triton.jit
def _proxy_moments(w, b, pb, pg, q_ptr, S, ACT: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr,
                   AFFINE: tl.constexpr, SCALING: tl.constexpr, BLOCK_S: tl.constexpr):
    """E_q[phi(z)] and Var_q[phi(z)] (1/n, two passes: no cancellation) per channel ([BLOCK_G, BLOCK_P])."""
    total = tl.zeros_like(w)
    for s0 in range(0, S, BLOCK_S):
        z, y, q, live = _proxy_block(w, b, pb, pg, q_ptr, s0, S, AFFINE, BLOCK_S)
        total += tl.sum(tl.where(live, act_forward(z, ACT, P0, P1), 0.0), axis=2)
    pmean = total / S
    sq = tl.zeros_like(w)
    if SCALING:
        for s0 in range(0, S, BLOCK_S):
            z, y, q, live = _proxy_block(w, b, pb, pg, q_ptr, s0, S, AFFINE, BLOCK_S)
            dev = act_forward(z, ACT, P0, P1) - pmean[:, :, None]
            sq += tl.sum(tl.where(live, dev * dev, 0.0), axis=2)
    return pmean, sq / S


@triton.jit
def _params(w_ptr, b_ptr, pb_ptr, pg_ptr, ch, mask, dt, AFFINE: tl.constexpr):
    """The parameters on a [BLOCK_G, BLOCK_P] channel tile, in the compute dtype."""
    w = tl.load(w_ptr + ch, mask=mask, other=0.0).to(dt)
    b = tl.load(b_ptr + ch, mask=mask, other=0.0).to(dt)
    if AFFINE:
        pb = tl.load(pb_ptr + ch, mask=mask, other=0.0).to(dt)
        pg = tl.load(pg_ptr + ch, mask=mask, other=0.0).to(dt)
    else:
        pb = tl.zeros_like(w)
        pg = tl.zeros_like(w)
    return w, b, pb, pg


@triton.jit
def _proxy_kl(w, b, pb, pg, q_ptr, S, PROXY_EPS: tl.constexpr, ACT: tl.constexpr, P0: tl.constexpr,
              P1: tl.constexpr, AFFINE: tl.constexpr, SCALING: tl.constexpr, BLOCK_S: tl.constexpr):
    """K and L per channel ([BLOCK_G, BLOCK_P])."""
    pmean, pvar = _proxy_moments(w, b, pb, pg, q_ptr, S, ACT, P0, P1, AFFINE, SCALING, BLOCK_S)
    if SCALING:
        k = rsqrt(pvar + PROXY_EPS)
        l_ = -pmean * k
    else:
        k = tl.zeros_like(w) + 1.0
        l_ = -pmean
    return k, l_


@triton.jit
def _map_store(a_ptr, bb_ptr, k_ptr, l_ptr, off, mask, d, r, w, b, k, l_):
    a = r * w[None]
    tl.store(a_ptr + off, a, mask=mask)
    tl.store(bb_ptr + off, b[None] + a * d, mask=mask)
    tl.store(k_ptr + off, k[None] + tl.zeros_like(d), mask=mask)
    tl.store(l_ptr + off, l_[None] + tl.zeros_like(d), mask=mask)


@triton.jit(do_not_specialize=['N', 'C', 'G', 'per', 'S'] + FOLD_SIZES)
def _coeff_map_kernel(m_ptr, v_ptr, w_ptr, b_ptr, pb_ptr, pg_ptr, q_ptr, a_ptr, bb_ptr, k_ptr, l_ptr,
                      N, C, G, per, S, F, fL, fCHUNK, fSPLIT, fWRITE, EPS: tl.constexpr,
                      PROXY_EPS: tl.constexpr, ACT: tl.constexpr,
                      P0: tl.constexpr, P1: tl.constexpr, AFFINE: tl.constexpr, SCALING: tl.constexpr,
                      CHUNKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr,
                      BLOCK_S: tl.constexpr, FOLD: tl.constexpr, FMODE: tl.constexpr, FCUM: tl.constexpr,
                      FBLOCK_N: tl.constexpr,
                      FBLOCK_C: tl.constexpr):
    dt = m_ptr.dtype.element_ty
    pid_g = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None, None]
    rmask = rows < N
    if FOLD:  # m, v of this program's groups and samples from the moments' partials, in this launch
        n_lo = tl.program_id(1) * BLOCK_N
        fold(F, N, C, fL, fCHUNK, fSPLIT, fWRITE, pid_g * BLOCK_G * per,
             tl.minimum(pid_g * BLOCK_G + BLOCK_G, G) * per, n_lo, tl.minimum(n_lo + BLOCK_N, N),
             tl.program_id(1) == 0, FMODE, FCUM, FBLOCK_N, FBLOCK_C, dt)
    inv = 1.0 / tl.cast(per, dt)  # one division (a float64 one is a subroutine call)
    if CHUNKED:
        mu, r = _gn_chunked(m_ptr, v_ptr, pid_g, rows, rmask, C, G, per, inv, EPS, BLOCK_G, BLOCK_P)
        for p0 in range(0, per, BLOCK_P):
            ch, cmask = _channels(pid_g, p0, G, per, BLOCK_G, BLOCK_P)
            mask = rmask & cmask[None]
            off = rows * C + ch[None]
            d = tl.where(mask, tl.load(m_ptr + off, mask=mask, other=0.0) - mu, 0.0)
            w, b, pb, pg = _params(w_ptr, b_ptr, pb_ptr, pg_ptr, ch, cmask, dt, AFFINE)
            k, l_ = _proxy_kl(w, b, pb, pg, q_ptr, S, PROXY_EPS, ACT, P0, P1, AFFINE, SCALING, BLOCK_S)
            _map_store(a_ptr, bb_ptr, k_ptr, l_ptr, off, mask, d, r, w, b, k, l_)
    else:
        ch, cmask = _channels(pid_g, 0, G, per, BLOCK_G, BLOCK_P)
        # the proxy first: no (sample, channel) tile live across its float64 division (no spills)
        w, b, pb, pg = _params(w_ptr, b_ptr, pb_ptr, pg_ptr, ch, cmask, dt, AFFINE)
        k, l_ = _proxy_kl(w, b, pb, pg, q_ptr, S, PROXY_EPS, ACT, P0, P1, AFFINE, SCALING, BLOCK_S)
        mask = rmask & cmask[None]
        off = rows * C + ch[None]
        d, r = _gn_stage(m_ptr, v_ptr, off, mask, inv, EPS)
        _map_store(a_ptr, bb_ptr, k_ptr, l_ptr, off, mask, d, r, w, b, k, l_)


@triton.jit(do_not_specialize=['N', 'C', 'G', 'per', 'S', 'GSPLIT', 'GSTRIDE', 'GK', 'N_PER', 'PSTRIDE'])
def _coeff_vjp_kernel(m_ptr, v_ptr, w_ptr, b_ptr, pb_ptr, pg_ptr, q_ptr,
                      ga_ptr, dm_ptr, dv_ptr, dw_ptr, db_ptr, dpb_ptr, dpg_ptr,
                      N, C, G, per, S, GSPLIT, GSTRIDE, GK, N_PER, PSTRIDE, EPS: tl.constexpr, PROXY_EPS: tl.constexpr,
                      ACT: tl.constexpr,
                      P0: tl.constexpr, P1: tl.constexpr, AFFINE: tl.constexpr, SCALING: tl.constexpr,
                      CHUNKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr,
                      BLOCK_S: tl.constexpr):
    dt = m_ptr.dtype.element_ty
    inv = 1.0 / tl.cast(per, dt)
    # gradient k of the sums' buffer at offset k GK (common.grad_buffer): offsets, not pointers derived from
    # ga_ptr (one held across the loops spilled fp64 registers in BCN's VJP kernel)
    pid_g = tl.program_id(0)
    # this program's channels: whole groups, or (CHUNKED) chunk program_id(1) of one group
    ch, cmask = _channels(pid_g, tl.program_id(1) * BLOCK_P, G, per, BLOCK_G, BLOCK_P)
    w, b, pb, pg = _params(w_ptr, b_ptr, pb_ptr, pg_ptr, ch, cmask, dt, AFFINE)
    zero = tl.zeros([BLOCK_N, BLOCK_G, BLOCK_P], dtype=dt)
    dw3, db3, gk3, gl3 = zero, zero, zero, zero  # per-channel sums over N
    # GN stage, per sample: A = r gamma and B = beta + A d, with d and r functions of the group's m, v; this
    # program's samples: block program_id(2) of N_PER
    for n0 in range(0, N_PER, BLOCK_N):  # N_PER: a multiple of BLOCK_N
        rows = tl.program_id(2) * N_PER + n0 + tl.arange(0, BLOCK_N)[:, None, None]
        rmask = rows < N
        mask = rmask & cmask[None]
        off = rows * C + ch[None]
        if CHUNKED:  # the group sums over all chunks (recomputed by each chunk's program)
            mu, r = _gn_chunked(m_ptr, v_ptr, pid_g, rows, rmask, C, G, per, inv, EPS, BLOCK_G, BLOCK_P)
            sgw = tl.zeros([BLOCK_N, BLOCK_G], dtype=dt)  # sum_g ga_t gamma
            sgb = tl.zeros([BLOCK_N, BLOCK_G], dtype=dt)  # sum_g gb gamma
            sd = tl.zeros([BLOCK_N, BLOCK_G], dtype=dt)  # sum_g d (0 up to rounding)
            for p0 in range(0, per, BLOCK_P):
                ch_j, cmask_j = _channels(pid_g, p0, G, per, BLOCK_G, BLOCK_P)
                mask_j = rmask & cmask_j[None]
                ch3 = ch_j[None]
                d_j = tl.where(mask_j, tl.load(m_ptr + rows * C + ch3, mask=mask_j, other=0.0) - mu, 0.0)
                ga_j = split_sum(ga_ptr, rows * C + ch3, mask_j, GSPLIT, GSTRIDE, dt)
                gb_j = split_sum(ga_ptr, rows * C + ch3 + GK, mask_j, GSPLIT, GSTRIDE, dt)
                w_j = tl.load(w_ptr + ch3, mask=cmask_j[None], other=0.0).to(dt)
                sgw += tl.sum((ga_j + gb_j * d_j) * w_j, axis=2)
                sgb += tl.sum(gb_j * w_j, axis=2)
                sd += tl.sum(d_j, axis=2)
            # through r = (mean_g(v + d^2) + eps)^(-1/2): d r / d v_c = -r^3 / (2 P)
            dvg = sgw[:, :, None] * (r * r * r * -0.5) * inv
            mean_gd = (r * sgb[:, :, None] + 2.0 * dvg * sd[:, :, None]) * inv  # mean_g(gb r gamma + 2 d dvg)
            d = tl.where(mask, tl.load(m_ptr + off, mask=mask, other=0.0) - mu, 0.0)
            ga = split_sum(ga_ptr, off, mask, GSPLIT, GSTRIDE, dt)
            gb = split_sum(ga_ptr, off + GK, mask, GSPLIT, GSTRIDE, dt)
            ga_t = ga + gb * d  # total gradient of A (B = beta + A d)
        else:
            d, r = _gn_stage(m_ptr, v_ptr, off, mask, inv, EPS)
            ga = split_sum(ga_ptr, off, mask, GSPLIT, GSTRIDE, dt)
            gb = split_sum(ga_ptr, off + GK, mask, GSPLIT, GSTRIDE, dt)
            ga_t = ga + gb * d
            dvg = tl.sum(ga_t * w[None], axis=2)[:, :, None] * (r * r * r * -0.5) * inv
            mean_gd = tl.sum(tl.where(mask, gb * (r * w[None]) + d * 2.0 * dvg, 0.0), axis=2)[:, :, None] * inv
        gk3 += split_sum(ga_ptr, off + 2 * GK, mask, GSPLIT, GSTRIDE, dt)
        gl3 += split_sum(ga_ptr, off + 3 * GK, mask, GSPLIT, GSTRIDE, dt)
        dw3 += ga_t * r
        db3 += gb
        gd = gb * (r * w[None]) + d * 2.0 * dvg
        tl.store(dm_ptr + off, gd - mean_gd, mask=mask)  # d = m - mu_g
        tl.store(dv_ptr + off, dvg + tl.zeros_like(d), mask=mask)
    dw = tl.sum(dw3, axis=0)
    db = tl.sum(db3, axis=0)
    gk_sum = tl.sum(gk3, axis=0)
    gl_sum = tl.sum(gl3, axis=0)
    # proxy moments: K = (var + eps_pn)^(-1/2), L = -mean K (or L = -mean), summed over N above
    pmean, pvar = _proxy_moments(w, b, pb, pg, q_ptr, S, ACT, P0, P1, AFFINE, SCALING, BLOCK_S)
    if SCALING:
        k = rsqrt(pvar + PROXY_EPS)
        dmean = -gl_sum * k
        dvar = (gk_sum - gl_sum * pmean) * (k * k * k * -0.5)
    else:
        dmean = -gl_sum
        dvar = tl.zeros_like(w)
    dy_sum = tl.zeros_like(w)
    dy_q = tl.zeros_like(w)
    for s0 in range(0, S, BLOCK_S):
        z, y, q, live = _proxy_block(w, b, pb, pg, q_ptr, s0, S, AFFINE, BLOCK_S)
        dout = dmean[:, :, None] / S
        if SCALING:  # d var / d phi_s = 2 (phi_s - mean) / n
            dout = dout + (act_forward(z, ACT, P0, P1) - pmean[:, :, None]) * (dvar * 2.0)[:, :, None] / S
        dz = tl.where(live, act_grad(z, ACT, P0, P1) * dout, 0.0)
        dw += tl.sum(dz * y, axis=2)
        db += tl.sum(dz, axis=2)
        if AFFINE:
            dy_sum += tl.sum(dz, axis=2)
            dy_q += tl.sum(dz * q, axis=2)
    # the proxy terms are linear in the sums over N: a sample block adds its part (its row, PSTRIDE apart)
    out = ch + tl.program_id(2) * PSTRIDE
    tl.store(dw_ptr + out, dw, mask=cmask)
    tl.store(db_ptr + out, db, mask=cmask)
    if AFFINE:  # Y = beta~ + (1 + gamma~) q, z = gamma Y + beta
        tl.store(dpb_ptr + out, w * dy_sum, mask=cmask)
        tl.store(dpg_ptr + out, w * dy_q, mask=cmask)


@functools.lru_cache(maxsize=1024)
def _launch_config(n, c, num_groups, num_samples, act_id, p0, p1, dtype, chunk, tile, eps, proxy_eps, proxy_scaling,
          proxy_affine):
    """(per, (grid, constexprs) of the map, (grid with sample blocks, samples per block, constexprs) of the VJP):
    once per configuration and shape."""
    if c % num_groups:
        raise ValueError(f'GN+PN kernels: num_groups={num_groups} does not divide C={c}')
    per = c // num_groups
    fixed = {'EPS': float(eps), 'PROXY_EPS': float(proxy_eps), 'AFFINE': bool(proxy_affine),
             'SCALING': bool(proxy_scaling), 'ACT': act_id, 'P0': p0, 'P1': p1}
    out = [per]
    for vjp in (False, True):  # the map's, then the VJP's (spread over more programs for many samples)
        chunked, bn, bg, bp, bs, warps = _blocks(n, num_groups, per, num_samples, vjp, dtype, chunk, tile)
        groups = cdiv(num_groups, bg)
        consts = {**fixed, 'CHUNKED': chunked, 'BLOCK_N': bn, 'BLOCK_G': bg, 'BLOCK_P': bp, 'BLOCK_S': bs,
                  'num_warps': warps}
        if vjp:
            grid = (groups, cdiv(per, bp) if chunked else 1)
            sb, n_per = sample_blocks(n, bn, grid[0] * grid[1])
            out.append((grid + (sb, ), sb, n_per, consts))
        else:
            out.append(((groups, cdiv(n, bn), 1), consts))
    return out


def _config(m, num_groups, quantiles, act, act_kwargs, chunk, tile, eps, proxy_eps, proxy_scaling, proxy_affine):
    n, c = m.shape
    act_id, p0, p1 = _act_ids(act, act_kwargs)
    return _launch_config(n, c, num_groups, quantiles.numel(), act_id, p0, p1, m.dtype, chunk, tile, eps, proxy_eps,
                 proxy_scaling, proxy_affine)


_ACT_IDS = {}  # (name, kwargs items) -> act_args: read per call


def _act_ids(act, act_kwargs):
    key = (act, *act_kwargs.items())
    ids = _ACT_IDS.get(key)
    if ids is None:
        ids = _ACT_IDS[key] = act_args(act, act_kwargs)
    return ids


class Residuals(NamedTuple):
    """What :func:`coeff_vjp` reads of :func:`coeff_map`'s call."""
    m: Tensor
    v: Tensor
    params: tuple  # (weight, bias, proxy_beta, proxy_gamma)
    quantiles: Tensor
    key: Optional[tuple]  # the call's launch-cache key


# rows (launch.Launcher): A, B, K, L'; dm and dv
_MAP = launcher(_coeff_map_kernel, rows=('a_ptr', 'bb_ptr', 'k_ptr', 'l_ptr'))
_VJP = launcher(_coeff_vjp_kernel, rows=('dm_ptr', 'dv_ptr'))


def coeff_map(m, v, mean, var, params, positions, count, *, num_groups, eps, act, act_kwargs, proxy_eps,
              proxy_scaling, proxy_affine, quantiles, first=None, chunk=CHUNK, tile=_TILE):
    """``normdense.layers.proxy_norm.coeff_map`` in one launch: ((A, B, K, L), residuals), each coefficient (N, C)
    in m's dtype, the rows of one (4, N, C) tensor. ``quantiles`` are the proxy samples q (num_samples,) (the
    layer's cached quantiles); ``mean``, ``var``, ``positions`` and ``count`` are unused (GN+PN has no first
    stage). ``first``: the engine's deferred moments merge (``first_stage.FirstStage``, whose outputs m, v are):
    run in this launch, its launch-cache key extended by this launch's. ``chunk``, ``tile``: :func:`_blocks`'s."""
    weight, bias, proxy_beta, proxy_gamma = params
    if first is None:  # the deferred stage's outputs are contiguous allocations
        m, v = m.contiguous(), v.contiguous()
    per, (grid, consts), _ = _config(m, num_groups, quantiles, act, act_kwargs, chunk, tile, eps, proxy_eps,
                                     proxy_scaling, proxy_affine)
    n, c = m.shape
    coeffs = m.new_empty(4, n, c)  # A, B, K, L: one tensor object (its rows by address on a kept launch)
    pb, pg = (proxy_beta, proxy_gamma) if proxy_affine else (weight, weight)  # not read without proxy_affine
    fargs, fconst = fold_args(None, m) if first is None else (first.fold, None)  # its constexprs on a miss
    key = None if first is None else first.key  # the call's (``launch.Launcher``)
    a, step = coeffs.data_ptr(), n * c * coeffs.itemsize
    args = (m, v, weight, bias, pb, pg, quantiles,
            a, a + step, a + 2 * step, a + 3 * step,  # A, B, K, L'
            n, c, num_groups, per, quantiles.numel(), *fargs)
    if key is None or not _MAP.hit(grid, args, key):
        _MAP.launch(grid, _MAP.bind(args, coeffs), {**(fconst or fold_consts(first)), **consts}, key)
    return coeffs, Residuals(m=m, v=v, params=params, quantiles=quantiles, key=key)


def coeff_vjp(res, grads, wants_stats, *, num_groups, eps, act, act_kwargs, proxy_eps, proxy_scaling,
              proxy_affine, defer=False, chunk=CHUNK, tile=_TILE):
    """``GroupProxyNorm.coeff_vjp`` in one launch: (dm, dv, None, None, (d weight, d bias, d proxy_beta,
    d proxy_gamma)) (the proxy ones None without proxy_affine) for ``grads`` = (gA, gB, gK, gL): the sums
    kernel's (SPLIT, 4, N, C) chunk partials (added in the kernel), or each (N, C) or (SPLIT, N, C)
    (``common.grad_buffer``); dm, dv in m's dtype, the
    parameter gradients in the parameters' dtypes. Many samples run on sample blocks too: ``defer`` returns a
    ``common.BlockSums`` of their partials in place of the parameter gradients, for dx to sum; ``defer`` (the
    engine's: dx follows) also returns dm, dv as one (2, N, C) buffer in dm's place, dv None (``triton.dx``). ``chunk``,
    ``tile``: as coeff_map's."""
    m, v, params, quantiles, key = res.m, res.v, res.params, res.quantiles, res.key
    weight, bias, proxy_beta, proxy_gamma = params
    g, gsplit, gstride, gk = grad_buffer(grads)
    per, _, (grid, sb, n_per, consts) = _config(m, num_groups, quantiles, act, act_kwargs, chunk, tile, eps,
                                                proxy_eps, proxy_scaling, proxy_affine)
    n, c = m.shape
    dmv = m.new_empty(2, n, c)  # dm, dv: one tensor object
    out = BlockSums(sb, m, (weight, bias) + ((proxy_beta, proxy_gamma) if proxy_affine else (None, None)), False)
    dw, db, dpb, dpg, _, _ = out.slots  # no statistics: their two slots go unused
    pb, pg = (proxy_beta, proxy_gamma) if proxy_affine else (weight, weight)
    d = dmv.data_ptr()
    args = (m, v, weight, bias, pb, pg, quantiles, g,
            d, d + n * c * dmv.itemsize,  # dm, dv
            dw, db, dpb, dpg, n, c, num_groups, per, quantiles.numel(), gsplit, gstride, gk, n_per, out.stride)
    if key is None or not _VJP.hit(grid, args, key):  # the forward's key: the VJP's arguments follow from it
        _VJP.launch(grid, _VJP.bind(args, dmv), consts, key)
    return ((dmv, None) if defer else (dmv[0], dmv[1])) + out.result(defer)
