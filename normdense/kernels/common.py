"""What the Triton kernels share: float arguments at float64 accuracy (a float travels as a float32 pair (hi, lo)
summed in the kernel's dtype: Triton passes a Python float as float32), the passes' tiles of the activation
(16-byte vectors: each bound is written ``(q // V) * V`` so that Triton proves it a multiple of V although the
sizes are ``do_not_specialize``), the block sizes of the channel-sized coefficient kernels (BCN, GN+PN,
Unitization) and the second stage: a VJP's per-sample-block partial sums, which dx adds in a fixed order
(:func:`finish`: deterministic, no atomics, no launch of its own) or torch does (:meth:`BlockSums.finish`).
"""
import functools
import struct

import torch
import triton
import triton.language as tl

from .backend import PendingSums

CHUNK = 256  # the default chunk (channels) of a group walked in chunks by the BCN and GN+PN kernels
VJP_PROGRAMS = 32  # a VJP looping over many samples spreads its groups over at least this many programs
PROGRAMS = 128  # ... and its samples over sample blocks until about this many programs (an H100 has 132 SMs)
MIN_SAMPLES = 16  # samples per tile of a VJP that sample blocks share
# columns per dx program finishing the partials (a constexpr: jit code may read no other global)
FINISH_BLOCK = tl.constexpr(512)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv is a constexpr_function in triton 3.7: ~8 Python calls a call on the host


def next_pow2(n: int) -> int:
    """The smallest power of 2 >= n (n >= 1), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def acc_dtype(dtype: torch.dtype):
    """The kernels' accumulation dtype: float64 for float64 inputs, else float32."""
    return tl.float64 if dtype == torch.float64 else tl.float32


# --- float arguments -------------------------------------------------------------------------------------------
def _f32(value: float) -> float:
    return struct.unpack('f', struct.pack('f', value))[0]  # on the host: no tensor, no operator


@functools.lru_cache(maxsize=1024)
def hi_lo(value: float):
    """``value`` as the float32 pair (hi, lo) for :func:`from_hi_lo`."""
    hi = _f32(value)
    return hi, _f32(value - hi)


@triton.jit
def from_hi_lo(hi, lo, dt: tl.constexpr):
    return tl.cast(hi, dt) + tl.cast(lo, dt)  # floats reach the interpreter as Python floats: no .to()


@triton.jit
def rsqrt(x):
    """1 / sqrt(x): correctly rounded in float64 (``tl.rsqrt`` is approximate there), ``tl.rsqrt`` in float32."""
    if x.dtype == tl.float64:
        out = 1.0 / tl.sqrt(x)
    else:
        out = tl.rsqrt(x)
    return out


# --- partial sums --------------------------------------------------------------------------------------------
@triton.jit
def split_sum(ptr, off, mask, SPLIT, STRIDE, dt: tl.constexpr):
    """sum over s < SPLIT of ptr[s * STRIDE + off] (any tile shape), in order: partial sums merged by the
    kernel that reads them (the order and dtype of the merge kernel it replaces)."""
    out = tl.load(ptr + off, mask=mask, other=0.0).to(dt)
    for s in range(1, SPLIT):
        out += tl.load(ptr + s * STRIDE + off, mask=mask, other=0.0).to(dt)
    return out


def grad_buffer(grads):
    """(buffer, SPLIT, STRIDE, K) of the coefficient gradients as the layers' VJP kernels read them: gradient k
    at buffer + k K, its SPLIT chunk partials STRIDE apart, each (N, C) contiguous. The sums kernel's own
    (SPLIT, count, N, C) partials come as they are (no view per gradient); separate (N, C) or (SPLIT, N, C)
    tensors are stacked into one such buffer."""
    if isinstance(grads, torch.Tensor):
        return grads, grads.shape[0], grads.stride(0), grads.stride(1)
    g = torch.stack([t if t.dim() == 3 else t.unsqueeze(0) for t in grads], 1)
    return g, g.shape[0], g.stride(0), g.stride(1)


def stacked(arrays) -> torch.Tensor:
    """Several (N, C) per-(n, c) arrays as the engine's Triton passes take them: one contiguous (count, N, C)
    tensor, whose rows a kept launch passes by address (one tensor object, not one per row; ``launch.Launcher``).
    A kernel map's coefficients and a kernel VJP's dm, dv come so; a sequence of tensors is stacked."""
    if isinstance(arrays, torch.Tensor):
        return arrays.contiguous()
    return torch.stack([t.reshape(arrays[0].shape) for t in arrays])


# --- the passes' tiles of the activation -----------------------------------------------------------------------
def vector_width(*tensors) -> int:
    """V (elements) of the narrowest dtype among ``tensors``: V lanes of it are 16 bytes, and V lanes of a
    wider one are a whole number of 16-byte vectors from the same (V-aligned) offset."""
    return 16 // min(t.element_size() for t in tensors)


