"""The forward passes over the activation (launched by ``passes.py``): per-(n, c) moment partials and
y = A (x - m) + B (or K act(A (x - m) + B) + L'). Each kernel takes x3 (N, C, L) NCL (CL = False: grid (rows,
splits)) or channels_last (CL = True: grid (N * channel blocks, splits)), reads and writes 16-byte vectors
(V elements, ``passes_tiles``) and accumulates in ACC (float32 for half inputs, float64 for float64)."""
import triton
import triton.language as tl

from .activations import act_forward
from .passes_tiles import cl_channels, cl_tile, ncl_span, ncl_vectors
from .scalars import from_hi_lo


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
    [s CHUNK, min((s + 1) CHUNK, L)) of row (n, c), the counts :func:`passes._stats_kernel` merges by. Per
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
