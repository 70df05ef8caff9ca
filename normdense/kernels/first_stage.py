"""The StatNorm engine's first stage in Triton: the chunks' moments merged into the per-(n, c) m, v and, by mode,
the per-channel statistics (C,) the coefficient maps take: device functions that a layer's coefficient kernel
runs in its own launch (:func:`fold`), and the standalone stats kernel (``sync_stats``: torch reads m, v first).

Modes (``backend.STATS_*``): NONE: m, v only (GN+PN); FIXED: mean, var copied from stat_mean / stat_var (eval);
ESTIMATE: Algorithm 1 steps 1-4 of arXiv:1903.10520 from the estimates at the iteration's start (stat_* when
WRITE, which also copies them to base; else base): the batch mean and second moment around the estimate
(moved, (2, C)) and the estimates moved by ``rate`` towards them; BATCH: the batch mean and biased variance
(two passes: the law of total variance, centred), tracked with the unbiased variance (``momentum`` or the
cumulative 1 / (tracked + 1)). WRITE: the new running values (upd, (2, C)), which the apply kernel, the
forward's last, copies into the buffers: a kernel failing to compile leaves the module's state as it was.
mean, var and upd are the rows of one (4, C) buffer ``chan`` (mean, var, upd): one tensor object a call, whose
rows the kept launches of the map and apply kernels take by address (``FirstStage``).
Samples are taken in [BLOCK_N, BLOCK_C] tiles; block sizes are keyed on C only: a batch size never recompiles.
"""
import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .backend import STATS_BATCH, STATS_ESTIMATE, STATS_NONE
from .common import cdiv, from_hi_lo, hi_lo, next_pow2
from .launch import launcher


@triton.jit
def row_moments(part_ptr, rows, mask, ROWS, L, CHUNK, SPLIT, ACC: tl.constexpr):
    """(mean, centred sum of squares) of the rows ``rows`` (any tile shape) from the chunks' partials (SPLIT, 2,
    ROWS), merged in chunk order with Chan et al.'s update (deterministic; no E[x^2] - E[x]^2)."""
    # every row has the same chunk sizes: the weights are scalars (no float64 division per element)
    cnt = tl.zeros([], ACC)
    mean = tl.zeros(rows.shape, ACC)
    m2 = tl.zeros(rows.shape, ACC)
    for s in range(0, SPLIT):
        nb = tl.minimum(L - s * CHUNK, CHUNK).to(ACC)
        pm = tl.load(part_ptr + s * 2 * ROWS + rows, mask=mask, other=0.0).to(ACC)
        pm2 = tl.load(part_ptr + (s * 2 + 1) * ROWS + rows, mask=mask, other=0.0).to(ACC)
        tot = cnt + nb
        delta = pm - mean
        mean = mean + delta * (nb / tot)
        m2 = m2 + pm2 + delta * delta * (cnt * nb / tot)
        cnt = tot
    return mean, m2