def cl_blocks(c: int, dtype_size: int):
    """(BLOCK_C, BLOCK_L) of a CL tile of ~1024 elements (512 in float64), at most 64 channels."""
    block_c = min(next_pow2(max(c, 1)), 64)
    return block_c, max(1, (512 if dtype_size == 8 else 1024) // block_c)


@triton.jit
def ncl_span(row, s, L, CHUNK, V: tl.constexpr):
    """A reduction program's part of row ``row`` (NCL): its elements [lo, hi) = positions [s CHUNK,
    min((s + 1) CHUNK, L)) of the row, its tiles from a0 = lo rounded down to a vector, loads masked
    ``< bound`` (hi rounded up). The few elements of the neighbouring rows read that way (< 2 V per row)
    are zeroed after the load. Needs the flat size a multiple of V (else V = 1)."""
    r0 = row.to(tl.int64) * L
    first = s.to(tl.int64) * CHUNK
    lo = r0 + first
    hi = r0 + tl.minimum(first + CHUNK, L)
    a0 = (lo // V) * V
    bound = ((hi + V - 1) // V) * V
    return lo, hi, a0, bound


@triton.jit
def ncl_vectors(row, s, L, CHUNK, V: tl.constexpr):
    """An elementwise program's part of the flat array (NCL), partitioned by whole vectors: row r owns those
    starting in [ceil_V(r L), ceil_V((r + 1) L)), split s the ones from s CHUNK on (the last split to the
    end). Returns (r1, cs, ce): the row's end r1 (elements >= r1 belong to the next row: L >= V), the
    program's [cs, ce)."""
    r0 = row.to(tl.int64) * L
    r1 = r0 + L
    e0 = ((r0 + V - 1) // V) * V
    e1 = ((r1 + V - 1) // V) * V
    cs = ((e0 + s.to(tl.int64) * CHUNK) // V) * V  # CHUNK is a multiple of BLOCK: cs stays aligned
    ce = tl.where(s == tl.num_programs(1) - 1, e1, tl.minimum(cs + CHUNK, e1))
    return r1, cs, (ce // V) * V


@triton.jit
def cl_channels(pid, C, BLOCK_C: tl.constexpr, V: tl.constexpr):
    """A CL program's sample n and channels ch (a block of BLOCK_C), their mask, and CV = C written as a
    provable multiple of V (C is one when V > 1)."""
    CV = (C // V) * V
    blocks = tl.cdiv(C, BLOCK_C)
    n = pid // blocks
    ch = (pid % blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    return n, ch, ch < CV, CV


@triton.jit
def cl_tile(n, ch, cm, CV, L, off, end, BLOCK_L: tl.constexpr):
    """Offsets (BLOCK_L, BLOCK_C) of positions off + [0, BLOCK_L) of channels ch of sample n (CL), and their
    mask (position < end, channel < C)."""
    pos = off + tl.arange(0, BLOCK_L)
    offs = n.to(tl.int64) * CV * L + pos[:, None].to(tl.int64) * CV + ch[None, :]
    return offs, (pos < end)[:, None] & cm[None, :]


# --- block sizes of the coefficient kernels --------------------------------------------------------------------
def group_tiles(n: int, groups: int, per: int, channels: int, tile: int, chunk: int, vjp: bool):
    """(CHUNKED, BLOCK_N, BLOCK_G, BLOCK_P) of [BLOCK_N, BLOCK_G, BLOCK_P] tiles of (sample, group, channel in
    group) of ``groups`` groups of ``per`` channels: whole groups, up to ``channels`` channels and ``tile``
    elements, or (CHUNKED) one group walked in chunks of ``chunk`` channels; a VJP's spread (:func:`spread`)."""
    bp = next_pow2(per)
    chunked = bp > chunk
    if chunked:
        bp, bg = chunk, 1
    else:
        bg = max(1, min(next_pow2(groups), channels // bp))
    bn = min(next_pow2(n), max(1, tile // (bg * bp)))
    if vjp and not chunked:
        bn, bg = spread(n, groups, bn, bg, bp, tile)
    return chunked, bn, bg, bp


def spread(n: int, groups: int, block_n: int, block_g: int, block_p: int, tile: int):
    """(BLOCK_N, BLOCK_G) of a VJP whose samples take several iterations: fewer groups per program, so at least
    min(groups, VJP_PROGRAMS) programs share the work, and tiles of fewer samples (at least MIN_SAMPLES)
    where the group programs alone are fewer than PROGRAMS, so that sample blocks make up the rest.
    Detection's N = 1-2 is unchanged."""
    if cdiv(n, block_n) <= 1:
        return block_n, block_g
    cap = 1 << max(0, (groups // VJP_PROGRAMS).bit_length() - 1)  # the largest power of 2 <= groups / VJP_PROGRAMS
    block_g = max(1, min(block_g, cap))
    block_n = min(next_pow2(n), max(1, tile // (block_g * block_p)))
    want = cdiv(PROGRAMS, cdiv(groups, block_g))  # sample blocks wanted
    if want > 1 and n // want > 0:
        block_n = min(block_n, max(MIN_SAMPLES, 1 << ((n // want).bit_length() - 1)))
    elif want > 1:
        block_n = min(block_n, MIN_SAMPLES)
    return block_n, block_g


def sample_blocks(n: int, block_n: int, programs: int):
    """(SB, n_per): the sample blocks of a VJP whose other grid axes have ``programs`` programs (about PROGRAMS
    in all), and samples per block (a multiple of block_n): a grid size and a runtime integer."""
    iters = cdiv(n, block_n)
    sb = max(1, min(iters, cdiv(PROGRAMS, max(1, programs))))
    n_per = cdiv(iters, sb) * block_n
    return cdiv(n, n_per), n_per


# --- the second stage ------------------------------------------------------------------------------------------
class BlockSums(PendingSums):
    """Where a VJP kernel writes its per-channel sums: the final gradients (SB = 1), or the partials (SB, width)
    of its sample blocks with the final parameter gradients' storage (``out``) that :func:`finish` fills.

    ``params``: the parameters (None where a gradient is not wanted), whose gradients come in their dtypes;
    ``stats``: whether dmean, dvar (C,) are written too (batch statistics); ``m`` (N, C) gives the compute
    dtype and device."""

    def __init__(self, blocks: int, m: torch.Tensor, params, stats: bool):
        c = m.shape[1]
        self.blocks, self.done = blocks, blocks == 1
        if blocks == 1:  # final values, written in the parameters' dtypes by the kernel: no cast launch
            self.params = [None if p is None else torch.empty_like(p) for p in params]
            self.stats = (m.new_empty(c), m.new_empty(c)) if stats else (None, None)
            self.stride = 0
            self.part = self.out = None
            slots = self.params + list(self.stats)
        else:  # partials in the compute dtype; the sums in the parameters' dtype (one if they share it)
            live = [p for p in params if p is not None]
            sizes = [0 if p is None else p.numel() for p in params]
            self.size = sum(sizes)  # the parameter gradients' columns, then dmean's and dvar's
            self.width = self.size + (2 * c if stats else 0)
            dtypes = {p.dtype for p in live}
            self.part = m.new_empty(blocks, self.width)
            self.out = torch.empty(self.size, dtype=dtypes.pop() if len(dtypes) == 1 else m.dtype, device=m.device)
            self.stride = self.width
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            self.params = [None if p is None else self.out[o:o + p.numel()].view(p.shape)
                           for p, o in zip(params, offsets)]
            slots = [None if p is None else self.part[0, o:o + p.numel()] for p, o in zip(params, offsets)]
            self.stats = tuple(self.part[:, self.size + i * c:self.size + (i + 1) * c] for i in range(2)) \
                if stats else (None, None)
            slots += [None if s is None else s[0] for s in self.stats]
        spare = m
        for s in slots:  # a loop, not next(generator): every backward passes here
            if s is not None:
                spare = s
                break
        self.slots = [spare if s is None else s for s in slots]  # a kernel argument for each (unused if absent)

    def result(self, defer: bool):
        """(dmean, dvar, dparams) for the VJP's caller: final values (summed here in torch unless SB = 1), or with
        ``defer`` the (SB, C) partials of dmean, dvar and this object in place of dparams, for dx to finish."""
        if defer and not self.done:
            return self.stats[0], self.stats[1], self
        dmean, dvar = self.finish()
        return dmean, dvar, tuple(self.params)

    def finish(self):
        """Sum the partials in torch (no dx to do it); (dmean, dvar), summed."""
        if not self.done:
            self.out.copy_(self.part[:, :self.size].sum(0))
            self.stats = tuple(None if s is None else s.sum(0) for s in self.stats)
            self.done = True
        return self.stats

    def dx_args(self, programs: int, finish_block: int = FINISH_BLOCK.value):
        """(part, out, columns, SB, row stride) of :func:`finish` for a dx launch of ``programs`` programs, which
        then holds the sums (columns 0: nothing left to sum). Programs too few to take ``finish_block``
        columns each: torch sums them here first."""
        if not self.done and self.size > programs * finish_block:
            self.finish()
        if self.done:
            return self.slots[0], self.slots[0], 0, 1, 0
        self.done = True  # summed by the dx launch these arguments go to
        return self.part, self.out, self.size, self.blocks, self.stride


@triton.jit
def finish(src_ptr, dst_ptr, P, SB, STRIDE, pid, BLOCK: tl.constexpr):
    """dst[j] = sum over b < SB of src[b * STRIDE + j], in block order, for the BLOCK columns j < P of program
    pid: the second stage, in dx's launch (whose programs cover P: ``BlockSums.dx_args``)."""
    j = pid * BLOCK + tl.arange(0, BLOCK)
    mask = j < P
    tl.store(dst_ptr + j, split_sum(src_ptr, j, mask, SB, STRIDE, src_ptr.dtype.element_ty), mask=mask)
