"""Batch-Channel Normalization's coefficient map and its closed-form VJP as one Triton launch each (Qiao et al.,
"Micro-Batch Training with Batch-Channel Normalization and Weight Standardization", arXiv:1903.10520,
Sec. 7, Eq. 40-42): the Triton transcription of ``coeff_map`` / ``coeff_vjp`` in ``normdense/layers/bcn.py``.

For per-(n, c) moments m, v of x and first-stage statistics mean, var (C,):

    a = gamma^b / sqrt(var + eps),  u_m = a (m - mean) + beta^b,  u_v = a^2 v         (Eq. 40-41)
    d = u_m - mean_g(u_m),  r = (mean_g(u_v + d^2) + eps)^-1/2,  s = gamma^c r          (Eq. 42)
    A = s a,  B = s d + beta^c                                   (y = A (x - m) + B)

with gamma^c, beta^c per group (``group_affine``) or per channel. Layout: a 1-D grid over blocks of whole
groups, a [BLOCK_G, BLOCK_P] tile of (group, channel in group); each program loops over the N samples, so
the per-(n, g) statistics are reductions along the tile's second axis, and the per-channel / per-group
gradients (sums over N) are accumulated in registers by the one program that owns them: deterministic, no
atomics. The VJP recomputes d, r, s from its inputs instead of storing them.
"""
import torch
import triton
import triton.language as tl

_TILE = 128  # elements of a program's (group, channel) tile: several programs at C = 256 and up
_MAX_PER_GROUP = 4096  # a whole group is one tile row (bounded registers on a GPU)


@triton.jit
def _channel_affine(ptr, grp, gmask, ch, mask, dt, GROUP_AFFINE: tl.constexpr):
    """The channel stage's gamma^c or beta^c on the tile: per group (Eq. 42) or per channel."""
    if GROUP_AFFINE:
        out = tl.load(ptr + grp, mask=gmask, other=0.0).to(dt)
    else:
        out = tl.load(ptr + ch, mask=mask, other=0.0).to(dt)
    return out


@triton.jit
def _first_stage(mean_ptr, var_ptr, bw_ptr, bb_ptr, w_ptr, G, PER, EPS: tl.constexpr, GROUP_AFFINE: tl.constexpr,
                 BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr):
    """The program's tile of whole groups (grp, gmask, mask, ch) and what Eq. 40 needs per channel: mean,
    1 / sqrt(var + eps) (EPS constexpr: exact in float64; a float argument would be float32), gamma^b, beta^b;
    and gamma^c. Everything in the compute dtype (mean's: m's); parameters may come in another one."""
    grp = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)[:, None]
    j = tl.arange(0, BLOCK_P)[None, :]
    gmask = grp < G
    mask = gmask & (j < PER)
    ch = grp * PER + j
    mean = tl.load(mean_ptr + ch, mask=mask, other=0.0)
    dt = mean.dtype
    rs = tl.rsqrt(tl.load(var_ptr + ch, mask=mask, other=0.0).to(dt) + EPS)
    bw = tl.load(bw_ptr + ch, mask=mask, other=0.0).to(dt)
    bb = tl.load(bb_ptr + ch, mask=mask, other=0.0).to(dt)
    return grp, gmask, mask, ch, mean, rs, bw, bb, _channel_affine(w_ptr, grp, gmask, ch, mask, dt, GROUP_AFFINE)