@triton.jit
def channel_stats(F, N, C, L, CHUNK, SPLIT, WRITE, ch, cm, N_LO, N_HI, OWNER, MODE: tl.constexpr,
                  CUMULATIVE: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr):
    """(mean, var) of the channels ``ch`` (a 1-D tile, ``cm`` its mask) by MODE, in ACC; writes m, v (N, C) of
    these channels for the samples [N_LO, N_HI), and mean, var. Where OWNER is nonzero (one program per
    channel), also moved, upd and base, as the module docstring says. F: ``FirstStage.pointers``."""
    part_ptr, m_ptr, v_ptr, chan_ptr, stat_mean_ptr, stat_var_ptr, base_ptr, moved_ptr, nbt_ptr, \
        rate_hi, rate_lo, mom_hi, mom_lo = F
    # chan (4, C): mean, var, upd (2 rows); each row's offset added to the channels' (no pointer kept per row: a
    # register each, the fp64 map kernels' folds are at the cap)
    rate = from_hi_lo(rate_hi, rate_lo, ACC)
    momentum = from_hi_lo(mom_hi, mom_lo, ACC)
    ROWS = N * C
    Lf = L.to(ACC)
    inv_l = 1.0 / Lf  # scalars: multiplications per element, no float64 division calls
    inv_n = 1.0 / N.to(ACC)
    nn0 = tl.arange(0, BLOCK_N)
    bm = tl.zeros(ch.shape, ACC)  # ESTIMATE: the iteration's starting estimates
    bv = tl.zeros(ch.shape, ACC)
    if MODE == 2:
        if WRITE != 0:
            bm = tl.load(stat_mean_ptr + ch, mask=cm, other=0.0).to(ACC)
            bv = tl.load(stat_var_ptr + ch, mask=cm, other=0.0).to(ACC)
        else:
            bm = tl.load(base_ptr + ch, mask=cm, other=0.0).to(ACC)
            bv = tl.load(base_ptr + C + ch, mask=cm, other=0.0).to(ACC)
    s1 = tl.zeros(ch.shape, ACC)
    s2 = tl.zeros(ch.shape, ACC)
    lo = N_LO
    hi = N_HI
    if MODE >= 2:  # statistics over every sample
        lo = 0
        hi = N
    for n0 in range(lo, hi, BLOCK_N):
        nn = n0 + nn0
        rows = nn[:, None] * C + ch[None, :]
        mask = (nn < hi)[:, None] & cm[None, :]
        mean, m2 = row_moments(part_ptr, rows, mask, ROWS, L, CHUNK, SPLIT, ACC)
        var = m2 * inv_l
        mine = mask & ((nn >= N_LO) & (nn < N_HI))[:, None]
        tl.store(m_ptr + rows, mean, mask=mine)
        tl.store(v_ptr + rows, var, mask=mine)
        if MODE == 2:  # sums of m and of v + (m - estimate)^2
            d = mean - bm[None, :]
            s1 += tl.sum(tl.where(mask, mean, 0.0), axis=0)
            s2 += tl.sum(tl.where(mask, var + d * d, 0.0), axis=0)
        if MODE == 3:
            s1 += tl.sum(tl.where(mask, mean, 0.0), axis=0)
    out_mean = tl.zeros(ch.shape, ACC)
    out_var = tl.zeros(ch.shape, ACC)
    if MODE == 1:
        out_mean = tl.load(stat_mean_ptr + ch, mask=cm, other=0.0).to(ACC)
        out_var = tl.load(stat_var_ptr + ch, mask=cm, other=0.0).to(ACC)
    if MODE == 2:
        bmean = s1 * inv_n
        bm2 = s2 * inv_n
        out_mean = bm + rate * (bmean - bm)
        out_var = bv + rate * (bm2 - bv)
        if OWNER != 0:
            tl.store(moved_ptr + ch, bmean, mask=cm)
            tl.store(moved_ptr + C + ch, bm2, mask=cm)
            if WRITE != 0:
                tl.store(base_ptr + ch, bm, mask=cm)
                tl.store(base_ptr + C + ch, bv, mask=cm)
                tl.store(chan_ptr + (ch + 2 * C), out_mean, mask=cm)
                tl.store(chan_ptr + (ch + 3 * C), out_var, mask=cm)
    if MODE == 3:
        out_mean = s1 * inv_n
        for n0 in range(0, N, BLOCK_N):  # second pass: centred on the batch mean
            nn = n0 + nn0
            rows = nn[:, None] * C + ch[None, :]
            mask = (nn < N)[:, None] & cm[None, :]
            mean, m2 = row_moments(part_ptr, rows, mask, ROWS, L, CHUNK, SPLIT, ACC)
            d = mean - out_mean[None, :]
            s2 += tl.sum(tl.where(mask, m2 * inv_l + d * d, 0.0), axis=0)
        out_var = s2 * inv_n
        if OWNER != 0:
            if WRITE != 0:
                rm = tl.load(stat_mean_ptr + ch, mask=cm, other=0.0).to(ACC)
                rv = tl.load(stat_var_ptr + ch, mask=cm, other=0.0).to(ACC)
                k = N.to(ACC) * Lf
                unbiased = out_var * (k / (k - 1.0))
                if CUMULATIVE:  # the weight 1 / (tracked + 1), as torch's lerp with it
                    w = 1.0 / (tl.load(nbt_ptr) + 1).to(ACC)
                    tl.store(chan_ptr + (ch + 2 * C), rm + (out_mean - rm) * w, mask=cm)
                    tl.store(chan_ptr + (ch + 3 * C), rv + (unbiased - rv) * w, mask=cm)
                else:
                    tl.store(chan_ptr + (ch + 2 * C), rm + momentum * (out_mean - rm), mask=cm)
                    tl.store(chan_ptr + (ch + 3 * C), rv + momentum * (unbiased - rv), mask=cm)
    if MODE != 0:
        tl.store(chan_ptr + ch, out_mean, mask=cm)
        tl.store(chan_ptr + (ch + C), out_var, mask=cm)
    return out_mean, out_var


