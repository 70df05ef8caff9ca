"""Block-size rules the channel-sized coefficient kernels share (BCN's, GN+PN's and Unitization's)."""
import triton

VJP_PROGRAMS = 32  # a VJP looping over many samples spreads its groups over at least this many programs
PROGRAMS = 128  # ... and its samples over sample blocks until about this many programs (an H100 has 132 SMs)
MIN_SAMPLES = 16  # samples per tile of a VJP that sample blocks share


def spread(n: int, groups: int, block_n: int, block_g: int, block_p: int, tile: int):
    """(BLOCK_N, BLOCK_G) of a VJP whose samples take several iterations (classification batch sizes): fewer
    groups per program, so at least min(groups, VJP_PROGRAMS) programs share the work, and tiles of fewer
    samples (at least MIN_SAMPLES) where the group programs alone are fewer than PROGRAMS, so that sample
    blocks (``sample_blocks``) make up the rest. Detection's N = 1-2 is unchanged."""
    if triton.cdiv(n, block_n) <= 1:
        return block_n, block_g
    cap = 1 << max(0, (groups // VJP_PROGRAMS).bit_length() - 1)  # the largest power of 2 <= groups / VJP_PROGRAMS
    block_g = max(1, min(block_g, cap))
    block_n = min(triton.next_power_of_2(n), max(1, tile // (block_g * block_p)))
    want = triton.cdiv(PROGRAMS, triton.cdiv(groups, block_g))  # sample blocks wanted
    if want > 1 and n // want > 0:
        block_n = min(block_n, max(MIN_SAMPLES, 1 << ((n // want).bit_length() - 1)))
    elif want > 1:
        block_n = min(block_n, MIN_SAMPLES)
    return block_n, block_g


def sample_blocks(n: int, block_n: int, programs: int):
    """(SB, n_per): the sample blocks of a VJP whose other grid axes have ``programs`` programs (about PROGRAMS
    in all), and samples per block (a multiple of block_n). A grid size and a runtime integer: no new variant
    per batch size."""
    iters = triton.cdiv(n, block_n)
    sb = max(1, min(iters, triton.cdiv(PROGRAMS, max(1, programs))))
    n_per = triton.cdiv(iters, sb) * block_n
    return triton.cdiv(n, n_per), n_per
