"""Block-size rules the channel-sized coefficient kernels share (BCN's and GN+PN's)."""
import triton

VJP_PROGRAMS = 32  # a VJP looping over many samples spreads its groups over at least this many programs


def spread(n: int, groups: int, block_n: int, block_g: int, block_p: int, tile: int):
    """(BLOCK_N, BLOCK_G) of a VJP whose samples take several iterations (classification batch sizes): fewer
    groups per program, so at least min(groups, VJP_PROGRAMS) programs share the work and each takes more
    samples per iteration (the same tile size: no new register pressure). Detection's N = 1-2 is unchanged."""
    if triton.cdiv(n, block_n) <= 1:
        return block_n, block_g
    cap = 1 << max(0, (groups // VJP_PROGRAMS).bit_length() - 1)  # the largest power of 2 <= groups / VJP_PROGRAMS
    block_g = max(1, min(block_g, cap))
    return min(triton.next_power_of_2(n), max(1, tile // (block_g * block_p))), block_g
