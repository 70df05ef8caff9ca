"""Where each program of the passes (``passes.py``) reads and writes, so that Triton can prove 16-byte
vector access of the activation (``ld.global.v4.b32``, ``v2.b64``) on the GPU.

Triton vectorizes a load or store only when its axis analysis proves (a) the element offset a multiple of the
vector, V = 16 bytes / element size (with the pointer 16-byte aligned, which the launcher marks for torch's
allocations), contiguous over V lanes, and (b) the mask constant over V consecutive lanes: for ``idx < bound``
that takes ``bound`` a provable multiple of V. The sizes (L, C, CHUNK) are ``do_not_specialize`` (no compile
per image size), so nothing about them is known at compile time: each bound below is written ``(q // V) * V``,
which the analysis reads as a multiple of V (q is a multiple already, or is rounded on purpose).

Layouts of x3 (N, C, L): NCL (contiguous, row r = n C + c is [r L, (r + 1) L) of the flat array) and CL
(channels_last viewed as (N, C, HW): strides (C L, 1, C), a tile is [BLOCK_L positions, BLOCK_C channels],
contiguous along C; vector when C is a multiple of V).
"""
import triton
import triton.language as tl


def vector_width(*tensors) -> int:
    """V (elements) of the narrowest dtype among ``tensors``: V lanes of it are 16 bytes, and V lanes of a
    wider one are a whole number of 16-byte vectors from the same (V-aligned) offset."""
    return 16 // min(t.element_size() for t in tensors)


@triton.jit
def ncl_span(row, s, L, CHUNK, V: tl.constexpr):
    """A reduction program's part of row ``row`` (NCL): its elements [lo, hi) = positions [s CHUNK,
    min((s + 1) CHUNK, L)) of the row (the counts the stats kernel merges by), its tiles from a0 = lo rounded
    down to a vector, loads masked ``< bound`` (hi rounded up): the aligned vectors covering [lo, hi). The
    few elements of the neighbouring rows read that way (< 2 V per row) are zeroed after the load. Needs the
    flat size a multiple of V (else V = 1)."""
    r0 = row.to(tl.int64) * L
    first = s.to(tl.int64) * CHUNK
    lo = r0 + first
    hi = r0 + tl.minimum(first + CHUNK, L)
    a0 = (lo // V) * V
    bound = ((hi + V - 1) // V) * V
    return lo, hi, a0, bound


@triton.jit
def ncl_vectors(row, s, L, CHUNK, V: tl.constexpr):
    """An elementwise program's part of the flat array (NCL): a store covers whole vectors, so the array is
    partitioned by vectors: row r owns those starting in [ceil_V(r L), ceil_V((r + 1) L)), split s the ones
    from s CHUNK on (the last split to the end: the row's vectors may span up to V - 1 more than L). Returns
    (r1, cs, ce): the row's end r1 (elements >= r1 belong to the next row: L >= V), the program's [cs, ce)."""
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
    provable multiple of V (C is one when V > 1): row offsets l CV and sample offsets n CV L stay aligned."""
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


def cl_blocks(c: int, dtype_size: int):
    """(BLOCK_C, BLOCK_L) of a CL tile of ~1024 elements (512 in float64): BLOCK_C channels (a warp reads
    64 channels' contiguous 128 to 512 bytes per position)."""
    block_c = min(triton.next_power_of_2(max(c, 1)), 64)
    return block_c, max(1, (512 if dtype_size == 8 else 1024) // block_c)
