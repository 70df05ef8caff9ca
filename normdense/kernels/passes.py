"""The kernels of the StatNorm engine's passes over the activation x3 (N, C, L), launched by ``triton.py``:
per-(n, c) moment partials, y = A (x - m) + B (or K act(A (x - m) + B) + L'), the coefficient gradients' partial
sums, their merge, and dx. Each kernel takes x3 NCL (CL = False: grid (rows, splits)) or channels_last (CL =
True: grid (N * channel blocks, splits)), reads and writes 16-byte vectors (V elements, ``common``), reads x,
dy in their own dtypes and accumulates in ACC (float32 for half inputs, float64 for float64)."""
import triton
import triton.language as tl

from .activations import act_forward, act_grad
from .common import FINISH_BLOCK, cl_channels, cl_tile, finish, from_hi_lo, ncl_span, ncl_vectors, split_sum


@triton.jit
def _chan(cnt, mean, m2, nb, bmean, bm2):
    """Chan et al.'s merge of a tile's (count nb, mean, centred sum of squares) into the running ones."""
    tot = cnt + nb
    delta = bmean - mean
    return tot, mean + delta * (nb / tot), m2 + bm2 + delta * delta * (cnt * nb / tot)


@triton.jit(do_not_specialize=['ROWS', 'C', 'L', 'CHUNK'])
def _moments_kernel(x_ptr, part_ptr, ROWS, C, L, CHUNK, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
                    V: tl.constexpr, CL: tl.constexpr, ACC: tl.constexpr):
    """Each chunk's mean and centred sum of squares of its row, part (SPLIT, 2, N C): the chunk is positions
    [s CHUNK, min((s + 1) CHUNK, L)) of row (n, c), the counts the first stage merges by. Per
    tile of BLOCK positions: its mean and centred sum of squares in registers (one read of memory), merged
    into the chunk's with Chan et al.'s update. Shifted by the chunk's first value (NCL; CL: the row's first
    value): a constant row has exactly m = x, v = 0 (as ATen's Welford kernels)."""
    s = tl.program_id(1)
    if CL:
        n, ch, cm, CV = cl_channels(tl.program_id(0), C, BLOCK_C, V)
        start = s * CHUNK
        end = tl.minimum(start + CHUNK, L)
        shift = tl.load(x_ptr + n.to(tl.int64) * CV * L + ch, mask=cm, other=0.0).to(ACC)
        cnt = tl.zeros([BLOCK_C], ACC)
        mean = tl.zeros([BLOCK_C], ACC)
        m2 = tl.zeros([BLOCK_C], ACC)
        for off in range(start, end, BLOCK):
            offs, mask = cl_tile(n, ch, cm, CV, L, off, end, BLOCK)
            xv = tl.where(mask, tl.load(x_ptr + offs, mask=mask, other=0.0).to(ACC) - shift[None, :], 0.0)
            nb = tl.minimum(end - off, BLOCK).to(ACC)
            bmean = tl.sum(xv, 0) / nb
            d = tl.where(mask, xv - bmean[None, :], 0.0)
            cnt, mean, m2 = _chan(cnt, mean, m2, nb, bmean, tl.sum(d * d, 0))
        out = part_ptr + s.to(tl.int64) * 2 * ROWS + n * C + ch
        tl.store(out, mean + shift, mask=cm)
        tl.store(out + ROWS, m2, mask=cm)
    else:
        row = tl.program_id(0)
        lo, hi, a0, bound = ncl_span(row, s, L, CHUNK, V)
        cols = tl.arange(0, BLOCK)
        shift = tl.zeros([], ACC)
        cnt = tl.zeros([], ACC)
        mean = tl.zeros([], ACC)
        m2 = tl.zeros([], ACC)
        for off in range(a0, hi, BLOCK):  # every tile holds >= 1 element of [lo, hi)
            idx = off + cols
            keep = (idx >= lo) & (idx < hi)
            raw = tl.load(x_ptr + idx, mask=idx < bound, other=0.0).to(ACC)
            if off == a0:  # the chunk's first value, from the tile (a scalar load of it would not be a vector)
                shift = tl.sum(tl.where(idx == lo, raw, 0.0), 0)
            xv = tl.where(keep, raw - shift, 0.0)
            nb = (tl.minimum(hi, off + BLOCK) - tl.maximum(lo, off)).to(ACC)
            bmean = tl.sum(xv, 0) / nb
            d = tl.where(keep, xv - bmean, 0.0)
            cnt, mean, m2 = _chan(cnt, mean, m2, nb, bmean, tl.sum(d * d, 0))
        out = part_ptr + s.to(tl.int64) * 2 * ROWS + row
        tl.store(out, mean + shift)
        tl.store(out + ROWS, m2)


