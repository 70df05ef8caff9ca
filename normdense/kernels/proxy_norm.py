"""GN+PN's channel-sized coefficient map and its closed-form VJP, one Triton launch each: the transcriptions of
``coeff_map`` / ``coeff_vjp`` of ``normdense/layers/proxy_norm.py``.

Paper: Labatie et al., "Proxy-Normalizing Activations to Match Batch Normalization while Removing Batch
Dependence", arXiv:2106.03743, Eq. 7 and App. B. Per (n, c), from the moments m, v of x:

    GN stage      A = gamma / sigma_g,   B = beta + A (m - mu_g),   sigma_g^2 = mean_g(v + (m - mu_g)^2) + eps
    proxy (Eq. 7) Y = beta~ + (1 + gamma~) q  (q the deterministic quantiles, App. B),  z = gamma Y + beta
                  K = 1 / sqrt(Var_q[phi(z)] + eps_pn),   L = -E_q[phi(z)] K   (K = 1, L = -E_q[phi(z)] without
                  proxy scaling)

Layout: one program per block of whole groups, a [BLOCK_G, BLOCK_P] tile of (group, channel in the group) that
loops over the N samples (the GN stage, and in the VJP the sums over N of the parameter gradients, so no
atomics), and the proxy moments of the same channels over [BLOCK_G, BLOCK_P, BLOCK_S] tiles of the quantiles
(they depend only on parameters: recomputed in the VJP rather than stored). The block sizes depend only on the
channels per group, the number of groups and the number of samples. A group is held whole in a tile: channels
per group up to a few thousand (LN+PN of C <= 4096).

The float configuration (eps, proxy_eps, the activation's parameters) is ``tl.constexpr``: a runtime float
argument is float32 on the GPU and would round them in float64 computations.
"""
import torch
import triton
import triton.language as tl

from .activations import act_args, act_forward, act_grad

__all__ = ['coeff_map', 'coeff_vjp']

_CHANNELS = 64  # channels per program (whole groups), when the groups are smaller
_PROXY_TILE = 2048  # elements of a [groups, channels, samples] tile of the proxy