@triton.jit(do_not_specialize=['N', 'C', 'G', 'PER'])
def _bcn_map_kernel(m_ptr, v_ptr, mean_ptr, var_ptr, bw_ptr, bb_ptr, w_ptr, b_ptr, a_ptr, bo_ptr,
                    N, C, G, PER, EPS: tl.constexpr, GROUP_AFFINE: tl.constexpr,
                    BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr):
    grp, gmask, mask, ch, mean, rs, bw, bb, w = _first_stage(mean_ptr, var_ptr, bw_ptr, bb_ptr, w_ptr, G, PER, EPS,
                                                             GROUP_AFFINE, BLOCK_G, BLOCK_P)
    b = _channel_affine(b_ptr, grp, gmask, ch, mask, mean.dtype, GROUP_AFFINE)
    a = bw * rs
    a2 = a * a
    for n in range(0, N):
        off = n * C + ch
        m = tl.load(m_ptr + off, mask=mask, other=0.0)
        v = tl.load(v_ptr + off, mask=mask, other=0.0)
        um = (m - mean) * a + bb
        d = tl.where(mask, um - (tl.sum(um, axis=1) / PER)[:, None], 0.0)  # padding lanes out of the sums
        r = tl.rsqrt(tl.sum(v * a2 + d * d, axis=1) / PER + EPS)[:, None]
        s = r * w
        tl.store(a_ptr + off, s * a, mask=mask)
        tl.store(bo_ptr + off, s * d + b, mask=mask)


@triton.jit(do_not_specialize=['N', 'C', 'G', 'PER'])
def _bcn_vjp_kernel(m_ptr, v_ptr, mean_ptr, var_ptr, bw_ptr, bb_ptr, w_ptr, ga_ptr, gb_ptr,
                    dm_ptr, dv_ptr, dmean_ptr, dvar_ptr, dbw_ptr, dbb_ptr, dw_ptr, db_ptr,
                    N, C, G, PER, EPS: tl.constexpr, GROUP_AFFINE: tl.constexpr, WANTS_STATS: tl.constexpr,
                    BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr):
    grp, gmask, mask, ch, mean, rs, bw, bb, w = _first_stage(mean_ptr, var_ptr, bw_ptr, bb_ptr, w_ptr, G, PER, EPS,
                                                             GROUP_AFFINE, BLOCK_G, BLOCK_P)
    dt = mean.dtype
    a = bw * rs
    a2 = a * a
    zero = tl.zeros([BLOCK_G, BLOCK_P], dtype=dt)
    acc_dw, acc_db, acc_da, acc_dbb, acc_dm = zero, zero, zero, zero, zero  # per-channel sums over N
    for n in range(0, N):
        off = n * C + ch
        m = tl.load(m_ptr + off, mask=mask, other=0.0)
        v = tl.load(v_ptr + off, mask=mask, other=0.0)
        ga = tl.load(ga_ptr + off, mask=mask, other=0.0).to(dt)
        gb = tl.load(gb_ptr + off, mask=mask, other=0.0).to(dt)
        # the forward's per-(n, g) quantities, recomputed
        mc = m - mean
        um = mc * a + bb
        d = tl.where(mask, um - (tl.sum(um, axis=1) / PER)[:, None], 0.0)
        r = tl.rsqrt(tl.sum(v * a2 + d * d, axis=1) / PER + EPS)[:, None]
        s = r * w
        gs = ga * a + gb * d  # d loss / d s; zero on padding lanes
        acc_dw += gs * r  # summed over the group below for a per-group gamma^c
        acc_db += gb
        # r = (var_g + eps)^-1/2 with var_g = mean over the group of (u_v + d^2)
        dvg = (tl.sum(gs * w, axis=1)[:, None] * r * r * r) * -0.5 / PER
        gd = gb * s + 2.0 * d * dvg
        dum = tl.where(mask, gd - (tl.sum(gd, axis=1) / PER)[:, None], 0.0)  # d = u_m - mean_g(u_m)
        dm = dum * a
        tl.store(dm_ptr + off, dm, mask=mask)
        tl.store(dv_ptr + off, dvg * a2, mask=mask)
        # a enters A = s a, u_m = a mc + beta^b and u_v = a^2 v
        acc_da += ga * s + dum * mc + 2.0 * (dvg * v) * a
        acc_dbb += dum
        if WANTS_STATS:
            acc_dm += dm
    tl.store(dbw_ptr + ch, acc_da * rs, mask=mask)
    tl.store(dbb_ptr + ch, acc_dbb, mask=mask)
    if WANTS_STATS:  # batch statistics: the engine chains dmean, dvar into the moments
        tl.store(dmean_ptr + ch, -acc_dm, mask=mask)
        tl.store(dvar_ptr + ch, acc_da * bw * (rs * rs * rs) * -0.5, mask=mask)
    if GROUP_AFFINE:
        tl.store(dw_ptr + grp, tl.sum(acc_dw, axis=1)[:, None], mask=gmask)
        tl.store(db_ptr + grp, tl.sum(acc_db, axis=1)[:, None], mask=gmask)
    else:
        tl.store(dw_ptr + ch, acc_dw, mask=mask)
        tl.store(db_ptr + ch, acc_db, mask=mask)


