"""The Triton passes launched on their own, as the pass tests and the vectorization probe call them: thin
wrappers over the engine's launch functions (``normdense/kernels/triton.py``), which take x3 in its read layout,
the coefficients stacked (``common.stacked``) and the activation in kernel-argument form."""
from normdense.kernels import triton as T
from normdense.kernels.common import FINISH_BLOCK, stacked


def launch_config(x3, *others, split=None) -> dict:
    """The launch geometry of a pass over x3 with the activation tensors ``others`` (dy, y): dict(grid, CHUNK
    and the constexprs BLOCK, BLOCK_C, V, CL, SMALL); ``split``: as ``triton.split_for``."""
    x3, cl = T.read_layout(x3)
    g = T._geom(x3, cl, min((x3, ) + others, key=lambda t: t.dtype.itemsize), split)
    return dict(grid=g.grid[:2], CHUNK=g.chunk, BLOCK=g.block, BLOCK_C=g.block_c, V=g.v, CL=g.cl, SMALL=g.small)


def moment_partials(x3, split=None, key=None):
    """(partials (SPLIT, 2, N*C): each chunk's mean and centred sum of squares; SPLIT; CHUNK) of x3 (N, C, L)."""
    x3, cl = T.read_layout(x3)
    part, g = T._moment_partials(x3, cl, split, key)
    return part, g.grid[1], g.chunk


def apply(x3, m, v, coeffs, act=None, out_dtype=None, write=None, nbt=None, split=None, key=None):
    """y (N, C, L) of x3 with the per-(n, c) coefficients (A, B[, K, L']), in x3's layout; ``act`` (id, p0, p1)
    of ``activations.act_args`` or None; ``write`` = (upd, running_mean, running_var): the new values to copy into
    the buffers; ``nbt``: a num_batches_tracked to add 1 to."""
    x3, cl = T.read_layout(x3)
    return T._apply(x3, cl, m, v, stacked(coeffs), T._act(act), out_dtype, write, nbt, split, key)


def sums(x3, dy, m, v, coeffs, act=None, merged=True, split=None, key=None):
    """The coefficients' gradients [sum_l g t, sum_l g (, sum_l dy act(z), sum_l dy)], each (N, C); ``merged``
    False: each as the chunks' partials (SPLIT, N, C). dy in any floating dtype, copied into x3's layout."""
    x3, cl = T.read_layout(x3)
    out = T._sums(x3, cl, T.like(dy, x3, cl), m, v, stacked(coeffs), T._act(act), merged, split, key)
    return out if merged else out.unbind(1)


def dx(x3, dy, m, v, coeffs, dm, dv, gsum, act=None, batch=None, finish=None, split=None,
       finish_block=FINISH_BLOCK.value, key=None):
    """dx (x3's shape, dtype and layout) from the coefficients' VJP (dm, dv) and sum_l g (``gsum``: (N, C), or
    the (SPLIT, N, C) partials of ``sums(merged=False)``, or the sums kernel's whole buffer); ``batch`` = (mean,
    dmean, dvar, 1 / N); ``finish``: a ``common.BlockSums`` whose partial parameter gradients this launch sums."""
    x3, cl = T.read_layout(x3)
    return T._dx(x3, cl, T.like(dy, x3, cl), m, v, stacked(coeffs), stacked((dm, dv)), gsum, T._act(act), batch,
                 finish, split, finish_block, key)