def _blocks(groups: int, per: int, samples: int):
    bp = triton.next_power_of_2(per)
    bg = max(1, min(triton.next_power_of_2(groups), _CHANNELS // bp))
    bs = max(1, min(triton.next_power_of_2(samples), _PROXY_TILE // (bg * bp)))
    return bg, bp, bs


@triton.jit
def _rsqrt(x):
    return 1.0 / tl.sqrt(x)  # not tl.rsqrt: its float64 form may be an approximation on the GPU


@triton.jit
def _gn_stage(m_ptr, v_ptr, off, mask, per, EPS: tl.constexpr):
    """d = m - mu_g (0 off the tile) and r = 1 / sigma_g ([BLOCK_G]) of one sample."""
    mn = tl.load(m_ptr + off, mask=mask, other=0.0)
    vn = tl.load(v_ptr + off, mask=mask, other=0.0)
    d = tl.where(mask, mn - (tl.sum(mn, axis=1) / per)[:, None], 0.0)
    r = _rsqrt(tl.sum(vn + d * d, axis=1) / per + EPS)
    return d, r


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
def _tile_params(w_ptr, b_ptr, pb_ptr, pg_ptr, G, per, dt, AFFINE: tl.constexpr, BLOCK_G: tl.constexpr,
                 BLOCK_P: tl.constexpr):
    """The program's tile of whole groups (channels, mask) and the parameters on it, in the compute dtype."""
    g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)[:, None]
    p = tl.arange(0, BLOCK_P)[None, :]
    ch = g * per + p
    mask = (g < G) & (p < per)
    w = tl.load(w_ptr + ch, mask=mask, other=0.0).to(dt)
    b = tl.load(b_ptr + ch, mask=mask, other=0.0).to(dt)
    if AFFINE:
        pb = tl.load(pb_ptr + ch, mask=mask, other=0.0).to(dt)
        pg = tl.load(pg_ptr + ch, mask=mask, other=0.0).to(dt)
    else:
        pb = tl.zeros_like(w)
        pg = tl.zeros_like(w)
    return ch, mask, w, b, pb, pg


@triton.jit(do_not_specialize=['N', 'C', 'G', 'per', 'S'])
def _coeff_map_kernel(m_ptr, v_ptr, w_ptr, b_ptr, pb_ptr, pg_ptr, q_ptr, a_ptr, bb_ptr, k_ptr, l_ptr,
                      N, C, G, per, S, EPS: tl.constexpr, PROXY_EPS: tl.constexpr, ACT: tl.constexpr,
                      P0: tl.constexpr, P1: tl.constexpr, AFFINE: tl.constexpr, SCALING: tl.constexpr,
                      BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr):
    dt = m_ptr.dtype.element_ty
    ch, mask, w, b, pb, pg = _tile_params(w_ptr, b_ptr, pb_ptr, pg_ptr, G, per, dt, AFFINE, BLOCK_G, BLOCK_P)
    pmean, pvar = _proxy_moments(w, b, pb, pg, q_ptr, S, ACT, P0, P1, AFFINE, SCALING, BLOCK_S)
    if SCALING:
        k = _rsqrt(pvar + PROXY_EPS)
        l_ = -pmean * k
    else:
        k = tl.zeros_like(w) + 1.0
        l_ = -pmean
    for n in range(0, N):
        off = n * C + ch
        d, r = _gn_stage(m_ptr, v_ptr, off, mask, per, EPS)
        a = r[:, None] * w
        tl.store(a_ptr + off, a, mask=mask)
        tl.store(bb_ptr + off, b + a * d, mask=mask)
        tl.store(k_ptr + off, k, mask=mask)
        tl.store(l_ptr + off, l_, mask=mask)


@triton.jit(do_not_specialize=['N', 'C', 'G', 'per', 'S'])
def _coeff_vjp_kernel(m_ptr, v_ptr, w_ptr, b_ptr, pb_ptr, pg_ptr, q_ptr,
                      ga_ptr, gb_ptr, gk_ptr, gl_ptr, s_ga_n, s_ga_c, s_gb_n, s_gb_c, s_gk_n, s_gk_c, s_gl_n, s_gl_c,
                      dm_ptr, dv_ptr, dw_ptr, db_ptr, dpb_ptr, dpg_ptr,
                      N, C, G, per, S, EPS: tl.constexpr, PROXY_EPS: tl.constexpr, ACT: tl.constexpr,
                      P0: tl.constexpr, P1: tl.constexpr, AFFINE: tl.constexpr, SCALING: tl.constexpr,
                      BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr):
    dt = m_ptr.dtype.element_ty
    ch, mask, w, b, pb, pg = _tile_params(w_ptr, b_ptr, pb_ptr, pg_ptr, G, per, dt, AFFINE, BLOCK_G, BLOCK_P)
    dw = tl.zeros_like(w)
    db = tl.zeros_like(w)
    gk_sum = tl.zeros_like(w)
    gl_sum = tl.zeros_like(w)
    # GN stage, per sample: A = r gamma and B = beta + A d, with d and r functions of the group's m, v
    for n in range(0, N):
        off = n * C + ch
        d, r = _gn_stage(m_ptr, v_ptr, off, mask, per, EPS)
        ga = tl.load(ga_ptr + n * s_ga_n + ch * s_ga_c, mask=mask, other=0.0).to(dt)
        gb = tl.load(gb_ptr + n * s_gb_n + ch * s_gb_c, mask=mask, other=0.0).to(dt)
        gk_sum += tl.load(gk_ptr + n * s_gk_n + ch * s_gk_c, mask=mask, other=0.0).to(dt)
        gl_sum += tl.load(gl_ptr + n * s_gl_n + ch * s_gl_c, mask=mask, other=0.0).to(dt)
        ga_t = ga + gb * d  # total gradient of A (B = beta + A d)
        dw += ga_t * r[:, None]
        db += gb
        # through r = (mean_g(v + d^2) + eps)^(-1/2): d r / d v_c = -r^3 / (2 P)
        dvg = tl.sum(ga_t * w, axis=1) * (r * r * r * -0.5) / per
        gd = tl.where(mask, gb * (r[:, None] * w) + d * 2.0 * dvg[:, None], 0.0)
        tl.store(dm_ptr + off, gd - (tl.sum(gd, axis=1) / per)[:, None], mask=mask)  # d = m - mu_g
        tl.store(dv_ptr + off, tl.zeros_like(w) + dvg[:, None], mask=mask)
    # proxy moments: K = (var + eps_pn)^(-1/2), L = -mean K (or L = -mean), summed over N above
    pmean, pvar = _proxy_moments(w, b, pb, pg, q_ptr, S, ACT, P0, P1, AFFINE, SCALING, BLOCK_S)
    if SCALING:
        k = _rsqrt(pvar + PROXY_EPS)
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
    tl.store(dw_ptr + ch, dw, mask=mask)
    tl.store(db_ptr + ch, db, mask=mask)
    if AFFINE:  # Y = beta~ + (1 + gamma~) q, z = gamma Y + beta
        tl.store(dpb_ptr + ch, w * dy_sum, mask=mask)
        tl.store(dpg_ptr + ch, w * dy_q, mask=mask)


def _config(m, num_groups, num_samples, act, act_kwargs):
    n, c = m.shape
    if c % num_groups:
        raise ValueError(f'GN+PN kernels: num_groups={num_groups} does not divide C={c}')
    per = c // num_groups
    bg, bp, bs = _blocks(num_groups, per, num_samples)
    act_id, p0, p1 = act_args(act, act_kwargs)
    return n, c, per, (triton.cdiv(num_groups, bg), ), dict(ACT=act_id, P0=p0, P1=p1, BLOCK_G=bg, BLOCK_P=bp,
                                                              BLOCK_S=bs)


def coeff_map(m, v, mean, var, params, positions, count, *, num_groups, eps, act, act_kwargs, proxy_eps,
              proxy_scaling, proxy_affine, quantiles):
    """``normdense.layers.proxy_norm.coeff_map`` in one launch: ((A, B, K, L), residuals), each coefficient (N, C)
    in m's dtype. ``quantiles`` are the proxy samples q (num_samples,) (the layer's cached quantiles); ``mean``,
    ``var``, ``positions`` and ``count`` are unused (GN+PN has no first stage)."""
    weight, bias, proxy_beta, proxy_gamma = params
    m, v = m.contiguous(), v.contiguous()
    n, c, per, grid, blocks = _config(m, num_groups, quantiles.numel(), act, act_kwargs)
    a, b, k, l_ = (torch.empty_like(m) for _ in range(4))
    pb, pg = (proxy_beta, proxy_gamma) if proxy_affine else (weight, weight)  # not read without proxy_affine
    _coeff_map_kernel[grid](m, v, weight, bias, pb, pg, quantiles, a, b, k, l_, n, c, num_groups, per,
                            quantiles.numel(), EPS=float(eps), PROXY_EPS=float(proxy_eps), AFFINE=bool(proxy_affine),
                            SCALING=bool(proxy_scaling), **blocks)
    return (a, b, k, l_), (m, v, params, quantiles)


def coeff_vjp(res, grads, wants_stats, *, num_groups, eps, act, act_kwargs, proxy_eps, proxy_scaling,
              proxy_affine):
    """``GroupProxyNorm.coeff_vjp`` in one launch: (dm, dv, None, None, (d weight, d bias, d proxy_beta,
    d proxy_gamma)) in m's dtype (the proxy ones None without proxy_affine), for ``grads`` = (gA, gB, gK, gL),
    each (N, C) with any strides."""
    m, v, params, quantiles = res
    weight, bias, proxy_beta, proxy_gamma = params
    ga, gb, gk, gl = grads
    n, c, per, grid, blocks = _config(m, num_groups, quantiles.numel(), act, act_kwargs)
    dm, dv = torch.empty_like(m), torch.empty_like(m)
    dw, db = m.new_empty(c), m.new_empty(c)
    dpb, dpg = (m.new_empty(c), m.new_empty(c)) if proxy_affine else (dw, dw)  # not written without
    pb, pg = (proxy_beta, proxy_gamma) if proxy_affine else (weight, weight)
    _coeff_vjp_kernel[grid](m, v, weight, bias, pb, pg, quantiles, ga, gb, gk, gl, *ga.stride(), *gb.stride(),
                            *gk.stride(), *gl.stride(), dm, dv, dw, db, dpb, dpg, n, c, num_groups, per,
                            quantiles.numel(), EPS=float(eps), PROXY_EPS=float(proxy_eps), AFFINE=bool(proxy_affine),
                            SCALING=bool(proxy_scaling), **blocks)
    dparams = (dw, db, dpb, dpg) if proxy_affine else (dw, db, None, None)
    return dm, dv, None, None, dparams