def _blocks(c: int, num_groups: int):
    """(per, BLOCK_G, BLOCK_P, grid, num_warps) from the fixed menu keyed on channels per group."""
    if num_groups <= 0 or c % num_groups:
        raise ValueError(f'BCN kernels: num_groups={num_groups} must be positive and divide C={c}')
    per = c // num_groups
    if per > _MAX_PER_GROUP:
        raise ValueError(f'BCN kernels hold a whole group in one tile: {per} channels per group is over '
                         f'{_MAX_PER_GROUP}')
    block_p = triton.next_power_of_2(per)
    block_g = min(triton.next_power_of_2(num_groups), max(1, _TILE // block_p))
    num_warps = max(1, min(8, block_g * block_p // 128))
    return per, block_g, block_p, (triton.cdiv(num_groups, block_g), ), num_warps


def coeff_map(m, v, mean, var, params, positions, count, *, num_groups: int, eps: float, group_affine: bool):
    """Triton ``normdense.layers.bcn.coeff_map`` (Eq. 40-42), one launch: ((A, B), res) with A, B (N, C) in m's
    dtype. ``positions`` and ``count`` do not enter BCN's map (as in the torch method); ``res`` is the
    inputs, which :func:`coeff_vjp` recomputes the intermediates from."""
    bw, bb, w, b = (p.contiguous() for p in params)
    m, v, mean, var = m.contiguous(), v.contiguous(), mean.contiguous(), var.contiguous()
    n, c = m.shape
    per, block_g, block_p, grid, warps = _blocks(c, num_groups)
    a_out, b_out = torch.empty_like(m), torch.empty_like(m)
    _bcn_map_kernel[grid](m, v, mean, var, bw, bb, w, b, a_out, b_out, n, c, num_groups, per,
                          EPS=float(eps), GROUP_AFFINE=bool(group_affine), BLOCK_G=block_g, BLOCK_P=block_p,
                          num_warps=warps)
    return (a_out, b_out), (m, v, mean, var, bw, bb, w, b)


def coeff_vjp(res, grads, wants_stats, *, num_groups: int, eps: float, group_affine: bool):
    """Triton ``BatchChannelNorm2d.coeff_vjp``, one launch: (dm, dv, dmean, dvar, (d batch_weight, d batch_bias,
    d weight, d bias)) in m's dtype for the gradients (gA, gB) of (A, B); dmean, dvar None unless
    ``wants_stats`` (batch statistics)."""
    m, v, mean, var, bw, bb, w, b = res
    ga, gb = (t.contiguous() for t in grads)
    n, c = m.shape
    per, block_g, block_p, grid, warps = _blocks(c, num_groups)
    dm, dv = torch.empty_like(m), torch.empty_like(m)
    dbw, dbb = m.new_empty(c), m.new_empty(c)
    dw, db = m.new_empty(w.shape), m.new_empty(b.shape)
    dmean, dvar = (m.new_empty(c), m.new_empty(c)) if wants_stats else (None, None)
    _bcn_vjp_kernel[grid](m, v, mean, var, bw, bb, w, ga, gb, dm, dv,
                          dbw if dmean is None else dmean, dbw if dvar is None else dvar,  # unused if not wanted
                          dbw, dbb, dw, db, n, c, num_groups, per, EPS=float(eps),
                          GROUP_AFFINE=bool(group_affine), WANTS_STATS=bool(wants_stats),
                          BLOCK_G=block_g, BLOCK_P=block_p, num_warps=warps)
    return dm, dv, dmean, dvar, (dbw, dbb, dw, db)
