"""The passes of the StatNorm engine over the activation, in Triton: per-(n, c) moments, the first-stage
statistics, y = A (x - m) + B (or K act(A (x - m) + B) + L'), the backward's per-(n, c) sums and dx.

x is viewed as (R, L) rows, R = N * C, L positions. A pass runs on a grid of (rows, splits): each program
takes one row and one chunk of CHUNK consecutive positions (a runtime integer, a multiple of BLOCK), loops
over it in tiles of BLOCK, and loads x, dy in their own dtype, accumulating in float32 (float64 for float64
inputs). Reductions write one partial per (split, row); the next kernel merges them in a fixed order
(deterministic, no atomics). BLOCK depends on the dtype only, SPLIT is a grid size and the sizes are
``do_not_specialize`` (no variant for a size divisible by 16 or equal to 1): a new image size or batch
size never recompiles a kernel.

Launches per training step of a layer: forward moments, stats, the layer's coefficients, apply (4);
backward sums, [merge of the sums when split], the layer's coefficient VJP, dx (3-4): at most 8.

Moments per chunk: each tile's mean and centred sum of squares in registers (two passes over the tile,
one read of memory), merged into the chunk's with Chan et al.'s update; chunks merged likewise by the
stats kernel. No E[x^2] - E[x]^2 anywhere.
"""
import torch
import triton
import triton.language as tl

from .activations import act_forward, act_grad
from .aten import STATS_BATCH, STATS_ESTIMATE, STATS_FIXED, STATS_NONE  # noqa: F401  (the stats modes)
from .scalars import from_hi_lo, hi_lo

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


def layout(x3: torch.Tensor):
    """(BLOCK, SPLIT, CHUNK) of every pass over x3 (N, C, L)."""
    block = block_for(x3.dtype)
    return (block, ) + split_for(x3.shape[0] * x3.shape[1], x3.shape[2], block)


# --- forward ------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=['ROWS', 'L', 'CHUNK'])
def _moments_kernel(x_ptr, part_ptr, ROWS, L, CHUNK, BLOCK: tl.constexpr, ACC: tl.constexpr):
    row = tl.program_id(0)
    s = tl.program_id(1)
    start = s * CHUNK
    end = tl.minimum(start + CHUNK, L)
    base = x_ptr + row.to(tl.int64) * L
    cols = tl.arange(0, BLOCK)
    # shifted by the row's first value: a constant row has exactly m = x, v = 0 (as ATen's Welford kernels)
    shift = tl.load(base).to(ACC)
    cnt = tl.zeros([], ACC)
    mean = tl.zeros([], ACC)
    m2 = tl.zeros([], ACC)
    for off in range(start, end, BLOCK):
        idx = off + cols
        mask = idx < end
        xv = tl.where(mask, tl.load(base + idx, mask=mask, other=0.0).to(ACC) - shift, 0.0)
        nb = tl.minimum(end - off, BLOCK).to(ACC)
        bmean = tl.sum(xv, 0) / nb
        d = tl.where(mask, xv - bmean, 0.0)
        bm2 = tl.sum(d * d, 0)
        tot = cnt + nb
        delta = bmean - mean
        mean = mean + delta * (nb / tot)
        m2 = m2 + bm2 + delta * delta * (cnt * nb / tot)
        cnt = tot
    out = part_ptr + s.to(tl.int64) * 2 * ROWS + row
    tl.store(out, mean + shift)
    tl.store(out + ROWS, m2)


def moment_partials(x3: torch.Tensor):
    """(partials (SPLIT, 2, N*C): each chunk's mean and centred sum of squares; SPLIT; CHUNK) of x3 (N, C, L)."""
    n, c, length = x3.shape
    rows = n * c
    block, split, chunk = layout(x3)
    acc = torch.float64 if x3.dtype == torch.float64 else torch.float32
    part = torch.empty(split, 2, rows, dtype=acc, device=x3.device)
    _moments_kernel[(rows, split)](x3, part, rows, length, chunk, BLOCK=block, ACC=acc_dtype(x3.dtype))
    return part, split, chunk