@triton.jit
def _apply_coeffs(m_ptr, v_ptr, a_ptr, b_ptr, k_ptr, l_ptr, r, mask, ACT: tl.constexpr, ACC: tl.constexpr):
    """(m, A, B, K, L') of row(s) r, A = 0 where v = 0 (a constant row: x - m is 0 or the rounding of m)."""
    m = tl.load(m_ptr + r, mask=mask, other=0.0).to(ACC)
    a = tl.where(tl.load(v_ptr + r, mask=mask, other=0.0) > 0, tl.load(a_ptr + r, mask=mask, other=0.0).to(ACC), 0.0)
    b = tl.load(b_ptr + r, mask=mask, other=0.0).to(ACC)
    kk = b
    ll = b
    if ACT >= 0:
        kk = tl.load(k_ptr + r, mask=mask, other=0.0).to(ACC)
        ll = tl.load(l_ptr + r, mask=mask, other=0.0).to(ACC)
    return m, a, b, kk, ll


@triton.jit
def _apply_map(xv, m, a, b, kk, ll, p0, p1, ACT: tl.constexpr):
    y = a * (xv - m) + b
    if ACT >= 0:
        y = kk * act_forward(y, ACT, p0, p1) + ll
    return y


@triton.jit(do_not_specialize=['C', 'L', 'CHUNK', 'WRITE', 'INC'])
def _apply_kernel(x_ptr, y_ptr, m_ptr, v_ptr, a_ptr, b_ptr, k_ptr, l_ptr, upd_ptr, rm_ptr, rv_ptr, nbt_ptr,
                  C, L, CHUNK, WRITE, INC, p0h, p0l, p1h, p1l, ACT: tl.constexpr, BLOCK: tl.constexpr,
                  BLOCK_C: tl.constexpr, V: tl.constexpr, SMALL: tl.constexpr, CL: tl.constexpr,
                  ACC: tl.constexpr):
    """y = A (x - m) + B, or K act(A (x - m) + B) + L', written once in y's dtype and x3's layout. NCL: the
    program of (row r, split s) writes the vectors :func:`ncl_vectors` gives it; an element there belongs to
    row r or r + 1 (L >= V), or with SMALL (L < V) to row idx // L, gathered. The forward's side effects,
    last: WRITE: the programs of sample 0, split 0 copy upd[:, c] into the running (mean, var); INC: program
    (0, 0) adds 1 to num_batches_tracked."""
    s = tl.program_id(1)
    p0 = from_hi_lo(p0h, p0l, ACC)
    p1 = from_hi_lo(p1h, p1l, ACC)
    if CL:
        n, ch, cm, CV = cl_channels(tl.program_id(0), C, BLOCK_C, V)
        start = s * CHUNK
        end = tl.minimum(start + CHUNK, L)
        m, a, b, kk, ll = _apply_coeffs(m_ptr, v_ptr, a_ptr, b_ptr, k_ptr, l_ptr, n * C + ch, cm, ACT, ACC)
        for off in range(start, end, BLOCK):
            offs, mask = cl_tile(n, ch, cm, CV, L, off, end, BLOCK)
            xv = tl.load(x_ptr + offs, mask=mask, other=0.0).to(ACC)
            y = _apply_map(xv, m[None, :], a[None, :], b[None, :], kk[None, :], ll[None, :], p0, p1, ACT)
            tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
        if s == 0:
            if WRITE != 0:
                if n == 0:
                    tl.store(rm_ptr + ch, tl.load(upd_ptr + ch, mask=cm).to(rm_ptr.dtype.element_ty), mask=cm)
                    tl.store(rv_ptr + ch, tl.load(upd_ptr + C + ch, mask=cm).to(rv_ptr.dtype.element_ty), mask=cm)
    else:
        row = tl.program_id(0)
        last = tl.num_programs(0) - 1
        r1, cs, ce = ncl_vectors(row, s, L, CHUNK, V)
        cols = tl.arange(0, BLOCK)
        if not SMALL:
            m0, a0, b0, k0, l0 = _apply_coeffs(m_ptr, v_ptr, a_ptr, b_ptr, k_ptr, l_ptr, row, True, ACT, ACC)
            m1, a1, b1, k1, l1 = _apply_coeffs(m_ptr, v_ptr, a_ptr, b_ptr, k_ptr, l_ptr,
                                               tl.minimum(row + 1, last), True, ACT, ACC)
        for off in range(cs, ce, BLOCK):
            idx = off + cols
            mask = idx < ce
            xv = tl.load(x_ptr + idx, mask=mask, other=0.0).to(ACC)
            if SMALL:
                r = tl.minimum(idx // L, last)
                m, a, b, kk, ll = _apply_coeffs(m_ptr, v_ptr, a_ptr, b_ptr, k_ptr, l_ptr, r, mask, ACT, ACC)
            else:
                nxt = idx >= r1
                m = tl.where(nxt, m1, m0)
                a = tl.where(nxt, a1, a0)
                b = tl.where(nxt, b1, b0)
                kk = tl.where(nxt, k1, k0)
                ll = tl.where(nxt, l1, l0)
            y = _apply_map(xv, m, a, b, kk, ll, p0, p1, ACT)
            tl.store(y_ptr + idx, y.to(y_ptr.dtype.element_ty), mask=mask)
        if s == 0:
            if WRITE != 0:
                if row < C:
                    tl.store(rm_ptr + row, tl.load(upd_ptr + row).to(rm_ptr.dtype.element_ty))
                    tl.store(rv_ptr + row, tl.load(upd_ptr + C + row).to(rv_ptr.dtype.element_ty))
    if INC != 0:
        if tl.program_id(0) == 0:
            if s == 0:
                tl.store(nbt_ptr, tl.load(nbt_ptr) + 1)


# --- backward ---------------------------------------------------------------------------------------------
@triton.jit
def _t_and_dy(x_ptr, dy_ptr, offs, mask, m, ACC: tl.constexpr):
    """A tile of the backward passes: (t = x - m, dy), accumulated in ACC."""
    t = tl.load(x_ptr + offs, mask=mask, other=0.0).to(ACC) - m
    return t, tl.load(dy_ptr + offs, mask=mask, other=0.0).to(ACC)


@triton.jit
def _sum_terms(t, g, a, b, kk, p0, p1, ACT: tl.constexpr):
    """The summands (g t, g[, dy act(z), dy]) with z = A t + B and g = K dy act'(z) under an activation."""
    s2 = g
    s3 = g
    if ACT >= 0:
        z = a * t + b
        s2 = g * act_forward(z, ACT, p0, p1)
        s3 = g
        g = kk * g * act_grad(z, ACT, p0, p1)
    return g * t, g, s2, s3


@triton.jit(do_not_specialize=['ROWS', 'C', 'L', 'CHUNK'])
def _sums_kernel(x_ptr, dy_ptr, part_ptr, m_ptr, v_ptr, a_ptr, b_ptr, k_ptr, ROWS, C, L, CHUNK, p0h, p0l, p1h,
                 p1l, ACT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr, V: tl.constexpr,
                 CL: tl.constexpr, ACC: tl.constexpr):
    """Partial sums per (split, row) of g t and g (t = x - m, g = dy), and with an activation of g t, g,
    dy act(z), dy with z = A t + B recomputed from x and g = K dy act'(z): the gradients of the coefficients
    (A, B[, K, L']). The chunks as in :func:`_moments_kernel`."""
    s = tl.program_id(1)
    p0 = from_hi_lo(p0h, p0l, ACC)
    p1 = from_hi_lo(p1h, p1l, ACC)
    count = 4 if ACT >= 0 else 2
    if CL:
        n, ch, cm, CV = cl_channels(tl.program_id(0), C, BLOCK_C, V)
        rows = n * C + ch
        start = s * CHUNK
        end = tl.minimum(start + CHUNK, L)
        m = tl.load(m_ptr + rows, mask=cm, other=0.0).to(ACC)[None, :]
        a = tl.where(tl.load(v_ptr + rows, mask=cm, other=0.0) > 0, tl.load(a_ptr + rows, mask=cm, other=0.0).to(ACC),
                     0.0)[None, :]
        b = tl.load(b_ptr + rows, mask=cm, other=0.0).to(ACC)[None, :]
        kk = tl.load(k_ptr + rows, mask=cm, other=0.0).to(ACC)[None, :]
        s0 = tl.zeros([BLOCK, BLOCK_C], ACC)
        s1 = tl.zeros([BLOCK, BLOCK_C], ACC)
        s2 = tl.zeros([BLOCK, BLOCK_C], ACC)
        s3 = tl.zeros([BLOCK, BLOCK_C], ACC)
        for off in range(start, end, BLOCK):
            offs, mask = cl_tile(n, ch, cm, CV, L, off, end, BLOCK)
            t, g = _t_and_dy(x_ptr, dy_ptr, offs, mask, m, ACC)
            t = tl.where(mask, t, 0.0)  # g is 0 there: every summand is
            u0, u1, u2, u3 = _sum_terms(t, g, a, b, kk, p0, p1, ACT)
            s0 += u0
            s1 += u1
            s2 += u2
            s3 += u3
        out = part_ptr + s.to(tl.int64) * count * ROWS + rows
        tl.store(out, tl.sum(s0, 0), mask=cm)
        tl.store(out + ROWS, tl.sum(s1, 0), mask=cm)
        if ACT >= 0:
            tl.store(out + 2 * ROWS, tl.sum(s2, 0), mask=cm)
            tl.store(out + 3 * ROWS, tl.sum(s3, 0), mask=cm)
    else:
        row = tl.program_id(0)
        lo, hi, a0, bound = ncl_span(row, s, L, CHUNK, V)
        m = tl.load(m_ptr + row).to(ACC)
        a = tl.where(tl.load(v_ptr + row) > 0, tl.load(a_ptr + row).to(ACC), 0.0)
        b = tl.load(b_ptr + row).to(ACC)
        kk = tl.load(k_ptr + row).to(ACC)
        cols = tl.arange(0, BLOCK)
        s0 = tl.zeros([BLOCK], ACC)
        s1 = tl.zeros([BLOCK], ACC)
        s2 = tl.zeros([BLOCK], ACC)
        s3 = tl.zeros([BLOCK], ACC)
        for off in range(a0, hi, BLOCK):
            idx = off + cols
            keep = (idx >= lo) & (idx < hi)
            t, g = _t_and_dy(x_ptr, dy_ptr, idx, idx < bound, m, ACC)
            t = tl.where(keep, t, 0.0)  # the neighbouring rows' elements read with the vectors: out
            g = tl.where(keep, g, 0.0)
            u0, u1, u2, u3 = _sum_terms(t, g, a, b, kk, p0, p1, ACT)
            s0 += u0
            s1 += u1
            s2 += u2
            s3 += u3
        out = part_ptr + s.to(tl.int64) * count * ROWS + row
        tl.store(out, tl.sum(s0, 0))
        tl.store(out + ROWS, tl.sum(s1, 0))
        if ACT >= 0:
            tl.store(out + 2 * ROWS, tl.sum(s2, 0))
            tl.store(out + 3 * ROWS, tl.sum(s3, 0))


@triton.jit(do_not_specialize=['SIZE', 'SPLIT'])
def _merge_kernel(part_ptr, out_ptr, SIZE, SPLIT, BLOCK: tl.constexpr):
    """out[i] = sum over the splits of part[s, i], in order (deterministic)."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < SIZE
    acc = tl.load(part_ptr + idx, mask=mask, other=0.0)
    for s in range(1, SPLIT):
        acc += tl.load(part_ptr + s * SIZE + idx, mask=mask, other=0.0)
    tl.store(out_ptr + idx, acc, mask=mask)


@triton.jit
def _dx_coeffs(m_ptr, v_ptr, a_ptr, b_ptr, k_ptr, dm_ptr, dv_ptr, gsum_ptr, mean_ptr, dmean_ptr, dvar_ptr, r,
               mask, C, Lf, scale, GSPLIT, GSTRIDE, BSPLIT, BSTRIDE, ACT: tl.constexpr, BATCH: tl.constexpr,
               ACC: tl.constexpr):
    """(m, A masked, A, c0, c1, B, A K) of row(s) r: dx = A g + c1 t + c0, c0 = (dm - A sum_l g) / L,
    c1 = 2 dv / L (0 where v = 0); BATCH: dm, dv first take the VJP of the batch statistics. sum_l g comes as
    the sums kernel's GSPLIT partials (GSTRIDE apart), added here in order: no merge launch; dmean, dvar as
    the VJP's BSPLIT sample blocks' partials (BSTRIDE apart), likewise."""
    m = tl.load(m_ptr + r, mask=mask, other=0.0).to(ACC)
    live = tl.load(v_ptr + r, mask=mask, other=0.0) > 0
    a_full = tl.load(a_ptr + r, mask=mask, other=0.0).to(ACC)
    dm = tl.load(dm_ptr + r, mask=mask, other=0.0).to(ACC)
    dv = tl.load(dv_ptr + r, mask=mask, other=0.0).to(ACC)
    if BATCH:
        c = r % C
        dvar = split_sum(dvar_ptr, c, mask, BSPLIT, BSTRIDE, ACC)
        dm = dm + scale * split_sum(dmean_ptr, c, mask, BSPLIT, BSTRIDE, ACC) + \
            2.0 * scale * (m - tl.load(mean_ptr + c, mask=mask, other=0.0).to(ACC)) * dvar
        dv = dv + scale * dvar
    gsum = split_sum(gsum_ptr, r, mask, GSPLIT, GSTRIDE, ACC)
    c0 = (dm - a_full * gsum) / Lf
    c1 = tl.where(live, 2.0 * dv / Lf, 0.0)
    b = m
    ak = a_full
    if ACT >= 0:
        b = tl.load(b_ptr + r, mask=mask, other=0.0).to(ACC)
        ak = a_full * tl.load(k_ptr + r, mask=mask, other=0.0).to(ACC)
    return m, tl.where(live, a_full, 0.0), a_full, c0, c1, b, ak


@triton.jit
def _dx_map(t, g, a, a_full, c0, c1, b, ak, p0, p1, ACT: tl.constexpr):
    if ACT >= 0:
        return ak * (g * act_grad(a * t + b, ACT, p0, p1)) + c1 * t + c0
    return a_full * g + c1 * t + c0


@triton.jit(do_not_specialize=['C', 'L', 'CHUNK', 'GOFF', 'GSPLIT', 'GSTRIDE', 'BSPLIT', 'BSTRIDE', 'FIN_P',
                               'FIN_SB', 'FIN_STRIDE'])
def _dx_kernel(x_ptr, dy_ptr, dx_ptr, m_ptr, v_ptr, a_ptr, b_ptr, k_ptr, dm_ptr, dv_ptr, gsum_ptr, mean_ptr,
               dmean_ptr, dvar_ptr, fin_src, fin_dst, C, L, CHUNK, GOFF, GSPLIT, GSTRIDE, BSPLIT, BSTRIDE, FIN_P,
               FIN_SB, FIN_STRIDE, sc_h, sc_l, p0h, p0l, p1h, p1l, ACT: tl.constexpr,
               BATCH: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr, V: tl.constexpr,
               SMALL: tl.constexpr, CL: tl.constexpr, ACC: tl.constexpr, FINISH: tl.constexpr):
    """dx = A g + c1 t + c0 (:func:`_dx_coeffs`), g = dy (g = K dy act'(z) with an activation), written in
    x's dtype and layout; the programs' parts as in :func:`_apply_kernel`. The programs of split 0
    also finish the layer VJP's FIN_P sample-block sums (FINISH: ``common.finish``). sum_l g at gsum_ptr + GOFF
    (in the sums kernel's buffer of every gradient, ``common.grad_buffer``)."""
    gsum_ptr = gsum_ptr + GOFF
    s = tl.program_id(1)
    Lf = L.to(ACC)
    scale = from_hi_lo(sc_h, sc_l, ACC)
    p0 = from_hi_lo(p0h, p0l, ACC)
    p1 = from_hi_lo(p1h, p1l, ACC)
    if CL:
        n, ch, cm, CV = cl_channels(tl.program_id(0), C, BLOCK_C, V)
        start = s * CHUNK
        end = tl.minimum(start + CHUNK, L)
        m, a, a_full, c0, c1, b, ak = _dx_coeffs(m_ptr, v_ptr, a_ptr, b_ptr, k_ptr, dm_ptr, dv_ptr, gsum_ptr,
                                                 mean_ptr, dmean_ptr, dvar_ptr, n * C + ch, cm, C, Lf, scale,
                                                 GSPLIT, GSTRIDE, BSPLIT, BSTRIDE, ACT, BATCH, ACC)
        for off in range(start, end, BLOCK):
            offs, mask = cl_tile(n, ch, cm, CV, L, off, end, BLOCK)
            t, g = _t_and_dy(x_ptr, dy_ptr, offs, mask, m[None, :], ACC)
            dx = _dx_map(t, g, a[None, :], a_full[None, :], c0[None, :], c1[None, :], b[None, :], ak[None, :],
                         p0, p1, ACT)
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    else:
        row = tl.program_id(0)
        last = tl.num_programs(0) - 1
        r1, cs, ce = ncl_vectors(row, s, L, CHUNK, V)
        cols = tl.arange(0, BLOCK)
        if not SMALL:
            m0, a0, f0, c00, c10, b0, ak0 = _dx_coeffs(m_ptr, v_ptr, a_ptr, b_ptr, k_ptr, dm_ptr, dv_ptr, gsum_ptr,
                                                       mean_ptr, dmean_ptr, dvar_ptr, row, True, C, Lf, scale,
                                                       GSPLIT, GSTRIDE, BSPLIT, BSTRIDE, ACT, BATCH, ACC)
            m1, a1, f1, c01, c11, b1, ak1 = _dx_coeffs(m_ptr, v_ptr, a_ptr, b_ptr, k_ptr, dm_ptr, dv_ptr, gsum_ptr,
                                                       mean_ptr, dmean_ptr, dvar_ptr, tl.minimum(row + 1, last),
                                                       True, C, Lf, scale, GSPLIT, GSTRIDE, BSPLIT, BSTRIDE, ACT,
                                                       BATCH, ACC)
        for off in range(cs, ce, BLOCK):
            idx = off + cols
            mask = idx < ce
            if SMALL:
                r = tl.minimum(idx // L, last)
                m, a, a_full, c0, c1, b, ak = _dx_coeffs(m_ptr, v_ptr, a_ptr, b_ptr, k_ptr, dm_ptr, dv_ptr,
                                                         gsum_ptr, mean_ptr, dmean_ptr, dvar_ptr, r, mask, C, Lf,
                                                         scale, GSPLIT, GSTRIDE, BSPLIT, BSTRIDE, ACT, BATCH,
                                                         ACC)
            else:
                nxt = idx >= r1
                m = tl.where(nxt, m1, m0)
                a = tl.where(nxt, a1, a0)
                a_full = tl.where(nxt, f1, f0)
                c0 = tl.where(nxt, c01, c00)
                c1 = tl.where(nxt, c11, c10)
                b = tl.where(nxt, b1, b0)
                ak = tl.where(nxt, ak1, ak0)
            t, g = _t_and_dy(x_ptr, dy_ptr, idx, mask, m, ACC)
            dx = _dx_map(t, g, a, a_full, c0, c1, b, ak, p0, p1, ACT)
            tl.store(dx_ptr + idx, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if FINISH:  # a variant of its own (large N only): no spills in the others
        if tl.program_id(1) == 0:
            finish(fin_src, fin_dst, FIN_P, FIN_SB, FIN_STRIDE, tl.program_id(0), FINISH_BLOCK)