@triton.jit(noinline=True)
def fold(F, N, C, L, CHUNK, SPLIT, WRITE, C_LO, C_HI, N_LO, N_HI, OWNER, MODE: tl.constexpr,
         CUMULATIVE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    """The first stage inside a coefficient kernel's program, before its map: for the channels [C_LO, C_HI) it
    will read, m, v of its samples [N_LO, N_HI) and the per-channel mean, var are written where the map's
    own loads find them, then a barrier makes them visible to every thread of the program. Programs sharing
    channels (other sample blocks) write the same mean, var: the same bits, computed the same way from the
    same partials; moved, upd and base are written by the OWNER program only."""
    for c0 in range(C_LO, C_HI, BLOCK_C):
        ch = c0 + tl.arange(0, BLOCK_C)
        channel_stats(F, N, C, L, CHUNK, SPLIT, WRITE, ch, ch < C_HI, N_LO, N_HI, OWNER, MODE, CUMULATIVE, BLOCK_N,
                      ACC)
    tl.debug_barrier()


@triton.jit(do_not_specialize=['N', 'C', 'L', 'CHUNK', 'SPLIT', 'WRITE'])
def _stats_kernel(F, N, C, L, CHUNK, SPLIT, WRITE, MODE: tl.constexpr, CUMULATIVE: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    """The first stage alone, one program per block of channels."""
    ch = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_stats(F, N, C, L, CHUNK, SPLIT, WRITE, ch, ch < C, 0, N, 1, MODE, CUMULATIVE, BLOCK_N, ACC)


@functools.lru_cache(maxsize=256)
def stat_blocks(c: int, dtype=torch.float32):
    """(BLOCK_N, BLOCK_C) of the first stage's tiles: keyed on C and the compute dtype only, <= 512 elements
    (128 in float64: no spills in the map kernels)."""
    block_c = min(next_pow2(max(c, 1)), 128)
    return max(1, (128 if dtype == torch.float64 else 512) // block_c), block_c


class StageTensors(NamedTuple):
    """A first stage's results as tensors (:attr:`FirstStage.outputs`): m, v (N, C); mean, var (C,), moved (2, C),
    update (2, C: the buffers' new values) or None where the mode has none."""
    m: torch.Tensor
    v: torch.Tensor
    mean: Optional[torch.Tensor]
    var: Optional[torch.Tensor]
    moved: Optional[torch.Tensor]
    update: Optional[torch.Tensor]


class FirstStage:
    """One call's first stage, prepared: its outputs allocated and its launch arguments ready, either for the
    standalone kernel (:meth:`launch`) or for a coefficient kernel that runs :func:`fold` itself
    (:func:`fold_args`). ``m``, ``v`` (N, C), ``moved`` (2, C, ESTIMATE) are tensors; ``mean``, ``var`` and
    ``update`` are the integer addresses of the rows of ``chan`` (4, C) (None where the mode has none), which a
    kept launch passes as they are (``launch.Launcher``); ``outputs``: all six as tensors, as :func:`stats`
    returns them (views of ``chan``: a normal launch's arguments, torch code). ``args``: the tuple F of pointers
    and float pairs that :func:`channel_stats` unpacks; ``sizes``: (L, CHUNK, SPLIT, WRITE), integers kept out of
    the tuple (Triton specializes a tuple's integers, do_not_specialize or not)."""

    __slots__ = ('m', 'v', 'chan', 'moved', 'mean', 'var', 'update', 'fold', 'key', 'mode', 'momentum', 'shape',
                 'geometry')

    def __init__(self, part, split, chunk, shape, mode=STATS_NONE, stat_mean=None, stat_var=None, base=None,
                 rate=0.0, momentum=0.1, write=False, nbt=None, key=None):
        n, c, length = shape
        # integer sizes: a tuple costs the host twice as much
        m = self.m = part.new_empty(n, c)
        self.v = part.new_empty(n, c)
        chan = moved = self.mean = self.var = self.update = None
        if mode != STATS_NONE:  # mean, var, upd: one tensor object, its rows by address
            chan = part.new_empty(4, c)
            p, step = chan.data_ptr(), c * chan.itemsize
            self.mean, self.var = p, p + step
            if write:
                self.update = p + 2 * step
        if mode == STATS_ESTIMATE:
            moved = part.new_empty(2, c)
        self.chan, self.moved = chan, moved
        self.mode, self.momentum, self.shape = mode, momentum, shape
        f = m  # the unused pointers' stand-in (no generator: this runs on every training call)
        args = (part, m, self.v, f if chan is None else chan, f if stat_mean is None else stat_mean,
                f if stat_var is None else stat_var, f if base is None else base, f if moved is None else moved,
                f if nbt is None else nbt, *hi_lo(rate), *hi_lo(0.0 if momentum is None else momentum))
        # a map kernel's runtime fold arguments (F, fL, fCHUNK, fSPLIT, fWRITE): the only tuple built per call
        self.fold = (args, length, chunk, split, 1 if write else 0)
        self.key = key  # the call's launch-cache key, for the map kernel that runs this stage
        self.geometry = None  # a backend's launch geometry over x, if it keeps one here

    # what the launches read on a miss or in the standalone kernel only: derived, not stored per call
    @property
    def args(self) -> tuple:
        args, _length, _chunk, _split, _write = self.fold
        return args

    @property
    def sizes(self) -> tuple:
        _args, length, chunk, split, write = self.fold
        return length, chunk, split, write

    dtype = property(lambda self: self.m.dtype)  # the partials' dtype

    @property
    def outputs(self) -> StageTensors:
        """The results as tensors, mean, var and update views of ``chan`` (None where absent)."""
        chan = self.chan
        if chan is None:
            return StageTensors(self.m, self.v, None, None, self.moved, None)
        return StageTensors(self.m, self.v, chan[0], chan[1], self.moved, None if self.update is None else chan[2:])
    cumulative = property(lambda self: self.mode == STATS_BATCH and self.momentum is None)
    acc = property(lambda self: tl.float64 if self.dtype == torch.float64 else tl.float32)

    def launch(self):
        """The standalone stats kernel: one program per block of channels."""
        n, c, _ = self.shape
        block_n, block_c = stat_blocks(c, self.dtype)
        _STATS((cdiv(c, block_c), 1, 1), (self.args, n, c, *self.sizes),
               dict(MODE=self.mode, CUMULATIVE=self.cumulative, BLOCK_N=block_n, BLOCK_C=block_c, ACC=self.acc),
               self.key)  # the call's key: kept (torch maps or all-reduces read the statistics first)
        return self.outputs


_STATS = launcher(_stats_kernel)
FOLD_SIZES = ['fL', 'fCHUNK', 'fSPLIT', 'fWRITE']  # a map kernel's fold parameters after F: do_not_specialize


def fold_consts(first) -> dict:
    """The constexprs of a coefficient kernel's fold: ``first`` (a :class:`FirstStage`) folded in."""
    block_n, block_c = stat_blocks(first.shape[1], first.dtype)
    return dict(FOLD=True, FMODE=first.mode, FCUM=first.cumulative, FBLOCK_N=block_n, FBLOCK_C=block_c)


def fold_args(first, like):
    """(runtime arguments F, fL, fCHUNK, fSPLIT, fWRITE; constexprs) of a coefficient kernel's fold: ``first``
    (a :class:`FirstStage`) folded in, or with ``first`` None placeholders (``like``: any tensor) and FOLD off."""
    if first is None:
        return ((like, ) * 9 + (0.0, ) * 4, 1, 1, 1, 0), \
            dict(FOLD=False, FMODE=STATS_NONE, FCUM=False, FBLOCK_N=1, FBLOCK_C=1)
    block_n, block_c = stat_blocks(first.shape[1], first.dtype)
    return (first.args, ) + first.sizes, dict(FOLD=True, FMODE=first.mode, FCUM=first.cumulative,
                                             FBLOCK_N=block_n, FBLOCK_C=block_c)


def stats(part, split, chunk, shape, mode=STATS_NONE, stat_mean=None, stat_var=None, base=None, rate=0.0,
          momentum=0.1, write=False, nbt=None):
    """Merge the moment partials of x (N, C, L) = ``shape``: returns (m, v, mean, var, moved, upd) with m, v
    (N, C) and, by ``mode`` (the module docstring), mean, var (C,), for STATS_ESTIMATE ``moved`` (2, C): the
    batch mean and second moment around the estimates, and with ``write`` ``upd`` (2, C): the new values of
    (stat_mean, stat_var) for the apply kernel to write. ``base`` (2, C): the iteration's starting estimates
    (written when ``write``, else read). STATS_BATCH with ``momentum`` None needs ``nbt``."""
    return FirstStage(part, split, chunk, shape, mode=mode, stat_mean=stat_mean, stat_var=stat_var, base=base,
                      rate=rate, momentum=momentum, write=write, nbt=nbt).launch()