@triton.jit(do_not_specialize=['N', 'C', 'L', 'CHUNK', 'SPLIT', 'WRITE'])
def _stats_kernel(part_ptr, m_ptr, v_ptr, mean_ptr, var_ptr, stat_mean_ptr, stat_var_ptr, base_ptr,
                  moved_ptr, upd_ptr, nbt_ptr, N, C, L, CHUNK, SPLIT, rate_hi, rate_lo, mom_hi, mom_lo, WRITE,
                  MODE: tl.constexpr, CUMULATIVE: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    """Merges the chunks' moments into m, v (N, C) and, by MODE, the per-channel statistics (C,) that the
    coefficients take:
      FIXED: mean, var copied from stat_mean / stat_var (eval: the running statistics);
      ESTIMATE: Algorithm 1 steps 1-4 of arXiv:1903.10520 from the estimates at the iteration's start
        (stat_* when WRITE, which then also copies them to base; else base): the batch mean and the second
        moment around the estimate (moved, (2, C)), the estimates moved by ``rate`` towards them (mean, var);
        WRITE: the running estimates' new values (upd, (2, C)) are them;
      BATCH: the batch mean and biased variance (mean, var); WRITE: the running statistics' new values (upd):
        tracked with the unbiased variance, ``momentum`` or the cumulative 1 / (num_batches_tracked + 1).
    Nothing of the module's state is written here: the apply kernel, the forward's last, copies upd into the
    buffers and counts num_batches_tracked, so a kernel failing to compile leaves the state as it was (and
    num_batches_tracked is not written while other programs read it)."""
    pid = tl.program_id(0)
    ch = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = ch < C
    ROWS = N * C
    Lf = L.to(ACC)
    rate = from_hi_lo(rate_hi, rate_lo, ACC)
    if MODE == 2:
        bm = tl.load(stat_mean_ptr + ch, mask=cm, other=0.0).to(ACC)
        bv = tl.load(stat_var_ptr + ch, mask=cm, other=0.0).to(ACC)
        if WRITE == 0:
            bm = tl.load(base_ptr + ch, mask=cm, other=0.0).to(ACC)
            bv = tl.load(base_ptr + C + ch, mask=cm, other=0.0).to(ACC)
    else:
        bm = tl.zeros([BLOCK_C], ACC)
        bv = tl.zeros([BLOCK_C], ACC)
    k = tl.zeros([BLOCK_C], ACC)  # batch statistics: Chan's merge over samples
    bmean = tl.zeros([BLOCK_C], ACC)
    bm2 = tl.zeros([BLOCK_C], ACC)
    for n in range(0, N):
        row = n * C + ch
        cnt = tl.zeros([BLOCK_C], ACC)
        mean = tl.zeros([BLOCK_C], ACC)
        m2 = tl.zeros([BLOCK_C], ACC)
        for s in range(0, SPLIT):
            nb = tl.minimum(L - s * CHUNK, CHUNK).to(ACC)
            pm = tl.load(part_ptr + s * 2 * ROWS + row, mask=cm, other=0.0)
            pm2 = tl.load(part_ptr + (s * 2 + 1) * ROWS + row, mask=cm, other=0.0)
            tot = cnt + nb
            delta = pm - mean
            mean = mean + delta * (nb / tot)
            m2 = m2 + pm2 + delta * delta * (cnt * nb / tot)
            cnt = tot
        var = m2 / Lf
        tl.store(m_ptr + row, mean, mask=cm)
        tl.store(v_ptr + row, var, mask=cm)
        if MODE == 2:  # sums of m and of v + (m - estimate)^2
            d = mean - bm
            bmean += mean
            bm2 += var + d * d
        if MODE == 3:
            tot = k + Lf
            delta = mean - bmean
            bmean = bmean + delta * (Lf / tot)
            bm2 = bm2 + m2 + delta * delta * (k * Lf / tot)
            k = tot
    if MODE == 1:
        tl.store(mean_ptr + ch, tl.load(stat_mean_ptr + ch, mask=cm, other=0.0).to(ACC), mask=cm)
        tl.store(var_ptr + ch, tl.load(stat_var_ptr + ch, mask=cm, other=0.0).to(ACC), mask=cm)
    if MODE == 2:
        bmean = bmean / N
        bm2 = bm2 / N
        tl.store(moved_ptr + ch, bmean, mask=cm)
        tl.store(moved_ptr + C + ch, bm2, mask=cm)
        em = bm + rate * (bmean - bm)
        ev = bv + rate * (bm2 - bv)
        tl.store(mean_ptr + ch, em, mask=cm)
        tl.store(var_ptr + ch, ev, mask=cm)
        if WRITE != 0:
            tl.store(base_ptr + ch, bm, mask=cm)
            tl.store(base_ptr + C + ch, bv, mask=cm)
            tl.store(upd_ptr + ch, em, mask=cm)
            tl.store(upd_ptr + C + ch, ev, mask=cm)
    if MODE == 3:
        var = bm2 / k
        tl.store(mean_ptr + ch, bmean, mask=cm)
        tl.store(var_ptr + ch, var, mask=cm)
        if WRITE != 0:
            rm = tl.load(stat_mean_ptr + ch, mask=cm, other=0.0).to(ACC)
            rv = tl.load(stat_var_ptr + ch, mask=cm, other=0.0).to(ACC)
            unbiased = var * (k / (k - 1.0))
            if CUMULATIVE:  # divided, not multiplied by 1 / count: a float32 literal 1.0 would round it
                tracked = (tl.load(nbt_ptr) + 1).to(ACC)
                tl.store(upd_ptr + ch, rm + (bmean - rm) / tracked, mask=cm)
                tl.store(upd_ptr + C + ch, rv + (unbiased - rv) / tracked, mask=cm)
            else:
                w = from_hi_lo(mom_hi, mom_lo, ACC)
                tl.store(upd_ptr + ch, rm + w * (bmean - rm), mask=cm)
                tl.store(upd_ptr + C + ch, rv + w * (unbiased - rv), mask=cm)


def stats(part, split, chunk, shape, mode=STATS_NONE, stat_mean=None, stat_var=None, base=None, rate=0.0,
          momentum=0.1, write=False, nbt=None):
    """Merge the moment partials of x (N, C, L) = ``shape``: returns (m, v, mean, var, moved, upd) with m, v
    (N, C) and, by ``mode`` (see :func:`_stats_kernel`), mean, var (C,), for STATS_ESTIMATE ``moved`` (2, C):
    the batch mean and second moment around the estimates, and with ``write`` ``upd`` (2, C): the new values of
    (stat_mean, stat_var) for :func:`apply` to write. ``base`` (2, C): the iteration's starting estimates
    (written when ``write``, else read). STATS_BATCH with ``momentum`` None needs ``nbt``."""
    n, c, length = shape
    dt = part.dtype
    m = torch.empty(n, c, dtype=dt, device=part.device)
    v = torch.empty(n, c, dtype=dt, device=part.device)
    mean = var = moved = None
    dummy = m
    if mode != STATS_NONE:
        mean = torch.empty(c, dtype=dt, device=part.device)
        var = torch.empty(c, dtype=dt, device=part.device)
    if mode == STATS_ESTIMATE:
        moved = torch.empty(2, c, dtype=dt, device=part.device)
    upd = torch.empty(2, c, dtype=dt, device=part.device) if write else None
    cumulative = mode == STATS_BATCH and momentum is None
    block_c = min(triton.next_power_of_2(max(c, 1)), 128)
    grid = (triton.cdiv(c, block_c), )
    _stats_kernel[grid](part, m, v, dummy if mean is None else mean, dummy if var is None else var,
                        dummy if stat_mean is None else stat_mean, dummy if stat_var is None else stat_var,
                        dummy if base is None else base, dummy if moved is None else moved,
                        dummy if upd is None else upd, dummy if nbt is None else nbt, n, c, length, chunk, split,
                        *hi_lo(rate), *hi_lo(0.0 if momentum is None else momentum), int(bool(write)),
                        MODE=mode, CUMULATIVE=cumulative, BLOCK_C=block_c, ACC=acc_dtype(dt))
    return m, v, mean, var, moved, upd


@triton.jit(do_not_specialize=['C', 'L', 'CHUNK', 'WRITE', 'INC'])
def _apply_kernel(x_ptr, y_ptr, m_ptr, v_ptr, a_ptr, b_ptr, k_ptr, l_ptr, upd_ptr, rm_ptr, rv_ptr, nbt_ptr,
                  C, L, CHUNK, WRITE, INC, p0h, p0l, p1h, p1l, ACT: tl.constexpr, BLOCK: tl.constexpr,
                  ACC: tl.constexpr):
    """y = A (x - m) + B, or K act(A (x - m) + B) + L', written once in y's dtype; A = 0 where v = 0 (a
    constant row: x - m is 0 or the rounding of m). The forward's side effects, last: WRITE: programs
    (c < C, 0) copy upd[:, c] into the running (mean, var); INC: program (0, 0) adds 1 to
    num_batches_tracked."""
    row = tl.program_id(0)
    s = tl.program_id(1)
    start = s * CHUNK
    end = tl.minimum(start + CHUNK, L)
    m = tl.load(m_ptr + row).to(ACC)
    a = tl.where(tl.load(v_ptr + row) > 0, tl.load(a_ptr + row).to(ACC), 0.0)
    b = tl.load(b_ptr + row).to(ACC)
    p0 = from_hi_lo(p0h, p0l, ACC)
    p1 = from_hi_lo(p1h, p1l, ACC)
    if ACT >= 0:
        kk = tl.load(k_ptr + row).to(ACC)
        ll = tl.load(l_ptr + row).to(ACC)
    offs = row.to(tl.int64) * L
    cols = tl.arange(0, BLOCK)
    for off in range(start, end, BLOCK):
        idx = off + cols
        mask = idx < end
        xv = tl.load(x_ptr + offs + idx, mask=mask, other=0.0).to(ACC)
        y = a * (xv - m) + b
        if ACT >= 0:
            y = kk * act_forward(y, ACT, p0, p1) + ll
        tl.store(y_ptr + offs + idx, y.to(y_ptr.dtype.element_ty), mask=mask)
    if s == 0:
        if WRITE != 0:
            if row < C:
                tl.store(rm_ptr + row, tl.load(upd_ptr + row).to(rm_ptr.dtype.element_ty))
                tl.store(rv_ptr + row, tl.load(upd_ptr + C + row).to(rv_ptr.dtype.element_ty))
        if INC != 0:
            if row == 0:
                tl.store(nbt_ptr, tl.load(nbt_ptr) + 1)


def _act(act):
    return (ACT_NONE, 0.0, 0.0) if act is None else act


def apply(x3, m, v, coeffs, act=None, out_dtype=None, write=None, nbt=None):
    """y (N, C, L) of x3 with the per-(n, c) coefficients (A, B[, K, L']); ``act`` (id, p0, p1) from
    :func:`normdense.kernels.activations.act_args` or None; ``write`` = (upd, running_mean, running_var): the
    new values to copy into the buffers; ``nbt``: a num_batches_tracked to add 1 to."""
    n, c, length = x3.shape
    act_id, p0, p1 = _act(act)
    y = torch.empty(x3.shape, dtype=out_dtype or x3.dtype, device=x3.device)
    block, split, chunk = layout(x3)
    a, b = coeffs[0], coeffs[1]
    k, l_ = (coeffs[2], coeffs[3]) if act_id >= 0 else (a, b)
    upd, rm, rv = write if write is not None else (m, m, m)
    _apply_kernel[(n * c, split)](x3, y, m, v, a, b, k, l_, upd, rm, rv, m if nbt is None else nbt, c, length,
                                  chunk, int(write is not None), int(nbt is not None), *hi_lo(p0), *hi_lo(p1),
                                  ACT=act_id, BLOCK=block, ACC=acc_dtype(x3.dtype))
    return y


# --- backward -----------------------------------------------------------------------------------------------
@triton.jit
def _t_and_dy(x_ptr, dy_ptr, offs, idx, end, m, ACC: tl.constexpr):
    """A tile of a row of the backward passes: (mask, t = x - m, dy), accumulated in ACC."""
    mask = idx < end
    t = tl.load(x_ptr + offs + idx, mask=mask, other=0.0).to(ACC) - m
    return mask, t, tl.load(dy_ptr + offs + idx, mask=mask, other=0.0).to(ACC)


@triton.jit(do_not_specialize=['ROWS', 'L', 'CHUNK'])
def _sums_kernel(x_ptr, dy_ptr, part_ptr, m_ptr, v_ptr, a_ptr, b_ptr, k_ptr, ROWS, L, CHUNK, p0h, p0l, p1h,
                 p1l, ACT: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr):
    """Partial sums per (split, row) of g t and g (t = x - m, g = dy), and with an activation of g t, g,
    dy act(z), dy with z = A t + B recomputed from x and g = K dy act'(z): the gradients of the coefficients
    (A, B[, K, L'])."""
    row = tl.program_id(0)
    s = tl.program_id(1)
    start = s * CHUNK
    end = tl.minimum(start + CHUNK, L)
    m = tl.load(m_ptr + row).to(ACC)
    p0 = from_hi_lo(p0h, p0l, ACC)
    p1 = from_hi_lo(p1h, p1l, ACC)
    offs = row.to(tl.int64) * L
    cols = tl.arange(0, BLOCK)
    s0 = tl.zeros([BLOCK], ACC)
    s1 = tl.zeros([BLOCK], ACC)
    s2 = tl.zeros([BLOCK], ACC)
    s3 = tl.zeros([BLOCK], ACC)
    if ACT >= 0:
        a = tl.where(tl.load(v_ptr + row) > 0, tl.load(a_ptr + row).to(ACC), 0.0)
        b = tl.load(b_ptr + row).to(ACC)
        kk = tl.load(k_ptr + row).to(ACC)
    for off in range(start, end, BLOCK):
        idx = off + cols
        mask, t, g = _t_and_dy(x_ptr, dy_ptr, offs, idx, end, m, ACC)
        if ACT >= 0:
            z = a * t + b
            s2 += g * act_forward(z, ACT, p0, p1)
            s3 += g
            g = kk * g * act_grad(z, ACT, p0, p1)
        s0 += tl.where(mask, g * t, 0.0)
        s1 += g
    out = part_ptr + s.to(tl.int64) * (4 if ACT >= 0 else 2) * ROWS + row
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


def sums(x3, dy, m, v, coeffs, act=None):
    """The gradients of the coefficients: [sum_l g t, sum_l g] (and sum_l dy act(z), sum_l dy with an
    activation), each (N, C) in the coefficients' dtype; a merge launch only when rows are split."""
    n, c, length = x3.shape
    act_id, p0, p1 = _act(act)
    count = 2 if act_id < 0 else 4
    block, split, chunk = layout(x3)
    part = torch.empty(split, count, n * c, dtype=m.dtype, device=x3.device)
    a, b = coeffs[0], coeffs[1]
    k = coeffs[2] if act_id >= 0 else a
    _sums_kernel[(n * c, split)](x3, dy, part, m, v, a, b, k, n * c, length, chunk, *hi_lo(p0), *hi_lo(p1),
                                 ACT=act_id, BLOCK=block, ACC=acc_dtype(x3.dtype))
    if split > 1:
        out = torch.empty(count, n * c, dtype=m.dtype, device=x3.device)
        size = count * n * c
        _merge_kernel[(triton.cdiv(size, 1024), )](part, out, size, split, BLOCK=1024)
    else:
        out = part[0]
    return [t.view(n, c) for t in out.unbind(0)]


@triton.jit(do_not_specialize=['C', 'L', 'CHUNK'])
def _dx_kernel(x_ptr, dy_ptr, dx_ptr, m_ptr, v_ptr, a_ptr, b_ptr, k_ptr, dm_ptr, dv_ptr, gsum_ptr, mean_ptr,
               dmean_ptr, dvar_ptr, C, L, CHUNK, sc_h, sc_l, p0h, p0l, p1h, p1l, ACT: tl.constexpr, BATCH: tl.constexpr,
               BLOCK: tl.constexpr, ACC: tl.constexpr):
    """dx = A g + c1 t + c0 with c0 = (dm - A sum_l g) / L, c1 = 2 dv / L (0 where v = 0), g = dy (g = K dy
    act'(z) with an activation); BATCH: dm, dv first take the VJP of the batch statistics (mean, var over
    the samples, ``scale`` = 1 / N) for the per-channel gradients dmean, dvar."""
    row = tl.program_id(0)
    s = tl.program_id(1)
    start = s * CHUNK
    end = tl.minimum(start + CHUNK, L)
    Lf = L.to(ACC)
    scale = from_hi_lo(sc_h, sc_l, ACC)
    p0 = from_hi_lo(p0h, p0l, ACC)
    p1 = from_hi_lo(p1h, p1l, ACC)
    m = tl.load(m_ptr + row).to(ACC)
    live = tl.load(v_ptr + row) > 0
    a = tl.where(live, tl.load(a_ptr + row).to(ACC), 0.0)
    dm = tl.load(dm_ptr + row).to(ACC)
    dv = tl.load(dv_ptr + row).to(ACC)
    if BATCH:
        c = row % C
        dvar = tl.load(dvar_ptr + c).to(ACC)
        dm = dm + scale * tl.load(dmean_ptr + c).to(ACC) + 2.0 * scale * (m - tl.load(mean_ptr + c).to(ACC)) * dvar
        dv = dv + scale * dvar
    a_full = tl.load(a_ptr + row).to(ACC)
    c0 = (dm - a_full * tl.load(gsum_ptr + row).to(ACC)) / Lf
    c1 = tl.where(live, 2.0 * dv / Lf, 0.0)
    if ACT >= 0:
        b = tl.load(b_ptr + row).to(ACC)
        kk = tl.load(k_ptr + row).to(ACC)
        scale_g = a_full * kk
    offs = row.to(tl.int64) * L
    cols = tl.arange(0, BLOCK)
    for off in range(start, end, BLOCK):
        idx = off + cols
        mask, t, g = _t_and_dy(x_ptr, dy_ptr, offs, idx, end, m, ACC)
        if ACT >= 0:
            dx = scale_g * (g * act_grad(a * t + b, ACT, p0, p1)) + c1 * t + c0
        else:
            dx = a_full * g + c1 * t + c0
        tl.store(dx_ptr + offs + idx, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def dx(x3, dy, m, v, coeffs, dm, dv, gsum, act=None, batch=None):
    """dx (x3's shape and dtype) from the coefficients' VJP (dm, dv) and sum_l g (``gsum``); ``batch`` =
    (mean, dmean, dvar, 1 / N) adds the VJP of the (unsynchronized) batch statistics."""
    n, c, length = x3.shape
    act_id, p0, p1 = _act(act)
    out = torch.empty_like(x3)
    block, split, chunk = layout(x3)
    a, b = coeffs[0], coeffs[1]
    k = coeffs[2] if act_id >= 0 else a
    mean, dmean, dvar, scale = batch if batch is not None else (m, m, m, 0.0)
    _dx_kernel[(n * c, split)](x3, dy, out, m, v, a, b, k, dm, dv, gsum, mean, dmean, dvar, c, length, chunk,
                               *hi_lo(scale), *hi_lo(p0), *hi_lo(p1), ACT=act_id, BATCH=batch is not None,
                               BLOCK=block, ACC=acc_dtype(x3.dtype))
    return out
